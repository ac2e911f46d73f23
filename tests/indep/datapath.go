package indep

// Imm is the 32-bit immediate of section 4.1.
type Imm struct {
	Kind    uint8  // bits 31-29
	Ring    uint8  // bit 28
	Credits uint8  // bits 27-20
	Length  uint32 // bits 19-0
}

// Message kinds (section 4.1).
const (
	kindSmall   = 0
	kindLarge   = 1
	kindCredit  = 2
	kindEOF     = 3
	kindControl = 4
	kindReadEnd = 5
	kindClose   = 6
	kindRecordL = 7
)

// Encode packs the immediate.
func (i Imm) Encode() uint32 {
	return uint32(i.Kind&7)<<29 | uint32(i.Ring&1)<<28 | uint32(i.Credits)<<20 | i.Length&0xfffff
}

// DecodeImm unpacks an immediate.
func DecodeImm(v uint32) Imm {
	return Imm{Kind: uint8(v >> 29), Ring: uint8(v>>28) & 1, Credits: uint8(v >> 20), Length: v & 0xfffff}
}
