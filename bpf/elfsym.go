package bpf

import (
	"debug/elf"
	"errors"
	"fmt"
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
		if vaddr >= p.Vaddr && vaddr-p.Vaddr < p.Filesz {
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

// maxGoFuncSize bounds the code read for one function. The compiler emits
// nothing near it; a larger extent comes from a corrupt table.
const maxGoFuncSize = 16 << 20

// goSyms finds Go functions in a binary through .gopclntab, the function
// table every Go binary keeps for the runtime's own stack traces, and,
// where the binary has one, its ELF symbol table, which must agree.
type goSyms struct {
	f    *elf.File
	syms []elf.Symbol // nil: stripped

	loaded  bool
	pcln    *pclnTab
	pclnErr error

	haveText bool
	text     uint64 // runtime.text: what the table's offsets count from
	textErr  error
}

func newGoSyms(f *elf.File) *goSyms {
	g := &goSyms{f: f}
	if syms, err := f.Symbols(); err == nil {
		g.syms = syms
	}
	return g
}

func (g *goSyms) loadPcln() {
	if g.loaded {
		return
	}
	g.loaded = true
	sec := g.f.Section(".gopclntab")
	if sec == nil || sec.Type == elf.SHT_NOBITS {
		// Every Go binary that can link rdmagrpc has the section.
		g.pclnErr = fmt.Errorf("no .gopclntab section (not a Go binary?): %w", ErrNoSymbol)
		return
	}
	data, err := sec.Data()
	if err != nil {
		g.pclnErr = fmt.Errorf("read .gopclntab: %w", err)
		return
	}
	g.pcln, g.pclnErr = parsePcln(data)
}

// fromPcln returns a function's address and extent (up to the next
// function) from .gopclntab. runtime.text is looked for only once a
// function is found, so that binaries without the functions cost no more
// than the name lookup.
func (g *goSyms) fromPcln(symbol string) (addr, size uint64, err error) {
	g.loadPcln()
	if g.pclnErr != nil {
		return 0, 0, g.pclnErr
	}
	entry, end, err := g.pcln.lookup(symbol)
	if err != nil {
		return 0, 0, err
	}
	if !g.haveText {
		g.haveText = true
		g.text, g.textErr = textStart(g.f, g.syms, g.f.Section(".gopclntab"), g.pcln)
	}
	if g.textErr != nil {
		return 0, 0, fmt.Errorf(".gopclntab: %w", g.textErr)
	}
	if g.text > ^uint64(0)-uint64(end) {
		return 0, 0, fmt.Errorf("runtime.text %#x plus +%#x overflows", g.text, end)
	}
	return g.text + uint64(entry), uint64(end - entry), nil
}

// find returns the address and size of a Go function. With a symbol
// table, the symbol's address must be the table's entry for the function
// and its size must fit in the table's extent.
func (g *goSyms) find(symbol string) (addr, size uint64, err error) {
	pAddr, pSize, pErr := g.fromPcln(symbol)
	if g.syms == nil {
		if errors.Is(pErr, ErrNoSymbol) {
			return 0, 0, fmt.Errorf("%s: %w", symbol, pErr)
		}
		if pErr != nil {
			return 0, 0, fmt.Errorf("%s: no symbol table, and %w", symbol, pErr)
		}
		return pAddr, pSize, nil
	}
	var sym *elf.Symbol
	for i := range g.syms {
		s := &g.syms[i]
		if s.Name == symbol && elf.ST_TYPE(s.Info) == elf.STT_FUNC {
			sym = s
			break
		}
	}
	switch {
	case sym == nil && errors.Is(pErr, ErrNoSymbol):
		return 0, 0, fmt.Errorf("%s: %w", symbol, ErrNoSymbol)
	case sym == nil && pErr == nil:
		return 0, 0, fmt.Errorf("%s: in .gopclntab at %#x but not in the symbol table", symbol, pAddr)
	case sym == nil:
		return 0, 0, fmt.Errorf("%s: %w (symbol table), and %w", symbol, ErrNoSymbol, pErr)
	case pErr != nil:
		return 0, 0, fmt.Errorf("%s: cannot check the symbol table against .gopclntab: %w", symbol, pErr)
	case sym.Value != pAddr || sym.Size == 0 || sym.Size > pSize:
		return 0, 0, fmt.Errorf("%s: symbol table says %#x+%#x, .gopclntab %#x+%#x", symbol, sym.Value, sym.Size, pAddr, pSize)
	}
	return sym.Value, sym.Size, nil
}

// locateGoFunc finds a Go function of a Go binary and the RET
// instructions in it, verified as verifyGoCode says.
func locateGoFunc(f *elf.File, symbol string) (goFunc, error) {
	return newGoSyms(f).locate(symbol)
}

func (g *goSyms) locate(symbol string) (goFunc, error) {
	f := g.f
	if f.Machine != elf.EM_X86_64 || f.Class != elf.ELFCLASS64 {
		return goFunc{}, fmt.Errorf("machine %v: only x86-64 Go binaries are supported", f.Machine)
	}
	addr, size, err := g.find(symbol)
	if err != nil {
		return goFunc{}, err
	}
	sec := execSection(f, addr)
	if sec == nil || size == 0 || size > maxGoFuncSize || size > sec.Size-(addr-sec.Addr) {
		return goFunc{}, fmt.Errorf("%s: extent %#x+%#x is not inside an executable section", symbol, addr, size)
	}
	code := make([]byte, size)
	if _, err := sec.ReadAt(code, int64(addr-sec.Addr)); err != nil {
		return goFunc{}, fmt.Errorf("%s: read code at %#x: %w", symbol, addr, err)
	}
	rets, err := verifyGoCode(addr, code)
	if err != nil {
		return goFunc{}, fmt.Errorf("%s at %#x: %w", symbol, addr, err)
	}
	entry, err := fileOffset(f, addr)
	if err != nil {
		return goFunc{}, fmt.Errorf("%s: %w", symbol, err)
	}
	// The whole function must be mapped by the same segment, so that the
	// RETs' file offsets are entry plus their offsets.
	if last, err := fileOffset(f, addr+size-1); err != nil || last != entry+size-1 {
		return goFunc{}, fmt.Errorf("%s: extent %#x+%#x crosses a segment boundary", symbol, addr, size)
	}
	loc := goFunc{entry: entry}
	for _, r := range rets {
		loc.rets = append(loc.rets, entry+r)
	}
	return loc, nil
}
