package bpf

import (
	"debug/elf"
	"encoding/binary"
)

// miniFunc is a function of a synthetic Go binary.
type miniFunc struct {
	name string
	code []byte
}

// Code of synthetic functions, as the Go compiler shapes them.
var (
	// A function with a frame: stack check, frame set-up, epilogue, RET,
	// then the call to morestack and the jump back to the entry.
	miniFramed = []byte{
		0x49, 0x3b, 0x66, 0x10, // cmp rsp, [r14+0x10]
		0x76, 0x0e, // jbe +14 (the call below)
		0x55,             // push rbp
		0x48, 0x89, 0xe5, // mov rbp, rsp
		0x48, 0x83, 0xec, 0x10, // sub rsp, 0x10
		0x48, 0x83, 0xc4, 0x10, // add rsp, 0x10
		0x5d,                         // pop rbp
		0xc3,                         // ret
		0xe8, 0x00, 0x00, 0x00, 0x00, // call (morestack)
		0xeb, 0xe5, // jmp entry
	}
	// A frameless leaf: nop; mov eax, 1; ret.
	miniLeaf = []byte{0x90, 0xb8, 0x01, 0x00, 0x00, 0x00, 0xc3}
)

// miniOpts shape a synthetic binary.
type miniOpts struct {
	cPrefix  int  // bytes of non-Go code at .text's start, before runtime.text
	stripped bool // no .symtab
	// symSize, when non-zero, replaces the symbol table size of the
	// first function.
	symSize uint64
}

const miniBase = 0x400000

