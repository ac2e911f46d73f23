package bpf

import (
	"debug/elf"
	"debug/gosym"
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

// goSyms finds Go functions in a binary: in its ELF symbol table, or,
// when that is stripped (-ldflags=-s), in .gopclntab, the function table
// every Go binary keeps for the runtime's own stack traces.
type goSyms struct {
	f     *elf.File
	syms  []elf.Symbol // nil: stripped
	table *gosym.Table // built on first use when stripped
	err   error
}

func newGoSyms(f *elf.File) *goSyms {
	g := &goSyms{f: f}
	if syms, err := f.Symbols(); err == nil {
		g.syms = syms
	}
	return g
}

// find returns the address and size of a Go function.
func (g *goSyms) find(symbol string) (addr, size uint64, err error) {
	if g.syms != nil {
		for _, s := range g.syms {
			if s.Name == symbol && elf.ST_TYPE(s.Info) == elf.STT_FUNC {
				return s.Value, s.Size, nil
			}
		}
		return 0, 0, fmt.Errorf("%s: %w", symbol, ErrNoSymbol)
	}
	if g.table == nil && g.err == nil {
		g.table, g.err = pclnTable(g.f)
	}
	if g.err != nil {
		return 0, 0, fmt.Errorf("%s: %w: no symbol table, and %v", symbol, ErrNoSymbol, g.err)
	}
	fn := g.table.LookupFunc(symbol)
	if fn == nil {
		return 0, 0, fmt.Errorf("%s: %w (not in .gopclntab)", symbol, ErrNoSymbol)
	}
	return fn.Entry, fn.End - fn.Entry, nil
}

// pclnTable reads the function table of a Go binary from .gopclntab.
func pclnTable(f *elf.File) (*gosym.Table, error) {
	pcln := f.Section(".gopclntab")
	text := f.Section(".text")
	if pcln == nil || text == nil {
		return nil, errors.New("no .gopclntab section (not a Go binary?)")
	}
	data, err := pcln.Data()
	if err != nil {
		return nil, fmt.Errorf("read .gopclntab: %w", err)
	}
	t, err := gosym.NewTable(nil, gosym.NewLineTable(data, text.Addr))
	if err != nil {
		return nil, fmt.Errorf("parse .gopclntab: %w", err)
	}
	return t, nil
}

// locateGoFunc finds a Go function of a Go binary (symbol table, else
// .gopclntab) and disassembles it to find its RET instructions.
func locateGoFunc(f *elf.File, symbol string) (goFunc, error) {
	return newGoSyms(f).locate(symbol)
}

func (g *goSyms) locate(symbol string) (goFunc, error) {
	f := g.f
	if f.Machine != elf.EM_X86_64 {
		return goFunc{}, fmt.Errorf("machine %v: only x86-64 Go binaries are supported", f.Machine)
	}
	addr, size, err := g.find(symbol)
	if err != nil {
		return goFunc{}, err
	}
	var sec *elf.Section
	for _, s := range f.Sections {
		if s.Type == elf.SHT_PROGBITS && s.Flags&elf.SHF_EXECINSTR != 0 && s.Addr <= addr && addr < s.Addr+s.Size {
			sec = s
			break
		}
	}
	if sec == nil || size == 0 || addr+size > sec.Addr+sec.Size {
		return goFunc{}, fmt.Errorf("%s: bad extent %#x+%d", symbol, addr, size)
	}
	code := make([]byte, size)
	if _, err := sec.ReadAt(code, int64(addr-sec.Addr)); err != nil {
		return goFunc{}, fmt.Errorf("%s: read code: %w", symbol, err)
	}
	rets, err := retOffsets(code)
	if err != nil {
		return goFunc{}, fmt.Errorf("%s: %w", symbol, err)
	}
	if len(rets) == 0 {
		return goFunc{}, fmt.Errorf("%s: no RET instruction (function never returns?)", symbol)
	}
	entry, err := fileOffset(f, addr)
	if err != nil {
		return goFunc{}, fmt.Errorf("%s: %w", symbol, err)
	}
	loc := goFunc{entry: entry}
	for _, r := range rets {
		loc.rets = append(loc.rets, entry+r)
	}
	return loc, nil
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
