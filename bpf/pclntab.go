package bpf

import (
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
)

// Magic numbers of the function tables whose entries are offsets from
// runtime.text (Go 1.18 and Go 1.20 onwards). Older tables held absolute
// addresses; no binary that links rdmagrpc has one.
const (
	pclnMagic118 = 0xfffffff0
	pclnMagic120 = 0xfffffff1
	pclnMagic12  = 0xfffffffb // Go 1.2 to 1.15
	pclnMagic116 = 0xfffffffa // Go 1.16 and 1.17
)

// pclnHeaderSize is the pcHeader of runtime/symtab.go for 8-byte
// pointers: magic, two pad bytes, minLC, ptrSize, then nfunc, nfiles,
// textStart, and the offsets of funcnametab, cutab, filetab, pctab and
// pclntab from the header.
const pclnHeaderSize = 8 + 8*8

// pclnTab is the part of a .gopclntab that maps function names to code:
// the function table (nfunc entry offsets and _func offsets, then the
// end offset of the last function) and the function name table. Every
// accessor checks its bounds, so a corrupt table yields errors, never a
// panic or an out-of-range read.
type pclnTab struct {
	data        []byte
	nfunc       uint64
	textStart   uint64 // the header's copy; Go 1.26's linker leaves it 0
	funcnameOff uint64
	pclnOff     uint64 // start of the function table and of the _func records
}

// parsePcln checks a .gopclntab header and that the function table it
// describes lies inside data.
func parsePcln(data []byte) (*pclnTab, error) {
	if len(data) < pclnHeaderSize {
		return nil, fmt.Errorf(".gopclntab: %d bytes, shorter than its header", len(data))
	}
	le := binary.LittleEndian
	switch m := le.Uint32(data); m {
	case pclnMagic118, pclnMagic120:
	case pclnMagic12, pclnMagic116:
		return nil, fmt.Errorf(".gopclntab of a Go before 1.18, which cannot build rdmagrpc: %w", ErrNoSymbol)
	default:
		return nil, fmt.Errorf(".gopclntab: magic %#x is not a Go 1.18+ little-endian table", m)
	}
	if data[4] != 0 || data[5] != 0 || data[7] != 8 {
		return nil, fmt.Errorf(".gopclntab: pad %d,%d and pointer size %d, want 0,0 and 8", data[4], data[5], data[7])
	}
	p := &pclnTab{
		data:        data,
		nfunc:       le.Uint64(data[8:]),
		textStart:   le.Uint64(data[24:]),
		funcnameOff: le.Uint64(data[32:]),
		pclnOff:     le.Uint64(data[64:]),
	}
	size := uint64(len(data))
	if p.funcnameOff < pclnHeaderSize || p.funcnameOff >= size {
		return nil, fmt.Errorf(".gopclntab: function name table at %#x, outside its %#x bytes", p.funcnameOff, size)
	}
	if p.pclnOff < pclnHeaderSize || p.pclnOff >= size {
		return nil, fmt.Errorf(".gopclntab: function table at %#x, outside its %#x bytes", p.pclnOff, size)
	}
	// nfunc pairs of uint32 and one end offset, without overflowing.
	if avail := size - p.pclnOff; p.nfunc == 0 || avail < 4 || p.nfunc > (avail-4)/8 {
		return nil, fmt.Errorf(".gopclntab: %d functions do not fit in its %#x bytes", p.nfunc, size)
	}
	return p, nil
}

// entryOff is the offset from runtime.text of function i's entry; i ==
// nfunc gives the end of the last function.
func (p *pclnTab) entryOff(i uint64) uint32 {
	return binary.LittleEndian.Uint32(p.data[p.pclnOff+8*i:])
}

// name returns the name of function i, or false when its _func record or
// name lies outside the table.
func (p *pclnTab) name(i uint64) ([]byte, bool) {
	le := binary.LittleEndian
	funcOff := uint64(le.Uint32(p.data[p.pclnOff+8*i+4:]))
	rec := p.pclnOff + funcOff // no overflow: both are below 2^32 + len(data)
	if rec > uint64(len(p.data)) || uint64(len(p.data))-rec < 8 {
		return nil, false
	}
	if le.Uint32(p.data[rec:]) != p.entryOff(i) {
		return nil, false // the _func record disagrees with the table
	}
	nameOff := int32(le.Uint32(p.data[rec+4:]))
	if nameOff < 0 {
		return nil, false
	}
	start := p.funcnameOff + uint64(nameOff)
	if start >= uint64(len(p.data)) {
		return nil, false
	}
	s := p.data[start:]
	for j, c := range s {
		if c == 0 {
			return s[:j], true
		}
	}
	return nil, false
}

// lookup returns the entry and end offsets, from runtime.text, of the
// function named symbol. The end is the next function's entry, so the
// extent includes the padding after the function's last instruction.
func (p *pclnTab) lookup(symbol string) (entry, end uint32, err error) {
	for i := range p.nfunc {
		n, ok := p.name(i)
		if !ok {
			return 0, 0, fmt.Errorf(".gopclntab: function %d has a corrupt record or name", i)
		}
		if string(n) != symbol {
			continue
		}
		entry, end = p.entryOff(i), p.entryOff(i+1)
		if end <= entry {
			return 0, 0, fmt.Errorf(".gopclntab: ends at +%#x, not after its entry +%#x", end, entry)
		}
		return entry, end, nil
	}
	return 0, 0, fmt.Errorf("%w (not in .gopclntab)", ErrNoSymbol)
}

