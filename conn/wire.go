package conn

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// The immediate data of every message:
//
//	bits 31–29  kind
//	bit  28     which of the receiver's rings the returned credits free
//	bits 27–20  credits returned
//	bits 19–0   payload length
//
// doc/protocol.md (§4.1) calls bit 28 R and words it from the other end:
// "the receiver" above is the receiver of the data, which sends this
// message; R names one of its rings, the one the recipient of the
// message writes into (receivedLocked adds the credits to tx[R]).
const (
	kindSmall   = 0 // data in the receiver's small ring
	kindLarge   = 1 // data in the receiver's large ring
	kindCredit  = 2 // zero-length: credits only (length 0), or a park or resume (park.go)
	kindEOF     = 3 // the writer closed its direction
	kindControl = 4 // a control record in the receiver's small ring (kindRecordL: large)
	kindReadEnd = 5 // rendezvous: the last segment of a read request; length = its sequence
	kindClose   = 6 // the peer closed: end of its stream, and it reads no more
	kindRecordL = 7 // a control record in the receiver's large ring
	maxCredits  = 1<<8 - 1
	maxLen      = 1<<20 - 1
)

const (
	small = 0
	large = 1
)

func encodeImm(kind, ring, credits, length int) uint32 {
	return uint32(kind)<<29 | uint32(ring)<<28 | uint32(credits)<<20 | uint32(length)
}

func decodeImm(imm uint32) (kind, ring, credits, length int) {
	return int(imm >> 29), int(imm >> 28 & 1), int(imm >> 20 & maxCredits), int(imm & maxLen)
}

// hello is the private data of connect and accept: where the sender's
// small receive ring is.
type hello struct {
	ringAddr  uint64
	ringRKey  uint32
	slotSize  uint32
	slotCount uint32
	flags     uint8
}

const (
	helloMagic   = 0x52444d47 // "RDMG"
	helloVersion = 3
	// helloLen: a version 3 peer that predates flags sends one byte less;
	// private data arrives zero-padded, so it reads as no flags.
	helloLen = 4 + 1 + 8 + 4 + 4 + 4 + 1

	// helloParks: my small ring can give its pages back while the
	// connection idles (park.go): park your writes into it when idle.
	helloParks = 1
)

func (h hello) encode() []byte {
	b := make([]byte, helloLen)
	binary.BigEndian.PutUint32(b, helloMagic)
	b[4] = helloVersion
	binary.BigEndian.PutUint64(b[5:], h.ringAddr)
	binary.BigEndian.PutUint32(b[13:], h.ringRKey)
	binary.BigEndian.PutUint32(b[17:], h.slotSize)
	binary.BigEndian.PutUint32(b[21:], h.slotCount)
	b[25] = h.flags
	return b
}

var errBadHello = errors.New("conn: peer's connection parameters are not rdmagrpc's")

// decodeHello checks a peer's parameters; private data arrives
// zero-padded, so only the prefix counts.
func decodeHello(b []byte) (hello, error) {
	var h hello
	if len(b) < helloLen-1 || binary.BigEndian.Uint32(b) != helloMagic {
		return h, errBadHello
	}
	if b[4] != helloVersion {
		return h, fmt.Errorf("%w: protocol version %d, want %d", errBadHello, b[4], helloVersion)
	}
	h.ringAddr = binary.BigEndian.Uint64(b[5:])
	h.ringRKey = binary.BigEndian.Uint32(b[13:])
	h.slotSize = binary.BigEndian.Uint32(b[17:])
	h.slotCount = binary.BigEndian.Uint32(b[21:])
	if len(b) >= helloLen {
		h.flags = b[25]
	}
	if err := checkRing(h.slotSize, h.slotCount); err != nil {
		return h, fmt.Errorf("%w: %v", errBadHello, err)
	}
	return h, nil
}

func checkRing(size, count uint32) error {
	if size < minSlot || size > maxLen || count < 2 || count > maxCredits {
		return fmt.Errorf("ring of %d slots of %d bytes: want 2–%d slots of %d–%d bytes", count, size, maxCredits, minSlot, maxLen)
	}
	return nil
}

// minSlot: a slot must hold a control record.
const minSlot = 64

// Control records (enlargement request, ack, refusal, shrink, adverts
// and read requests) travel in a slot of the small ring, framed by a
// head flag and a tail flag with a checksum between: a record is taken
// only when both flags are there and the checksum matches, so a torn or
// corrupt acknowledgement counts as not received.
const (
	ctlHead = 0x454e4c47 // "ENLG"
	ctlTail = 0x21444e45 // "END!"

	recRequest = 1 // please provision large buffers for this connection
	recAck     = 2 // provisioned: here they are
	recRefuse  = 3 // cannot (budget, registration failure)
	recAdvert  = 4 // rendezvous: a message waits in the holder's registered memory
	recRead    = 5 // rendezvous: please write this part of it into my memory
	recShrink  = 6 // the last message into your large ring: drop it once read
	// recShrinkAsk: my budget is short, shrink your large direction when
	// idle (pressure.go); sent only to peers whose request said they
	// take it.
	recShrinkAsk = 7

	recordLen = 4 + 1 + 4 + 8 + 4 + 4 + 4 + 8 + 4 + 4 + 4
)

