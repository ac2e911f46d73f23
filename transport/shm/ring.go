package shm

import (
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A QP's shared segment holds its state word and its receive queue
// (doc/protocol.md §3.3.6 calls the segment the QP ring, and its fields
// state, posted, claimed, polled, and per slot flag, nsge, kind, byte_len,
// imm, sge). The
// receive queue is one ring with three cursors: the owner posts receives
// (posted), the peer's requester claims them in order (claimed) and writes
// the completion into the same slot, then sets the slot's flag to its
// sequence number; the owner's CQ.Poll consumes completed slots in order
// (polled), which frees them for posting. Owner-side flushes claim slots
// with the same CAS, so a slot is completed by exactly one side.
const (
	qpState   = 0  // u32 transport.QPState; either side may set ERROR
	qpPosted  = 8  // u64 written by the owner
	qpClaimed = 16 // u64 CAS by the peer (consume) or the owner (flush)
	qpPolled  = 24 // u64 written by the owner
	qpSlots   = 64

	// A slot is 40 bytes with one SGE, no padding: the ring is sized for
	// the deepest large phase (43 receives by default), and every page of
	// it counts in both processes' RSS, since the peer maps it too. With
	// 64-byte slots an idle connection end held 5.6 KiB of them.
	slFlag    = 0  // u64: sequence+1 once the completion is written
	slNSGE    = 8  // u32, written by the owner at post
	slKind    = 12 // u32, by the peer at completion: status | opcode<<8 | hasImm<<16
	slByteLen = 16 // u32
	slImm     = 20 // u32
	slSGEs    = 24 // sge: addr u64, length u32, key u32
	sgeSize   = 16
)

func slotSize(maxSGE int) int { return slSGEs + maxSGE*sgeSize }

func qpSegSize(capacity, maxSGE int) int { return qpSlots + max(capacity, 1)*slotSize(maxSGE) }

// ring is a view of a QP segment, from the owner or from the peer.
type ring struct {
	mem    []byte
	cap    uint64
	maxSGE int
	slotSz int
}

func newRing(mem []byte, capacity, maxSGE int) ring {
	return ring{mem: mem, cap: uint64(capacity), maxSGE: maxSGE, slotSz: slotSize(maxSGE)}
}

func (r ring) slot(i uint64) int { return qpSlots + int(i%r.cap)*r.slotSz }

func (r ring) state() transport.QPState {
	return transport.QPState(atomic.LoadUint32(word32(r.mem, qpState)))
}

// setErr moves the QP to ERROR and reports whether this call did it.
func (r ring) setErr() bool {
	return atomic.SwapUint32(word32(r.mem, qpState), uint32(transport.QPSErr)) != uint32(transport.QPSErr)
}

func (r ring) posted() uint64  { return atomic.LoadUint64(word64(r.mem, qpPosted)) }
func (r ring) claimed() uint64 { return atomic.LoadUint64(word64(r.mem, qpClaimed)) }

func (r ring) setPolled(v uint64) { atomic.StoreUint64(word64(r.mem, qpPolled), v) }

func (r ring) casClaimed(old, new uint64) bool {
	return atomic.CompareAndSwapUint64(word64(r.mem, qpClaimed), old, new)
}

// claimResult says why a peer could not take a receive.
type claimResult int

const (
	claimOK claimResult = iota
	claimEmpty
	claimQPErr
	claimCorrupt
)

// claim takes the next posted receive for the peer's requester.
func (r ring) claim() (uint64, claimResult) {
	for {
		if r.state() == transport.QPSErr {
			return 0, claimQPErr
		}
		c, p := r.claimed(), r.posted()
		if c >= p {
			return 0, claimEmpty
		}
		if p-c > r.cap || r.cap == 0 {
			return 0, claimCorrupt
		}
		if r.casClaimed(c, c+1) {
			return c, claimOK
		}
	}
}

// sges reads the scatter list of slot i as posted by the owner, clamped to
// the negotiated maximum since the owner could be hostile.
func (r ring) sges(i uint64, dst []transport.SGE) []transport.SGE {
	off := r.slot(i)
	n := int(atomic.LoadUint32(word32(r.mem, off+slNSGE)))
	n = min(n, r.maxSGE)
	dst = dst[:0]
	for k := range n {
		o := off + slSGEs + k*sgeSize
		dst = append(dst, transport.SGE{
			Addr:   atomic.LoadUint64(word64(r.mem, o)),
			Length: atomic.LoadUint32(word32(r.mem, o+8)),
			LKey:   atomic.LoadUint32(word32(r.mem, o+12)),
		})
	}
	return dst
}

// post writes a receive's scatter list into slot i (owner side); publish
// makes the slots before n visible to the peer. The peer reads a slot
// only below posted, after its atomic load, so plain stores suffice here:
// a new connection posts a dozen receives, and locked stores for each
// field of each were a µs of every set-up.
func (r ring) post(i uint64, sg []transport.SGE) {
	off := r.slot(i)
	*word32(r.mem, off+slNSGE) = uint32(len(sg))
	for k, s := range sg {
		o := off + slSGEs + k*sgeSize
		*word64(r.mem, o) = s.Addr
		*word32(r.mem, o+8) = s.Length
		*word32(r.mem, o+12) = s.LKey
	}
}

func (r ring) publish(n uint64) { atomic.StoreUint64(word64(r.mem, qpPosted), n) }

// complete writes the completion of slot i and publishes it (peer side).
func (r ring) complete(i uint64, wc *transport.WorkCompletion) {
	off := r.slot(i)
	kind := uint32(uint8(wc.Status)) | uint32(uint8(wc.Opcode))<<8
	if wc.HasImm {
		kind |= 1 << 16
	}
	atomic.StoreUint32(word32(r.mem, off+slKind), kind)
	atomic.StoreUint32(word32(r.mem, off+slByteLen), wc.ByteLen)
	atomic.StoreUint32(word32(r.mem, off+slImm), wc.Imm)
	atomic.StoreUint64(word64(r.mem, off+slFlag), i+1)
}

// completed reads slot i's completion if the peer has published it.
func (r ring) completed(i uint64, wc *transport.WorkCompletion) bool {
	off := r.slot(i)
	if atomic.LoadUint64(word64(r.mem, off+slFlag)) != i+1 {
		return false
	}
	kind := atomic.LoadUint32(word32(r.mem, off+slKind))
	st := transport.Status(uint8(kind))
	if st > transport.StatusGeneralErr {
		st = transport.StatusGeneralErr
	}
	wc.Status = st
	op := transport.WCOpcode(uint8(kind >> 8))
	if op != transport.WCRecvRDMAWithImm {
		op = transport.WCRecv
	}
	wc.Opcode = op
	wc.ByteLen = atomic.LoadUint32(word32(r.mem, off+slByteLen))
	wc.Imm = atomic.LoadUint32(word32(r.mem, off+slImm))
	wc.HasImm = kind&(1<<16) != 0
	return true
}