// Offsets in the runtime's moduledata (runtime/symtab.go), for 8-byte
// pointers: the pcHeader pointer, five slices (funcnametab, cutab,
// filetab, pctab, pclntable), the ftab slice, findfunctab, minpc, maxpc,
// then text. This layout has held since Go 1.16.
const (
	mdPcHeader    = 0
	mdFuncnametab = 8
	mdFtab        = 8 + 5*24
	mdFtabLen     = mdFtab + 8
	mdMinPC       = 8 + 6*24 + 8
	mdMaxPC       = mdMinPC + 8
	mdText        = mdMaxPC + 8
	mdSize        = mdText + 8
)

// moduleSections are where the linker puts runtime.firstmoduledata: its
// own section since Go 1.26, .noptrdata before.
var moduleSections = []string{".go.module", ".noptrdata", ".data.rel.ro", ".data"}

// textStart finds runtime.text, the address the function table's entry
// offsets count from. It is not .text's start: in a binary linked by the
// system linker (any cgo program) C code comes first. The symbol table
// has runtime.text when it is not stripped; a stripped binary still has
// the runtime's moduledata, whose text field the linker fills in, and
// which is recognised by its pointers into this very table. Both sources
// are used when present and must agree, and the result must account for
// the table's first and last entries exactly as moduledata's minpc and
// maxpc do.
func textStart(f *elf.File, syms []elf.Symbol, pcln *elf.Section, p *pclnTab) (uint64, error) {
	var fromSym uint64
	haveSym := false
	for _, s := range syms {
		if s.Name == "runtime.text" {
			fromSym, haveSym = s.Value, true
			break
		}
	}
	fromMD, mdErr := moduledataText(f, pcln.Addr, p)
	var text uint64
	switch {
	case haveSym && mdErr == nil && fromSym != fromMD:
		return 0, fmt.Errorf("runtime.text is %#x in the symbol table but %#x in moduledata", fromSym, fromMD)
	case haveSym:
		text = fromSym
	case mdErr == nil:
		text = fromMD
	default:
		return 0, fmt.Errorf("no runtime.text symbol, and %w", mdErr)
	}
	if p.textStart != 0 && p.textStart != text {
		return 0, fmt.Errorf(".gopclntab header says runtime.text is %#x, not %#x", p.textStart, text)
	}
	if !inExecSection(f, text) {
		return 0, fmt.Errorf("runtime.text %#x is in no executable section", text)
	}
	return text, nil
}

// moduledataText finds the moduledata that points at the function table
// at pclnAddr and returns its text field after checking it against the
// table.
func moduledataText(f *elf.File, pclnAddr uint64, p *pclnTab) (uint64, error) {
	le := binary.LittleEndian
	for _, name := range moduleSections {
		s := f.Section(name)
		if s == nil || s.Type != elf.SHT_PROGBITS {
			continue
		}
		data, err := s.Data()
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", name, err)
		}
		for off := 0; off+mdSize <= len(data); off += 8 {
			md := data[off : off+mdSize]
			if le.Uint64(md[mdPcHeader:]) != pclnAddr {
				continue
			}
			// Another word that happens to equal the address is not a
			// moduledata: its funcnametab and ftab must point into the
			// table as the header says, with nfunc+1 entries.
			if le.Uint64(md[mdFuncnametab:]) != pclnAddr+p.funcnameOff ||
				le.Uint64(md[mdFtab:]) != pclnAddr+p.pclnOff ||
				le.Uint64(md[mdFtabLen:]) != p.nfunc+1 {
				continue
			}
			text := le.Uint64(md[mdText:])
			minpc, maxpc := le.Uint64(md[mdMinPC:]), le.Uint64(md[mdMaxPC:])
			first, last := uint64(p.entryOff(0)), uint64(p.entryOff(p.nfunc))
			if minpc < text || minpc-text != first || maxpc < text || maxpc-text != last {
				return 0, fmt.Errorf("moduledata at %#x: text %#x, minpc %#x and maxpc %#x disagree with the function table (+%#x, +%#x)",
					s.Addr+uint64(off), text, minpc, maxpc, first, last)
			}
			return text, nil
		}
	}
	return 0, errors.New("no moduledata points at .gopclntab")
}

// inExecSection reports whether addr lies in an executable section.
func inExecSection(f *elf.File, addr uint64) bool {
	return execSection(f, addr) != nil
}

// execSection returns the executable section holding addr, or nil. Code
// is never compressed, and a compressed section has no ReaderAt.
func execSection(f *elf.File, addr uint64) *elf.Section {
	for _, s := range f.Sections {
		if s.Type == elf.SHT_PROGBITS && s.Flags&elf.SHF_EXECINSTR != 0 && s.Flags&elf.SHF_COMPRESSED == 0 && s.ReaderAt != nil &&
			addr >= s.Addr && addr-s.Addr < s.Size {
			return s
		}
	}
	return nil
}
