package verbs

// #include "shim.h"
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A QP's send queue is sized when the QP is created and cannot grow (no
// device we know offers IBV_DEVICE_RESIZE_MAX_WR), and the device maps
// all of it into the process, resident from creation: on rxe a send WQE
// takes 256 bytes, so conn's depth of 56 costs every connection 20 KiB,
// idle or not, though most never have more than a few sends in flight.
// So the device queue holds at most defaultSendDepth WRs (SendDepthEnv)
// and the rest of the depth asked for is held here, in order, and posted
// as the device retires WRs: the consumer's contract (MaxSendWR
// outstanding, completions in order, every WR flushed in error) holds.
//
// The device tells of retired WRs only by completions. So a WR is
// signaled whenever every WRs in a row would otherwise go unsignaled: a
// full device queue then always holds a signaled WR whose completion is
// still to come, and the Poll that takes it posts what is held. The
// consumer did not ask for those completions and Poll drops them; error
// completions pass as they are (the device reports every WR in error,
// signaled or not). Held WRs need no help from the consumer: while there
// are any, the provider arms the CQ, and the event's Poll is its own
// (serveHolds), its completions kept for the consumer's next Poll.

// sendHold is the part of a QP's send queue that the device does not hold.
type sendHold struct {
	limit int // the depth the consumer asked for
	depth int // the device queue's
	every int // the longest run of unsignaled WRs on the device

	// posting is set while a post or a drain runs: a Poll that retired
	// WRs then drains after it, so that a WR held by a post that found
	// the device full never waits for a completion polled meanwhile.
	posting  atomic.Bool
	nheld    atomic.Int32
	everHeld atomic.Uint64 // WRs that waited for room, for tests

	// Guarded by the QP's postMu.
	held  []heldSend
	unsig int   // unsignaled WRs posted since the last signaled one
	marks []int // scratch: the WRs of a post that were signaled here

	// mu guards fifo: for each signaled WR on the device whose completion
	// has not been polled, oldest first, whether it was signaled here.
	mu   sync.Mutex
	fifo []bool
	head int
}

// heldSend is a WR waiting for room on the device. An inline WR's bytes
// are copied when it is held: the caller may reuse them once PostSend
// returns.
type heldSend struct {
	wr   C.struct_shim_send
	sg   []C.struct_ibv_sge
	data []byte
}

func newSendHold(limit, depth int) *sendHold {
	return &sendHold{limit: limit, depth: depth, every: max(1, (depth+1)/2)}
}

// waiting: WRs are held, or a post running may hold some the device
// refused before completions polled meanwhile made room.
func (h *sendHold) waiting() bool { return h.nheld.Load() > 0 || h.posting.Load() }

// completed takes the oldest signaled WR's mark: true if the consumer did
// not ask for its completion.
func (h *sendHold) completed() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.head == len(h.fifo) {
		return false
	}
	forced := h.fifo[h.head]
	h.head++
	switch {
	case h.head == len(h.fifo):
		h.fifo, h.head = h.fifo[:0], 0
	case h.head >= 64 && h.head*2 >= len(h.fifo):
		n := copy(h.fifo, h.fifo[h.head:])
		h.fifo, h.head = h.fifo[:n], 0
	}
	return forced
}

// postDevice posts a prefix of wrs to the device, signaling those the
// device needs, and returns how many it took. A WR it did not take keeps
// the consumer's flags. The caller holds q.mu's read side and q.postMu.
func (q *qp) postDevice(wrs []C.struct_shim_send, sges []C.struct_ibv_sge) (int, error) {
	h := q.hold
	h.marks = h.marks[:0]
	unsig := h.unsig
	h.mu.Lock()
	for i := range wrs {
		w := &wrs[i]
		switch {
		case w.flags&C.SHIM_F_SIGNALED != 0:
			h.fifo = append(h.fifo, false)
			unsig = 0
		case unsig+1 >= h.every:
			w.flags |= C.SHIM_F_SIGNALED
			h.fifo = append(h.fifo, true)
			h.marks = append(h.marks, i)
			unsig = 0
		default:
			unsig++
		}
	}
	h.mu.Unlock()
	n, err := q.postC(wrs, sges)
	if n < len(wrs) {
		// The marks of WRs not posted are the last of the FIFO: only a
		// posted WR's completion takes one.
		drop := 0
		for i := n; i < len(wrs); i++ {
			if wrs[i].flags&C.SHIM_F_SIGNALED != 0 {
				drop++
			}
		}
		h.mu.Lock()
		h.fifo = h.fifo[:len(h.fifo)-drop]
		h.mu.Unlock()
		for _, i := range h.marks {
			if i >= n {
				wrs[i].flags &^= C.SHIM_F_SIGNALED
			}
		}
		unsig = h.unsig
		for i := range wrs[:n] {
			if wrs[i].flags&C.SHIM_F_SIGNALED != 0 {
				unsig = 0
			} else {
				unsig++
			}
		}
	}
	h.unsig = unsig
	return n, err
}

