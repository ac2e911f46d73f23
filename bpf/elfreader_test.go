package bpf

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"testing"
)

var miniFuncs = []miniFunc{{"main.regMR", miniFramed}, {"main.enlargementMarker", miniLeaf}}

func openMini(t *testing.T, o miniOpts) *elf.File {
	t.Helper()
	f, err := elf.NewFile(bytes.NewReader(miniELF(miniFuncs, o)))
	if err != nil {
		t.Fatalf("synthetic binary: %v", err)
	}
	return f
}

// A synthetic binary resolves alike stripped and not, with and without
// code before runtime.text: entries at runtime.text plus the table's
// offsets, and the RET of each function.
func TestLocateSynthetic(t *testing.T) {
	for _, o := range []miniOpts{{}, {stripped: true}, {cPrefix: 0x100}, {cPrefix: 0x100, stripped: true}, {cPrefix: 5, stripped: true}} {
		f := openMini(t, o)
		text := f.Section(".text")
		runtimeText := (text.Addr + uint64(o.cPrefix) + goFuncAlign - 1) &^ (goFuncAlign - 1)
		want := map[string][2]uint64{
			"main.regMR":             {runtimeText, runtimeText + 19},
			"main.enlargementMarker": {runtimeText + 32, runtimeText + 32 + 6},
		}
		for sym, w := range want {
			loc, err := locateGoFunc(f, sym)
			if err != nil {
				t.Fatalf("%+v: %s: %v", o, sym, err)
			}
			entry, _ := fileOffset(f, w[0])
			ret, _ := fileOffset(f, w[1])
			if loc.entry != entry || len(loc.rets) != 1 || loc.rets[0] != ret {
				t.Errorf("%+v: %s at %#x, RETs %#x; want %#x, [%#x]", o, sym, loc.entry, loc.rets, entry, ret)
			}
		}
	}
}

// A function symbol whose size wraps addr+size round the address space
// is refused, not read.
func TestSymbolSizeOverflow(t *testing.T) {
	for _, size := range []uint64{^uint64(0) - 0x10, ^uint64(0), 1 << 63} {
		f := openMini(t, miniOpts{symSize: size})
		if loc, err := locateGoFunc(f, "main.regMR"); err == nil {
			t.Errorf("size %#x: located %+v, want a refusal", size, loc)
		} else {
			t.Logf("size %#x: %v", size, err)
		}
	}
}

// The ELF and .gopclntab reader never panics, whatever the file, and
// what it locates is consistent: RETs at or after the entry (an empty
// function is a lone RET), within the function's extent. Minimizing each new input of about 1 KiB takes up to
// a minute by default, so short runs want a bound on it:
//
//	go test -run '^$' -fuzz FuzzELFReader -fuzztime 60s -fuzzminimizetime 200x ./bpf/
func FuzzELFReader(f *testing.F) {
	for _, o := range []miniOpts{{}, {stripped: true}, {cPrefix: 0x100, stripped: true}, {symSize: ^uint64(0) - 0x10}} {
		f.Add(miniELF(miniFuncs, o))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := elf.NewFile(bytes.NewReader(data))
		if err != nil {
			return
		}
		g := newGoSyms(file)
		for _, sym := range []string{"main.regMR", "main.enlargementMarker", "runtime.text"} {
			loc, err := g.locate(sym)
			if err != nil {
				continue
			}
			if len(loc.rets) == 0 {
				t.Fatalf("%s: located with no RET", sym)
			}
			for _, r := range loc.rets {
				if r < loc.entry || r-loc.entry >= maxGoFuncSize {
					t.Fatalf("%s: RET %#x outside the function at %#x", sym, r, loc.entry)
				}
			}
		}
	})
}

// A stripped binary whose table is older than Go 1.18 cannot hold
// rdmagrpc's functions: ErrNoSymbol, which the watcher passes over
// quietly, while a table of no known format is an error.
func TestOldPclntab(t *testing.T) {
	for magic, noSym := range map[uint32]bool{pclnMagic12: true, pclnMagic116: true, 0x12345678: false} {
		data := miniELF(miniFuncs, miniOpts{stripped: true})
		f, err := elf.NewFile(bytes.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		binary.LittleEndian.PutUint32(data[f.Section(".gopclntab").Offset:], magic)
		f, err = elf.NewFile(bytes.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		_, err = locateGoFunc(f, "main.regMR")
		if err == nil || errors.Is(err, ErrNoSymbol) != noSym {
			t.Errorf("magic %#x: %v; want an error, ErrNoSymbol %v", magic, err, noSym)
		}
	}
}
