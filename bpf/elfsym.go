package bpf

import (
	"debug/elf"
	"errors"
	"fmt"

	"golang.org/x/arch/x86/x86asm"
)

// ErrNoSymbol means the binary has no (default-version) definition of the
// requested function: a stripped binary, or a program that does not link
// the package.
var ErrNoSymbol = errors.New("symbol not found")

// fileOffset converts a virtual address of f to the file offset the kernel
// wants for a uprobe, through the executable PT_LOAD segment holding it.
func fileOffset(f *elf.File, vaddr uint64) (uint64, error) {
	for _, p := range f.Progs {
		if p.Type != elf.PT_LOAD || p.Flags&elf.PF_X == 0 {
			continue
		}
		if p.Vaddr <= vaddr && vaddr < p.Vaddr+p.Filesz {
			return vaddr - p.Vaddr + p.Off, nil
		}
	}
	return 0, fmt.Errorf("address %#x is in no executable segment", vaddr)
}

// defaultVersionOffset returns the file offset of the default version
// (name@@VER) of an exported function of a shared library. Libraries such
// as libibverbs keep compat versions (ibv_reg_mr@IBVERBS_1.0) beside the
// default one under the same bare name, and new programs link the default.
func defaultVersionOffset(f *elf.File, name string) (uint64, error) {
	syms, err := f.DynamicSymbols()
	if err != nil {
		return 0, fmt.Errorf("read dynamic symbols: %w", err)
	}
	var found []elf.Symbol
	for _, s := range syms {
		if s.Name != name || s.Section == elf.SHN_UNDEF || elf.ST_TYPE(s.Info) != elf.STT_FUNC {
			continue
		}
		found = append(found, s)
	}
	var pick *elf.Symbol
	for i := range found {
		s := &found[i]
		// Hidden versions are the non-default (single @) ones.
		if !s.HasVersion || !s.VersionIndex.IsHidden() {
			if pick != nil && pick.Value != s.Value {
				return 0, fmt.Errorf("%s: two default definitions (%#x, %#x)", name, pick.Value, s.Value)
			}
			pick = s
		}
	}
	if pick == nil {
		return 0, fmt.Errorf("%s: %w (no default version among %d definitions)", name, ErrNoSymbol, len(found))
	}
	return fileOffset(f, pick.Value)
}

// goFunc is where to put the probes of one Go function: its entry and
// every RET instruction, as file offsets.
type goFunc struct {
	entry uint64
	rets  []uint64
}

// locateGoFunc finds a Go function in the static symbol table of a Go
// binary and disassembles it to find its RET instructions.
func locateGoFunc(f *elf.File, symbol string) (goFunc, error) {
	if f.Machine != elf.EM_X86_64 {
		return goFunc{}, fmt.Errorf("machine %v: only x86-64 Go binaries are supported", f.Machine)
	}
	syms, err := f.Symbols()
	if err != nil {
		return goFunc{}, fmt.Errorf("read symbol table (stripped binary?): %w", err)
	}
	for _, s := range syms {
		if s.Name != symbol || elf.ST_TYPE(s.Info) != elf.STT_FUNC {
			continue
		}
		if int(s.Section) <= 0 || int(s.Section) >= len(f.Sections) {
			return goFunc{}, fmt.Errorf("%s: symbol in no section", symbol)
		}
		sec := f.Sections[s.Section]
		if s.Size == 0 || s.Value < sec.Addr || s.Value+s.Size > sec.Addr+sec.Size {
			return goFunc{}, fmt.Errorf("%s: bad extent %#x+%d", symbol, s.Value, s.Size)
		}
		code := make([]byte, s.Size)
		if _, err := sec.ReadAt(code, int64(s.Value-sec.Addr)); err != nil {
			return goFunc{}, fmt.Errorf("%s: read code: %w", symbol, err)
		}
		rets, err := retOffsets(code)
		if err != nil {
			return goFunc{}, fmt.Errorf("%s: %w", symbol, err)
		}
		if len(rets) == 0 {
			return goFunc{}, fmt.Errorf("%s: no RET instruction (function never returns?)", symbol)
		}
		entry, err := fileOffset(f, s.Value)
		if err != nil {
			return goFunc{}, fmt.Errorf("%s: %w", symbol, err)
		}
		g := goFunc{entry: entry}
		for _, r := range rets {
			g.rets = append(g.rets, entry+r)
		}
		return g, nil
	}
	return goFunc{}, fmt.Errorf("%s: %w", symbol, ErrNoSymbol)
}

// retOffsets decodes x86-64 code linearly and returns the offsets of its
// near RET instructions. Go emits no data inside function bodies, so a
// linear sweep sees every instruction; an undecodable byte stops us rather
// than letting a guess put a probe mid-instruction.
func retOffsets(code []byte) ([]uint64, error) {
	var rets []uint64
	for off := 0; off < len(code); {
		inst, err := x86asm.Decode(code[off:], 64)
		if err != nil {
			// Trailing INT3 padding is not part of the function proper.
			if allInt3(code[off:]) {
				break
			}
			return nil, fmt.Errorf("decode at +%#x: %w", off, err)
		}
		if inst.Op == x86asm.RET {
			rets = append(rets, uint64(off))
		}
		off += inst.Len
	}
	return rets, nil
}

func allInt3(b []byte) bool {
	for _, c := range b {
		if c != 0xcc {
			return false
		}
	}
	return true
}
