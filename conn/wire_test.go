package conn

import (
	"bytes"
	"testing"
)

// Every decoder of peer input: whatever the bytes, no panic, and what is
// accepted re-encodes to the same bytes.

func FuzzDecodeRecord(f *testing.F) {
	f.Add(record{typ: recAck, seq: 7, addr: 1 << 40, rkey: 99, size: 32 << 10, count: 4}.encode(make([]byte, recordLen)))
	f.Add(record{typ: recRefuse, seq: 1}.encode(make([]byte, recordLen)))
	f.Add(make([]byte, recordLen))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeRecord(b)
		if err != nil {
			return
		}
		if re := r.encode(make([]byte, recordLen)); !bytes.Equal(re, b) {
			t.Fatalf("record %+v re-encodes to %x, was %x", r, re, b)
		}
	})
}

func FuzzDecodeHello(f *testing.F) {
	f.Add(hello{ringAddr: 4096, ringRKey: 5, slotSize: 1024, slotCount: 4}.encode())
	f.Add(make([]byte, 56))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHello(b)
		if err != nil {
			return
		}
		if re := h.encode(); !bytes.Equal(re, b[:helloLen]) {
			t.Fatalf("hello %+v re-encodes to %x, was %x", h, re, b[:helloLen])
		}
	})
}

func FuzzImm(f *testing.F) {
	f.Add(uint32(0))
	f.Add(^uint32(0))
	f.Fuzz(func(t *testing.T, imm uint32) {
		kind, ring, credits, n := decodeImm(imm)
		if encodeImm(kind, ring, credits, n) != imm {
			t.Fatalf("immediate %#x does not round-trip", imm)
		}
	})
}