// postHolding posts q.sendWRs behind what is held: what the device does
// not take is held. The caller holds q.mu's read side and q.postMu.
func (q *qp) postHolding() (int, error) {
	h := q.hold
	k := len(q.sendWRs)
	h.posting.Store(true)
	defer h.posting.Store(false)
	start := 0
	if len(h.held) == 0 {
		n, err := q.postDevice(q.sendWRs, q.sges)
		if err != nil && !errors.Is(err, transport.ErrQueueFull) {
			return n, err
		}
		start = n
	}
	// A consumer within its depth never has more than that held; the
	// bound is for one that is not, as a device's queue would be.
	var full error
	if end := start + h.limit - len(h.held); k > end {
		full = fmt.Errorf("verbs: ibv_post_send on QP %d: %d WRs wait for the device, more pass the depth of %d: %w",
			q.num, len(h.held)+end-start, h.limit, transport.ErrQueueFull)
		k = end
	}
	sg := 0
	for i := range q.sendWRs[:start] {
		sg += int(q.sendWRs[i].nsge)
	}
	for i := start; i < k; i++ {
		w := q.sendWRs[i]
		e := heldSend{wr: w}
		ws := q.sges[sg : sg+int(w.nsge)]
		sg += int(w.nsge)
		if w.flags&C.SHIM_F_INLINE != 0 {
			// Copied now: the bytes may be the caller's, reused once
			// PostSend returns.
			for _, s := range ws {
				// The address is of C memory or of a slice pinned
				// for this call: reinterpreted, not derived from a
				// Go pointer held as an integer.
				addr := uintptr(s.addr)
				p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
				e.data = append(e.data, unsafe.Slice((*byte)(p), int(s.length))...)
			}
			e.wr.nsge = 0
			if len(e.data) > 0 {
				e.wr.nsge = 1
			}
		} else {
			e.sg = append([]C.struct_ibv_sge(nil), ws...)
		}
		h.held = append(h.held, e)
	}
	h.nheld.Store(int32(len(h.held)))
	h.everHeld.Add(uint64(k - start))
	if start == 0 {
		// Held behind older WRs, or the device was full: the device may
		// have room now.
		q.drainLocked()
	}
	q.awaitRoomLocked()
	return k, full
}

// refill posts what is held after a Poll took completions of q.
func (q *qp) refill() {
	h := q.hold
	if !h.waiting() {
		return
	}
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.closed {
		return
	}
	q.postMu.Lock()
	defer q.postMu.Unlock()
	h.posting.Store(true)
	defer h.posting.Store(false)
	q.drainLocked()
	q.awaitRoomLocked()
}

// awaitRoomLocked makes sure WRs still held are posted without the
// consumer: it arms the CQ, so that the completion that frees room raises
// an event (serveHolds takes it), and takes what completed before the
// arm, which raises none. The caller holds q.mu's read side and q.postMu.
func (q *qp) awaitRoomLocked() {
	for range 4 {
		if len(q.hold.held) == 0 {
			return
		}
		if !q.scq.arm() {
			return
		}
		if !slices.Contains(q.scq.stashPoll(), q) {
			return // the armed CQ raises the next
		}
		q.drainLocked()
	}
	// Still held after four rounds: the last arm preceded the last poll,
	// so a later completion raises an event all the same.
}

// drainLocked posts held WRs, oldest first, while the device takes them.
// WRs the device refuses for another reason than a full queue cannot be
// posted at all: they complete as flushed, as the QP's other work does
// in error. The caller holds q.mu's read side and q.postMu.
func (q *qp) drainLocked() {
	h := q.hold
	var pin runtime.Pinner
	defer pin.Unpin()
	for len(h.held) > 0 {
		q.sendWRs = q.sendWRs[:0]
		q.sges = q.sges[:0]
		// The device takes at most its depth at once.
		for i := range h.held[:min(len(h.held), h.depth)] {
			e := &h.held[i]
			q.sendWRs = append(q.sendWRs, e.wr)
			if len(e.data) > 0 {
				p := unsafe.SliceData(e.data)
				pin.Pin(p)
				q.sges = append(q.sges, C.struct_ibv_sge{addr: C.uint64_t(uintptr(unsafe.Pointer(p))), length: C.uint32_t(len(e.data))})
			} else {
				q.sges = append(q.sges, e.sg...)
			}
		}
		n, err := q.postDevice(q.sendWRs, q.sges)
		clear(h.held[:n])
		h.held = h.held[n:]
		if err != nil && !errors.Is(err, transport.ErrQueueFull) {
			q.scq.flushHeld(q.num, h.held)
			clear(h.held)
			h.held = h.held[:0]
		}
		if err != nil || n == 0 {
			break
		}
	}
	if len(h.held) == 0 {
		h.held = nil
	}
	h.nheld.Store(int32(len(h.held)))
}

