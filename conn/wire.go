package conn

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// The immediate data of every message:
//
//	bits 31–30  kind
//	bits 29–20  credits returned to the receiver of this message
//	bits 19–0   payload length (data only)
const (
	kindData   = 0
	kindCredit = 1 // zero-length: credits only
	kindEOF    = 2 // the writer closed its direction
	maxCredits = 1<<10 - 1
	maxLen     = 1<<20 - 1
)

func encodeImm(kind, credits, length int) uint32 {
	return uint32(kind)<<30 | uint32(credits)<<20 | uint32(length)
}

func decodeImm(imm uint32) (kind, credits, length int) {
	return int(imm >> 30), int(imm >> 20 & maxCredits), int(imm & maxLen)
}

// hello is the private data of connect and accept: where the sender's
// receive ring is.
type hello struct {
	ringAddr  uint64
	ringRKey  uint32
	slotSize  uint32
	slotCount uint32
}

const (
	helloMagic   = 0x52444d47 // "RDMG"
	helloVersion = 1
	helloLen     = 4 + 1 + 8 + 4 + 4 + 4
)

func (h hello) encode() []byte {
	b := make([]byte, helloLen)
	binary.BigEndian.PutUint32(b, helloMagic)
	b[4] = helloVersion
	binary.BigEndian.PutUint64(b[5:], h.ringAddr)
	binary.BigEndian.PutUint32(b[13:], h.ringRKey)
	binary.BigEndian.PutUint32(b[17:], h.slotSize)
	binary.BigEndian.PutUint32(b[21:], h.slotCount)
	return b
}

var errBadHello = errors.New("conn: peer's connection parameters are not rdmagrpc's")

// decodeHello checks a peer's parameters; private data arrives
// zero-padded, so only the prefix counts.
func decodeHello(b []byte) (hello, error) {
	var h hello
	if len(b) < helloLen || binary.BigEndian.Uint32(b) != helloMagic {
		return h, errBadHello
	}
	if b[4] != helloVersion {
		return h, fmt.Errorf("%w: protocol version %d, want %d", errBadHello, b[4], helloVersion)
	}
	h.ringAddr = binary.BigEndian.Uint64(b[5:])
	h.ringRKey = binary.BigEndian.Uint32(b[13:])
	h.slotSize = binary.BigEndian.Uint32(b[17:])
	h.slotCount = binary.BigEndian.Uint32(b[21:])
	if h.slotSize == 0 || h.slotSize > maxLen || h.slotCount == 0 || h.slotCount > maxCredits {
		return h, fmt.Errorf("%w: %d slots of %d bytes", errBadHello, h.slotCount, h.slotSize)
	}
	return h, nil
}
