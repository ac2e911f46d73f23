package bpf

import (
	"debug/elf"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/arch/x86/x86asm"
)

func TestRetOffsets(t *testing.T) {
	// push rbp; mov rbp,rsp; test rax,rax; je +2; pop rbp; ret; xor eax,eax; pop rbp; ret; int3 int3
	code := []byte{0x55, 0x48, 0x89, 0xe5, 0x48, 0x85, 0xc0, 0x74, 0x02, 0x5d, 0xc3, 0x31, 0xc0, 0x5d, 0xc3, 0xcc, 0xcc}
	got, err := retOffsets(code)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != 10 || got[1] != 14 {
		t.Fatalf("retOffsets = %v, want [10 14]", got)
	}
	// A 0xc3 byte inside an instruction (mov eax, 0xc3) is not a RET.
	got, err = retOffsets([]byte{0xb8, 0xc3, 0x00, 0x00, 0x00, 0xc3})
	if err != nil || len(got) != 1 || got[0] != 5 {
		t.Fatalf("retOffsets(mov eax,0xc3; ret) = %v, %v; want [5]", got, err)
	}
}

func FuzzRetOffsets(f *testing.F) {
	f.Add([]byte{0xc3})
	f.Add([]byte{0x55, 0x48, 0x89, 0xe5, 0x5d, 0xc3, 0xcc})
	f.Fuzz(func(t *testing.T, code []byte) {
		rets, err := retOffsets(code)
		if err != nil {
			return
		}
		last := -1
		for _, r := range rets {
			if int(r) <= last || r >= uint64(len(code)) {
				t.Fatalf("RET offsets %v out of order or range for % x", rets, code)
			}
			last = int(r)
			inst, err := x86asm.Decode(code[r:], 64)
			if err != nil || inst.Op != x86asm.RET {
				t.Fatalf("offset %d is not a RET (%v, %v) in % x", r, inst, err, code)
			}
		}
	})
}

// The default version of each probed libibverbs function, not a compat
// one: ibv_reg_mr and ibv_dereg_mr have both in libibverbs 44.
func TestDefaultVersionRealLibibverbs(t *testing.T) {
	lib, err := FindLibibverbs(0)
	if err != nil {
		t.Skipf("skipping: %v", err)
	}
	f, err := elf.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"ibv_reg_mr", "ibv_reg_mr_iova2", "ibv_reg_dmabuf_mr", "ibv_rereg_mr", "ibv_dereg_mr"} {
		off, err := defaultVersionOffset(f, name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var versions []string
		for _, s := range syms {
			if s.Name != name || s.Section == elf.SHN_UNDEF {
				continue
			}
			o, err := fileOffset(f, s.Value)
			if err != nil {
				t.Fatal(err)
			}
			def := !s.VersionIndex.IsHidden()
			versions = append(versions, s.Version)
			if (o == off) != def {
				t.Errorf("%s@%s (default %v) at %#x; resolved %#x", name, s.Version, def, o, off)
			}
		}
		t.Logf("%s -> %#x (versions %v)", name, off, versions)
	}
	if _, err := defaultVersionOffset(f, "no_such_function"); !errors.Is(err, ErrNoSymbol) {
		t.Errorf("missing symbol: %v, want ErrNoSymbol", err)
	}
}

func TestLocateGoFunc(t *testing.T) {
	dir := helpers(t)
	f, err := elf.Open(filepath.Join(dir, "goreg"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, fn := range asMain(KnownGoFuncs) {
		loc, err := locateGoFunc(f, fn.Symbol)
		if err != nil {
			t.Fatalf("%s: %v", fn.Symbol, err)
		}
		if len(loc.rets) == 0 {
			t.Fatalf("%s: no RET", fn.Symbol)
		}
		t.Logf("%s: entry %#x, %d RETs", fn.Symbol, loc.entry, len(loc.rets))
	}
	if _, err := locateGoFunc(f, "main.noSuchFunc"); !errors.Is(err, ErrNoSymbol) {
		t.Errorf("missing symbol: %v, want ErrNoSymbol", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "goreg")); err != nil {
		t.Fatal(err)
	}
}