// completionOf is the completion opcode of a built WR.
func completionOf(w *C.struct_shim_send) transport.WCOpcode {
	for op, s := range shimOpcodes {
		if s == w.opcode {
			return transport.Opcode(op).Completion()
		}
	}
	return transport.WCSend
}

// flushHeld queues flush completions for WRs the device would not take,
// behind what the device has completed so far.
func (c *cq) flushHeld(num uint32, held []heldSend) {
	c.stashPoll()
	c.pollMu.Lock()
	for _, e := range held {
		c.stash = append(c.stash, transport.WorkCompletion{ID: uint64(e.wr.wr_id), Status: transport.StatusWRFlushErr,
			Opcode: completionOf(&e.wr), QPNum: num})
	}
	c.nstash.Store(int32(len(c.stash)))
	c.pollMu.Unlock()
	c.signal()
}

// stashPoll polls the device into the stash; it returns the QPs with held
// sends that had completions.
//
// A consumer that armed its CQ and sleeps learns of what the stash took
// from the completion event, where the CQ is its own: the device raises
// the event for a completion after the arm whoever polls it. A view's
// event is the shared CQ's handler routing a completion to it (sharedcq.go),
// and what this poll took is no longer there to route: so an armed view
// whose stash this poll filled is woken here, as the event would have.
func (c *cq) stashPoll() []*qp {
	var touched []*qp
	var buf [16]transport.WorkCompletion
	c.pollMu.Lock()
	before := len(c.stash)
	for {
		n, raw, t, err := c.pollDevice(buf[:], touched)
		touched = t
		c.stash = append(c.stash, buf[:n]...)
		if err != nil || raw < len(buf) {
			break
		}
	}
	c.nstash.Store(int32(len(c.stash)))
	took := len(c.stash) > before
	c.pollMu.Unlock()
	if took && c.view && c.armed.Load() {
		c.signal()
	}
	return touched
}

// takeStash moves what the provider polled into wc. The caller holds
// c.pollMu.
func (c *cq) takeStash(wc []transport.WorkCompletion) int {
	if len(c.stash) == 0 {
		return 0
	}
	n := copy(wc, c.stash)
	c.stash = c.stash[n:]
	if len(c.stash) == 0 {
		c.stash = nil
	}
	c.nstash.Store(int32(len(c.stash)))
	return n
}

// arm requests an event for the CQ's next completion; false if closed.
func (c *cq) arm() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return false
	}
	if c.sh != nil {
		return c.sh.arm(c) == 0
	}
	return C.shim_req_notify_cq(c.cq) == 0
}

// serveHolds runs on a completion event: if a QP of the CQ holds sends,
// the provider polls (the consumer may not be polling at all) and posts
// what the completions made room for.
func (c *cq) serveHolds() {
	if !c.holdsWaiting() {
		return
	}
	for _, q := range c.stashPoll() {
		q.refill()
	}
}

// holdsWaiting: a QP of the CQ holds sends that wait for room.
func (c *cq) holdsWaiting() bool {
	m := c.holds.Load()
	return m != nil && slices.ContainsFunc(*m, func(q *qp) bool { return q.hold.waiting() })
}

// attachHold makes Poll drop q's unasked-for completions and refill q.
func (c *cq) attachHold(q *qp) { c.attach(&c.holds, q) }

func (c *cq) detachHold(num uint32) { c.detach(&c.holds, num) }

// dropForced removes from wc the completions the consumer did not ask
// for, and returns how many remain and the QPs that had completions.
func dropForced(l []*qp, wc []transport.WorkCompletion, touched []*qp) (int, []*qp) {
	j := 0
	for i := range wc {
		q := qpOf(l, wc[i].QPNum)
		if q != nil {
			touched = appendOnce(touched, q)
			// An error completion's opcode is undefined, and it is
			// reported whether signaled or not: it passes.
			if wc[i].Status == transport.StatusSuccess && isSendWC(wc[i].Opcode) && q.hold.completed() {
				continue
			}
		}
		if j != i {
			wc[j] = wc[i]
		}
		j++
	}
	return j, touched
}

func appendOnce(s []*qp, q *qp) []*qp {
	for _, x := range s {
		if x == q {
			return s
		}
	}
	return append(s, q)
}

func isSendWC(o transport.WCOpcode) bool {
	return o == transport.WCSend || o == transport.WCRDMAWrite || o == transport.WCRDMARead
}