// record is one control record.
//
//	request  size, count: the large ring the writer asks for
//	ack      addr, rkey, size, count: the large ring provisioned; addr2:
//	         ackKeepsSmall when the small ring stays (shrink possible)
//	refuse   seq only
//	advert   seq; addr, size: the message in the holder's memory; rkey: a
//	         token the read requests must quote (the holder's memory is not
//	         remotely accessible: it writes, the peer never reads)
//	read     seq: of this request; count: the advert's seq; rkey: its
//	         token; addr, size: the source segment; addr2, rkey2: the
//	         destination segment in the requester's memory
//	shrink   nothing: the writer's last message into this large ring
type record struct {
	typ   uint8
	seq   uint32
	addr  uint64
	rkey  uint32
	size  uint32
	count uint32
	addr2 uint64
	rkey2 uint32
}

func (r record) encode(b []byte) []byte {
	b = b[:recordLen]
	binary.BigEndian.PutUint32(b, ctlHead)
	b[4] = r.typ
	binary.BigEndian.PutUint32(b[5:], r.seq)
	binary.BigEndian.PutUint64(b[9:], r.addr)
	binary.BigEndian.PutUint32(b[17:], r.rkey)
	binary.BigEndian.PutUint32(b[21:], r.size)
	binary.BigEndian.PutUint32(b[25:], r.count)
	binary.BigEndian.PutUint64(b[29:], r.addr2)
	binary.BigEndian.PutUint32(b[37:], r.rkey2)
	binary.BigEndian.PutUint32(b[41:], crc32.ChecksumIEEE(b[:41]))
	binary.BigEndian.PutUint32(b[45:], ctlTail)
	return b
}

var errBadRecord = errors.New("conn: malformed control record")

// errTornRecord is a record whose framing does not hold (head flag, tail
// flag, checksum): torn or corrupted on its way, it counts as not
// received (the writer's acknowledgement time-out and retry recover). A record whose
// framing holds but whose content is invalid was sent that way: a
// protocol violation.
var errTornRecord = fmt.Errorf("%w: torn or corrupt", errBadRecord)

func decodeRecord(b []byte) (record, error) {
	var r record
	if len(b) != recordLen {
		return r, fmt.Errorf("%w: %d bytes, want %d", errTornRecord, len(b), recordLen)
	}
	if binary.BigEndian.Uint32(b) != ctlHead {
		return r, fmt.Errorf("%w: no head flag", errTornRecord)
	}
	if binary.BigEndian.Uint32(b[45:]) != ctlTail {
		return r, fmt.Errorf("%w: no tail flag", errTornRecord)
	}
	if binary.BigEndian.Uint32(b[41:]) != crc32.ChecksumIEEE(b[:41]) {
		return r, fmt.Errorf("%w: checksum mismatch", errTornRecord)
	}
	r = record{typ: b[4], seq: binary.BigEndian.Uint32(b[5:]), addr: binary.BigEndian.Uint64(b[9:]),
		rkey: binary.BigEndian.Uint32(b[17:]), size: binary.BigEndian.Uint32(b[21:]), count: binary.BigEndian.Uint32(b[25:]),
		addr2: binary.BigEndian.Uint64(b[29:]), rkey2: binary.BigEndian.Uint32(b[37:])}
	switch r.typ {
	case recRequest, recAck:
		if err := checkRing(r.size, r.count); err != nil {
			return r, fmt.Errorf("%w: %v", errBadRecord, err)
		}
	case recRefuse, recShrink, recShrinkAsk:
	case recAdvert, recRead:
		if r.size == 0 {
			return r, fmt.Errorf("%w: %s of 0 bytes", errBadRecord, recordNames[r.typ])
		}
	default:
		return r, fmt.Errorf("%w: type %d", errBadRecord, r.typ)
	}
	return r, nil
}

var recordNames = [...]string{"", "enlargement request", "enlargement ack", "enlargement refusal", "rendezvous advert", "read request", "shrink", "shrink ask"}

// Flags and values in records' fields, and in a kindCredit message's
// length (doc/protocol.md, 4.3 and 4.6).
const (
	// ackKeepsSmall, in an ack's addr2: the acknowledging side keeps its
	// small ring, so the writer may shrink back to it later (shrink.go).
	ackKeepsSmall = 1
	// reqTakesShrinkAsks, in a request's addr2: the requester shrinks
	// when asked (pressure.go).
	reqTakesShrinkAsks = 1
	// shrinkClimb, in a shrink record's addr: a step up the ladder, not a
	// shrink (ladder.go).
	shrinkClimb = 1

	// A kindCredit message's length: 0, credits only; else a park and
	// its answers (park.go).
	lenPark    = 1
	lenResume  = 2 // the pages were released
	lenDecline = 3 // the ring held unread data: nothing released
)

// The rendezvous limits a holder keeps to (doc/protocol.md, 4.7).
const (
	// maxAdverts bounds the messages one writer keeps advertised (and so
	// its registered source memory): two let it copy the next chunk while
	// the peer fetches the previous one.
	maxAdverts = 2
	// maxServing bounds read requests being written at once. A reader has
	// one request outstanding; the holder may see its next one before it
	// polled the completion of the previous.
	maxServing = 4
)
