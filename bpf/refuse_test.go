package bpf

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// patchedCopy writes a copy of the binary src with patch applied to its
// bytes, and returns its path.
func patchedCopy(t *testing.T, src, name string, patch func(f *elf.File, data []byte)) string {
	t.Helper()
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	f, err := elf.NewFile(bytes.NewReader(bytes.Clone(data)))
	if err != nil {
		t.Fatal(err)
	}
	patch(f, data)
	dst := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(dst, data, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

func pclnOf(t *testing.T, f *elf.File) (*elf.Section, *pclnTab) {
	t.Helper()
	sec := f.Section(".gopclntab")
	data, err := sec.Data()
	if err != nil {
		t.Fatal(err)
	}
	p, err := parsePcln(data)
	if err != nil {
		t.Fatal(err)
	}
	return sec, p
}

// shiftModuleText moves moduledata's text by delta, and its minpc and
// maxpc with it when all is set (a table that is wrong yet consistent).
func shiftModuleText(t *testing.T, delta uint64, all bool) func(*elf.File, []byte) {
	return func(f *elf.File, data []byte) {
		le := binary.LittleEndian
		pcln := f.Section(".gopclntab")
		mod := f.Section(".go.module")
		if mod == nil {
			t.Fatal("no .go.module section")
		}
		for off := mod.Offset; off < mod.Offset+mod.Size; off += 8 {
			if le.Uint64(data[off:]) != pcln.Addr {
				continue
			}
			fields := []uint64{mdText}
			if all {
				fields = append(fields, mdMinPC, mdMaxPC)
			}
			for _, fld := range fields {
				le.PutUint64(data[off+fld:], le.Uint64(data[off+fld:])+delta)
			}
			return
		}
		t.Fatal("no moduledata points at .gopclntab")
	}
}

// shiftPclnEntry moves symbol's entry in .gopclntab (the function table
// and the function's own record) by delta.
func shiftPclnEntry(t *testing.T, symbol string, delta uint32) func(*elf.File, []byte) {
	return func(f *elf.File, data []byte) {
		le := binary.LittleEndian
		sec, p := pclnOf(t, f)
		for i := range p.nfunc {
			if n, _ := p.name(i); string(n) != symbol {
				continue
			}
			at := sec.Offset + p.pclnOff + 8*i
			rec := sec.Offset + p.pclnOff + uint64(le.Uint32(data[at+4:]))
			le.PutUint32(data[at:], le.Uint32(data[at:])+delta)
			le.PutUint32(data[rec:], le.Uint32(data[rec:])+delta)
			return
		}
		t.Fatalf("%s not in .gopclntab", symbol)
	}
}

// shiftSymbol moves symbol's address in the ELF symbol table by delta.
func shiftSymbol(t *testing.T, symbol string, delta uint64) func(*elf.File, []byte) {
	return func(f *elf.File, data []byte) {
		syms, err := f.Symbols()
		if err != nil {
			t.Fatal(err)
		}
		tab := f.Section(".symtab")
		for j, s := range syms {
			if s.Name == symbol {
				// Symbols leaves out the null symbol at index 0.
				at := tab.Offset + uint64(j+1)*24 + 8
				binary.LittleEndian.PutUint64(data[at:], s.Value+delta)
				return
			}
		}
		t.Fatalf("%s not in the symbol table", symbol)
	}
}

// corruptBuilds are copies of the externally linked builds of
// testdata/connenlarge (C code before runtime.text) with one wrong
// address each, as a damaged or misread table would give.
func corruptBuilds(t *testing.T) map[string]string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and patches binaries")
	}
	byName := map[string][]string{}
	for _, b := range connBuilds {
		byName[b.name] = b.flags
	}
	stripped := buildConn(t, "ext-stripped", byName["ext-stripped"])
	full := buildConn(t, "ext", byName["ext"])
	regMR := Module + "/transport/shm.regMR"
	marker := Module + "/conn.enlargementMarker"
	bins := map[string]string{
		"moduledata text off by 0x100":            patchedCopy(t, stripped, "text", shiftModuleText(t, 0x100, false)),
		"moduledata text, minpc, maxpc off 0x100": patchedCopy(t, stripped, "textall", shiftModuleText(t, 0x100, true)),
		"moduledata text, minpc, maxpc off -0x20": patchedCopy(t, stripped, "textback", shiftModuleText(t, ^uint64(0x20-1), true)),
		"symbol table's regMR off by 0x20":        patchedCopy(t, full, "symtab", shiftSymbol(t, regMR, 0x20)),
		"pclntab's regMR off by 0x20 (symtab)":    patchedCopy(t, full, "pclnfull", shiftPclnEntry(t, regMR, 0x20)),
	}
	for _, d := range []uint32{1, 4, 0x20, 0x40, 0x100} {
		bins[fmt.Sprintf("pclntab's regMR off by %#x", d)] = patchedCopy(t, stripped, fmt.Sprintf("regmr%x", d), shiftPclnEntry(t, regMR, d))
	}
	bins["pclntab's marker off by 0x20"] = patchedCopy(t, stripped, "marker", shiftPclnEntry(t, marker, 0x20))
	return bins
}

