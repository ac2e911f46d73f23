package conn

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"slices"
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
	// A peer from before the flags byte.
	f.Add(hello{ringAddr: 4096, ringRKey: 5, slotSize: 1024, slotCount: 4}.encode()[:helloLen-1])
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHello(b)
		if err != nil {
			return
		}
		want := b
		if len(b) < helloLen {
			want = append(slices.Clone(b), 0) // no flags
		}
		if re := h.encode(); !bytes.Equal(re, want[:helloLen]) {
			t.Fatalf("hello %+v re-encodes to %x, was %x", h, re, want[:helloLen])
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

// FuzzRecordContent reaches what FuzzDecodeRecord rarely gets past the
// checksum to: the content checks. The input is a record's fields in
// wire order (type, seq, addr, rkey, size, count, addr2, rkey2), framed
// and checksummed as a peer would send them; a record is accepted
// exactly when its type is known and its fields fit that type, and
// decodes to what was encoded.
func FuzzRecordContent(f *testing.F) {
	field := func(r record) []byte { return r.encode(make([]byte, recordLen))[4:41] }
	f.Add(field(record{typ: recRequest, seq: 1, size: DefaultLargeSize, count: DefaultLargeCount}))
	f.Add(field(record{typ: recAck, seq: 1, addr: 1 << 40, rkey: 7, size: DefaultLargeSize, count: DefaultLargeCount}))
	f.Add(field(record{typ: recRefuse, seq: 2}))
	f.Add(field(record{typ: recAdvert, seq: 3, addr: 1 << 40, rkey: 9, size: 1 << 20}))
	f.Add(field(record{typ: recRead, seq: 4, count: 3, rkey: 9, addr: 1 << 40, size: 4096, addr2: 1 << 41, rkey2: 11}))
	f.Fuzz(func(t *testing.T, fields []byte) {
		b := make([]byte, recordLen)
		binary.BigEndian.PutUint32(b, ctlHead)
		copy(b[4:41], fields)
		binary.BigEndian.PutUint32(b[41:], crc32.ChecksumIEEE(b[:41]))
		binary.BigEndian.PutUint32(b[45:], ctlTail)
		r, err := decodeRecord(b)
		if errors.Is(err, errTornRecord) {
			t.Fatalf("a well-framed record taken as torn: %v", err)
		}
		var want bool
		switch r.typ {
		case recRequest, recAck:
			want = checkRing(r.size, r.count) == nil
		case recRefuse:
			want = true
		case recAdvert, recRead:
			want = r.size > 0
		}
		if (err == nil) != want {
			t.Fatalf("record %+v: accepted %v, want %v (%v)", r, err == nil, want, err)
		}
		if err == nil && !bytes.Equal(r.encode(make([]byte, recordLen)), b) {
			t.Fatalf("record %+v does not re-encode to its bytes", r)
		}
	})
}