// miniELF builds a small x86-64 Go-like executable: .text holding the
// functions from runtime.text on, 32-byte aligned and INT3-padded; a Go
// 1.20+ .gopclntab listing them; a .go.module moduledata pointing at it;
// and, unless stripped, a symbol table. One executable PT_LOAD maps the
// whole file at miniBase.
func miniELF(funcs []miniFunc, o miniOpts) []byte {
	le := binary.LittleEndian
	align := func(b []byte, n int, pad byte) []byte {
		for len(b)%n != 0 {
			b = append(b, pad)
		}
		return b
	}
	const textOff = 0x100
	file := make([]byte, textOff)

	// .text
	text := make([]byte, 0, 256)
	for range o.cPrefix {
		text = append(text, 0x90)
	}
	text = align(text, goFuncAlign, 0xcc)
	runtimeText := uint64(miniBase + textOff + len(text))
	var entries []uint32
	for _, fn := range funcs {
		entries = append(entries, uint32(miniBase+textOff+len(text))-uint32(runtimeText))
		text = align(append(text, fn.code...), goFuncAlign, 0xcc)
	}
	end := uint32(miniBase+textOff+len(text)) - uint32(runtimeText)
	file = align(append(file, text...), 8, 0)

	// .gopclntab: header, names, function table, _func records.
	pclnFileOff := len(file)
	pclnAddr := uint64(miniBase + pclnFileOff)
	pcln := make([]byte, pclnHeaderSize)
	le.PutUint32(pcln, pclnMagic120)
	pcln[6], pcln[7] = 1, 8
	le.PutUint64(pcln[8:], uint64(len(funcs)))
	le.PutUint64(pcln[32:], pclnHeaderSize)
	var nameOffs []uint32
	for _, fn := range funcs {
		nameOffs = append(nameOffs, uint32(len(pcln)-pclnHeaderSize))
		pcln = append(append(pcln, fn.name...), 0)
	}
	for _, w := range []int{40, 48, 56} { // cutab, filetab, pctab: empty
		le.PutUint64(pcln[w:], uint64(len(pcln)))
	}
	pcln = align(pcln, 8, 0)
	pclnOff := len(pcln)
	le.PutUint64(pcln[64:], uint64(pclnOff))
	recs := (len(funcs)*8 + 4 + 7) &^ 7
	for i := range funcs {
		pcln = le.AppendUint32(pcln, entries[i])
		pcln = le.AppendUint32(pcln, uint32(recs+16*i))
	}
	pcln = align(le.AppendUint32(pcln, end), 8, 0)
	for i := range funcs {
		pcln = le.AppendUint32(pcln, entries[i])
		pcln = le.AppendUint32(pcln, nameOffs[i])
		pcln = append(pcln, make([]byte, 8)...)
	}
	file = align(append(file, pcln...), 8, 0)

	// .go.module
	modFileOff := len(file)
	md := make([]byte, mdSize)
	le.PutUint64(md[mdPcHeader:], pclnAddr)
	le.PutUint64(md[mdFuncnametab:], pclnAddr+pclnHeaderSize)
	le.PutUint64(md[mdFtab:], pclnAddr+uint64(pclnOff))
	le.PutUint64(md[mdFtabLen:], uint64(len(funcs)+1))
	le.PutUint64(md[mdMinPC:], runtimeText+uint64(entries[0]))
	le.PutUint64(md[mdMaxPC:], runtimeText+uint64(end))
	le.PutUint64(md[mdText:], runtimeText)
	file = append(file, md...)

	// .symtab and .strtab
	strtab := []byte{0}
	symtab := make([]byte, 24) // the null symbol
	addSym := func(name string, info byte, value, size uint64) {
		sym := make([]byte, 24)
		le.PutUint32(sym, uint32(len(strtab)))
		strtab = append(append(strtab, name...), 0)
		sym[4] = info
		le.PutUint16(sym[6:], 1) // .text
		le.PutUint64(sym[8:], value)
		le.PutUint64(sym[16:], size)
		symtab = append(symtab, sym...)
	}
	addSym("runtime.text", byte(elf.STB_LOCAL)<<4|byte(elf.STT_FUNC), runtimeText, 0)
	for i, fn := range funcs {
		size := uint64(len(fn.code))
		if i == 0 && o.symSize != 0 {
			size = o.symSize
		}
		addSym(fn.name, byte(elf.STB_GLOBAL)<<4|byte(elf.STT_FUNC), runtimeText+uint64(entries[i]), size)
	}
	file = align(file, 8, 0)
	symFileOff := len(file)
	file = append(file, symtab...)
	strFileOff := len(file)
	file = append(file, strtab...)

	// .shstrtab and the section headers.
	shstr := []byte{0}
	name := func(s string) uint32 {
		n := uint32(len(shstr))
		shstr = append(append(shstr, s...), 0)
		return n
	}
	type shdr struct {
		name          uint32
		typ           elf.SectionType
		flags         elf.SectionFlag
		off, size     int
		link, entsize uint32
	}
	shdrs := []shdr{
		{},
		{name(".text"), elf.SHT_PROGBITS, elf.SHF_ALLOC | elf.SHF_EXECINSTR, textOff, len(text), 0, 0},
		{name(".gopclntab"), elf.SHT_PROGBITS, elf.SHF_ALLOC, pclnFileOff, len(pcln), 0, 0},
		{name(".go.module"), elf.SHT_PROGBITS, elf.SHF_ALLOC | elf.SHF_WRITE, modFileOff, len(md), 0, 0},
	}
	if !o.stripped {
		shdrs = append(shdrs,
			shdr{name(".symtab"), elf.SHT_SYMTAB, 0, symFileOff, len(symtab), uint32(len(shdrs) + 1), 24},
			shdr{name(".strtab"), elf.SHT_STRTAB, 0, strFileOff, len(strtab), 0, 0})
	}
	shstrIdx := len(shdrs)
	shdrs = append(shdrs, shdr{name(".shstrtab"), elf.SHT_STRTAB, 0, len(file), 0, 0, 0})
	shdrs[shstrIdx].size = len(shstr)
	file = align(append(file, shstr...), 8, 0)
	shoff := len(file)
	for _, s := range shdrs {
		h := make([]byte, 64)
		le.PutUint32(h, s.name)
		le.PutUint32(h[4:], uint32(s.typ))
		le.PutUint64(h[8:], uint64(s.flags))
		if s.flags&elf.SHF_ALLOC != 0 {
			le.PutUint64(h[16:], uint64(miniBase+s.off))
		}
		le.PutUint64(h[24:], uint64(s.off))
		le.PutUint64(h[32:], uint64(s.size))
		le.PutUint32(h[40:], s.link)
		if s.typ == elf.SHT_SYMTAB {
			le.PutUint32(h[44:], 1) // one local symbol (the null one) first
		}
		le.PutUint64(h[48:], 8)
		le.PutUint64(h[56:], uint64(s.entsize))
		file = append(file, h...)
	}

	// ELF and program headers.
	copy(file, []byte{0x7f, 'E', 'L', 'F', byte(elf.ELFCLASS64), byte(elf.ELFDATA2LSB), byte(elf.EV_CURRENT)})
	le.PutUint16(file[16:], uint16(elf.ET_EXEC))
	le.PutUint16(file[18:], uint16(elf.EM_X86_64))
	le.PutUint32(file[20:], uint32(elf.EV_CURRENT))
	le.PutUint64(file[24:], runtimeText)
	le.PutUint64(file[32:], 64)
	le.PutUint64(file[40:], uint64(shoff))
	le.PutUint16(file[52:], 64)
	le.PutUint16(file[54:], 56)
	le.PutUint16(file[56:], 1)
	le.PutUint16(file[58:], 64)
	le.PutUint16(file[60:], uint16(len(shdrs)))
	le.PutUint16(file[62:], uint16(shstrIdx))
	ph := file[64:]
	le.PutUint32(ph, uint32(elf.PT_LOAD))
	le.PutUint32(ph[4:], uint32(elf.PF_R|elf.PF_X))
	le.PutUint64(ph[16:], miniBase)
	le.PutUint64(ph[24:], miniBase)
	le.PutUint64(ph[32:], uint64(len(file)))
	le.PutUint64(ph[40:], uint64(len(file)))
	le.PutUint64(ph[48:], 0x1000)
	return file
}