// Every wrong address is refused before any probe is placed, with an
// error that is not mistaken for a missing function.
func TestLocateRefusesCorruptTables(t *testing.T) {
	for name, bin := range corruptBuilds(t) {
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatal(err)
		}
		g := newGoSyms(f)
		var errs []error
		for _, fn := range KnownGoFuncs {
			if _, err := g.locate(fn.Symbol); err != nil {
				errs = append(errs, err)
			}
		}
		f.Close()
		err = errors.Join(errs...)
		if err == nil || errors.Is(err, ErrNoSymbol) {
			t.Errorf("%s: located every function (err %v), want a refusal", name, err)
			continue
		}
		t.Logf("%s: %v", name, err)
	}
}

// The tracer attaches none of a corrupt binary's probes, though some of
// its functions are located correctly, and says why.
func TestAttachRefusesCorruptBinary(t *testing.T) {
	requireRoot(t)
	bins := corruptBuilds(t)
	tr, err := Open(Options{})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	for name, bin := range bins {
		got, err := tr.AttachGoFuncs(bin, KnownGoFuncs)
		if err == nil || !strings.Contains(err.Error(), "refusing to attach any probe") {
			t.Errorf("%s: attached %v, err %v; want a refusal", name, got, err)
		}
	}
	if a := tr.Attached(); len(a) != 0 {
		t.Errorf("attached %v to corrupt binaries", a)
	}
	// The same tracer attaches the intact build.
	bin := buildConn(t, "ext-stripped", connBuilds[5].flags)
	if got, err := tr.AttachGoFuncs(bin, KnownGoFuncs); err != nil || len(got) != len(KnownGoFuncs) {
		t.Errorf("intact build: attached %v, %v", got, err)
	}
}

// A function's code verifies from its entry and from no other byte of
// its first 64: every shifted start is misaligned, mid-instruction or
// without a prologue.
func TestVerifyRefusesShiftedEntry(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a binary")
	}
	bin := buildConn(t, "ext", connBuilds[4].flags)
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g := newGoSyms(f)
	for _, fn := range KnownGoFuncs {
		addr, size, err := g.find(fn.Symbol)
		if err != nil {
			t.Fatal(err)
		}
		code := make([]byte, size)
		if _, err := f.Section(".text").ReadAt(code, int64(addr-f.Section(".text").Addr)); err != nil {
			t.Fatal(err)
		}
		if _, err := verifyGoCode(addr, code); err != nil {
			t.Fatalf("%s: %v", fn.Symbol, err)
		}
		for k := uint64(1); k < 64 && k < size; k++ {
			if rets, err := verifyGoCode(addr+k, code[k:]); err == nil {
				t.Errorf("%s shifted by %d: verified, RETs %v", fn.Symbol, k, rets)
			}
		}
	}
}
