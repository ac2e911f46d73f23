package bpf

import (
	"errors"
	"fmt"

	"golang.org/x/arch/x86/x86asm"
)

// goFuncAlign is the alignment the Go linker gives every function on
// x86-64 (FuncAlign in cmd/internal/sys); an entry off it is not where a
// Go function starts.
const goFuncAlign = 32

// verifyGoCode checks that code, read at addr, is a whole Go function as
// the compiler emits it, and returns the offsets of its RET instructions,
// each the start of an instruction. A probe at an address that is not an
// instruction start corrupts the traced program, so every doubt is an
// error:
//   - the entry has Go's function alignment;
//   - the bytes decode as instructions from the entry to the end, or to
//     trailing INT3 padding, with no instruction crossing the end;
//   - the function opens as Go functions do: the stack-bound check
//     against the goroutine's stack guard (CMP of RSP, or of R12 holding
//     RSP less a large frame, with [R14+0x10]) followed by JBE; or,
//     for a function the compiler made nosplit, the frame set-up (PUSH
//     RBP, or SUB RSP); or it is a frameless leaf, which neither calls
//     nor touches the stack pointer anywhere;
//   - there is at least one RET.
//
// An entry shifted into another function fails one of these: it is not
// aligned, it lands mid-instruction, or it starts without a prologue yet
// later pops a frame.
func verifyGoCode(addr uint64, code []byte) ([]uint64, error) {
	if addr%goFuncAlign != 0 {
		return nil, fmt.Errorf("entry %#x is not %d-byte aligned as every Go function is", addr, goFuncAlign)
	}
	insts, offs, err := decodeAll(code)
	if err != nil {
		return nil, err
	}
	if len(insts) == 0 {
		return nil, errors.New("no instructions")
	}
	if err := checkPrologue(insts); err != nil {
		return nil, err
	}
	var rets []uint64
	for i, in := range insts {
		if in.Op == x86asm.RET {
			rets = append(rets, uint64(offs[i]))
		}
	}
	if len(rets) == 0 {
		return nil, errors.New("no RET instruction (function never returns?)")
	}
	return rets, nil
}

// decodeAll decodes x86-64 code linearly and returns its instructions and
// their offsets. Go emits no data inside function bodies, so a linear
// sweep sees every instruction; trailing INT3 padding is not part of the
// function proper, and anything else undecodable is an error rather than
// a guess.
func decodeAll(code []byte) ([]x86asm.Inst, []int, error) {
	var insts []x86asm.Inst
	var offs []int
	for off := 0; off < len(code); {
		inst, err := x86asm.Decode(code[off:], 64)
		if err != nil {
			if allInt3(code[off:]) {
				break
			}
			return nil, nil, fmt.Errorf("decode at +%#x: %w", off, err)
		}
		insts = append(insts, inst)
		offs = append(offs, off)
		off += inst.Len
	}
	return insts, offs, nil
}

// retOffsets returns the offsets of the near RET instructions of code.
func retOffsets(code []byte) ([]uint64, error) {
	insts, offs, err := decodeAll(code)
	if err != nil {
		return nil, err
	}
	var rets []uint64
	for i, in := range insts {
		if in.Op == x86asm.RET {
			rets = append(rets, uint64(offs[i]))
		}
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

// isStackGuard reports whether a is the operand [R14+0x10]: g.stackguard0, R14 holding the
// current goroutine under Go's register ABI.
func isStackGuard(a x86asm.Arg) bool {
	m, ok := a.(x86asm.Mem)
	return ok && m.Base == x86asm.R14 && m.Index == 0 && m.Segment == 0 && m.Disp == 0x10
}

func checkPrologue(insts []x86asm.Inst) error {
	// A frame too large for the guard's slack first computes RSP less the
	// frame in R12 (LEA, or MOV and SUB with a JB on wrap-around).
	i := 0
	for i < len(insts) && i < 3 && (insts[i].Args[0] == x86asm.R12 || insts[i].Op == x86asm.JB) {
		i++
	}
	if i < len(insts)-1 {
		in := insts[i]
		if in.Op == x86asm.CMP && (in.Args[0] == x86asm.RSP || in.Args[0] == x86asm.R12) && isStackGuard(in.Args[1]) {
			if insts[i+1].Op != x86asm.JBE {
				return fmt.Errorf("stack check followed by %v, not JBE", insts[i+1])
			}
			return nil
		}
	}
	first := insts[0]
	if first.Op == x86asm.PUSH && first.Args[0] == x86asm.RBP ||
		first.Op == x86asm.SUB && first.Args[0] == x86asm.RSP {
		return nil
	}
	for _, in := range insts {
		switch {
		case in.Op == x86asm.CALL || in.Op == x86asm.PUSH || in.Op == x86asm.POP || in.Op == x86asm.LEAVE:
			return fmt.Errorf("starts with %v, not a Go prologue, yet is no frameless leaf (%v)", first, in)
		case in.Args[0] == x86asm.RSP || in.Args[0] == x86asm.ESP:
			return fmt.Errorf("starts with %v, not a Go prologue, yet is no frameless leaf (%v)", first, in)
		}
	}
	return nil
}
