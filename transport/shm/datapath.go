package shm

import (
	"fmt"
	"slices"
	"time"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// The requester engine. A work request is executed at post time by the
// posting goroutine: it checks what the responder's NIC would check and
// copies straight into or out of the responder's memory. Requests that
// must wait for the responder (receiver not ready, or a responder in
// ERROR that drops requests) stay queued in order behind the first one,
// and the QP's worker retries them when their timer fires.

// sendOp is a work request accepted by PostSend.
type sendOp struct {
	wr       transport.SendWR
	data     []byte // inline payload, copied at post time
	inline   bool
	idx      uint64 // position in the send queue, for retiring slots
	rnrLeft  int
	deadline time.Time // when an unresponsive responder makes it fail
}

const (
	minRNRDelay    = 10 * time.Microsecond
	defaultTimeout = time.Second
)

func (q *qp) PostSend(wrs ...transport.SendWR) (int, error) {
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	for n := range wrs {
		wr := &wrs[n]
		if err := q.checkWR(wr); err != nil {
			return n, err
		}
		if q.sqPosted-q.sqRetired.Load() >= uint64(q.cfg.MaxSendWR) {
			return n, fmt.Errorf("shm: post send on QP %d: %d requests outstanding: %w", q.num, q.cfg.MaxSendWR, transport.ErrQueueFull)
		}
		op := sendOp{wr: *wr, idx: q.sqPosted, rnrLeft: q.cfg.RNRRetry}
		q.sqPosted++
		if wr.Inline {
			op.data = wr.Data
			if op.data == nil {
				op.data = gatherInline(q, wr.SG)
			}
			op.inline = true
			op.wr.SG, op.wr.Data = nil, nil
		}
		if len(q.sq) == 0 && q.run(&op) {
			continue
		}
		p := new(sendOp)
		*p = op
		p.wr.SG = slices.Clone(op.wr.SG)
		if wr.Data != nil {
			p.data = slices.Clone(wr.Data) // the caller may reuse it once we return
		}
		q.sq = append(q.sq, p)
	}
	return len(wrs), nil
}

func (q *qp) checkWR(wr *transport.SendWR) error {
	if wr.Opcode > transport.OpRead {
		return fmt.Errorf("shm: post send on QP %d: opcode %d: %w", q.num, wr.Opcode, transport.ErrInvalidWR)
	}
	if wr.Data != nil && (!wr.Inline || len(wr.SG) > 0) {
		return fmt.Errorf("shm: post send on QP %d: Data without Inline, or with SG too: %w", q.num, transport.ErrInvalidWR)
	}
	if len(wr.SG) > q.cfg.MaxSendSGE {
		return fmt.Errorf("shm: post send on QP %d: %d SGEs, max %d: %w", q.num, len(wr.SG), q.cfg.MaxSendSGE, transport.ErrInvalidWR)
	}
	if wr.Inline {
		if wr.Opcode == transport.OpRead {
			return fmt.Errorf("shm: post send on QP %d: inline RDMA READ: %w", q.num, transport.ErrInvalidWR)
		}
		total := uint64(len(wr.Data))
		for _, s := range wr.SG {
			total += uint64(s.Length)
		}
		if total > uint64(q.cfg.MaxInline) {
			return fmt.Errorf("shm: post send on QP %d: %d inline bytes, max %d: %w", q.num, total, q.cfg.MaxInline, transport.ErrInvalidWR)
		}
	}
	return nil
}

// gatherInline copies inline data at post time. As with a NIC, the lkeys
// are not checked: the addresses are plain virtual addresses of this
// process.
func gatherInline(q *qp, sg []transport.SGE) []byte {
	data := []byte{}
	for _, s := range sg {
		if s.Length == 0 {
			continue
		}
		if m := q.dev.mrs.lookupLocal(s.LKey); m != nil {
			if b, ok := m.slice(s.Addr, s.Length); ok {
				data = append(data, b...)
				continue
			}
		}
		addr := uintptr(s.Addr)
		p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
		data = append(data, unsafe.Slice((*byte)(p), s.Length)...)
	}
	return data
}

// progress runs queued requests in order until one must wait.
func (q *qp) progress() {
	for len(q.sq) > 0 {
		if !q.run(q.sq[0]) {
			return
		}
		q.sq[0] = nil
		q.sq = q.sq[1:]
	}
	q.sq = q.sq[:0:0]
}

// run executes op and reports whether it completed (false: it waits and
// the timer is set).
func (q *qp) run(op *sendOp) bool {
	st, wait := q.execute(op)
	defer q.applyRespFail()
	if wait > 0 {
		if q.timer == nil {
			q.timer = time.AfterFunc(wait, q.service)
		} else {
			q.timer.Reset(wait)
		}
		return false
	}
	if st != transport.StatusSuccess || op.wr.Signaled {
		wc := transport.WorkCompletion{ID: op.wr.ID, Status: st, QPNum: q.num}
		if st == transport.StatusSuccess {
			wc.Opcode, wc.ByteLen = op.wr.Opcode.Completion(), op.length()
		}
		q.scq.push(cqe{wc: wc, q: q, sqIdx: op.idx, send: true})
	}
	// The error completion is queued before the QP enters ERROR: a
	// concurrent Poll that saw ERROR first would report the receive
	// queue's flushes ahead of the cause, where a NIC completes the
	// failed request and only then flushes the rest.
	if st != transport.StatusSuccess {
		if q.ring.setErr() {
			q.rcq.wake()
		}
	}
	return true
}

func (op *sendOp) length() uint32 {
	if op.inline {
		return uint32(len(op.data))
	}
	var n uint32
	for _, s := range op.wr.SG {
		n += s.Length
	}
	return n
}

// execute returns the completion status of op, or a delay after which it
// must be tried again.
func (q *qp) execute(op *sendOp) (transport.Status, time.Duration) {
	if q.ring.state() == transport.QPSErr || q.peer == nil || q.peer.mrt == nil {
		return transport.StatusWRFlushErr, 0
	}
	// Mappings no valid peer MR names any more go before this request
	// resolves (and pins) anything, never under its copy.
	if len(q.peer.maps) >= sweepAt {
		q.peer.sweep()
	}
	defer q.unpinAll()
	switch op.wr.Opcode {
	case transport.OpSend, transport.OpSendWithImm:
		return q.execSend(op)
	case transport.OpWrite, transport.OpWriteWithImm:
		return q.execWrite(op)
	default:
		return q.execRead(op)
	}
}

func (q *qp) execSend(op *sendOp) (transport.Status, time.Duration) {
	src, total, ok := q.localSegs(op, false)
	if !ok {
		// rxe (6.1) reports a bad lkey in a send's gather list as a local
		// QP operation error; HCAs say local protection error. rxe is the
		// reference here (transporttest LocalProtection).
		return transport.StatusLocQPOpErr, 0
	}
	slot, st, wait := q.claimRecv(op)
	if st != transport.StatusSuccess || wait > 0 {
		return st, wait
	}
	pr := q.peer
	q.sgeBuf = pr.ring.sges(slot, q.sgeBuf)
	dst, room, ok := q.peerRecvSegs(q.sgeBuf)
	if !ok {
		// A bad receive WQE is the responder's problem (rxe: malformed
		// WQE, class A): its receive fails, we see a remote op error.
		q.failResponder(slot, transport.StatusLocQPOpErr)
		return transport.StatusRemOpErr, 0
	}
	if total > room {
		// rxe (6.1): the responder's receive fails with a local QP
		// operation error and NAKs a remote operational error.
		q.failResponder(slot, transport.StatusLocQPOpErr)
		return transport.StatusRemOpErr, 0
	}
	scatter(dst, src)
	q.unpinAll() // before deliver, which may block on the socket
	wc := transport.WorkCompletion{Opcode: transport.WCRecv, ByteLen: uint32(total)}
	if op.wr.Opcode == transport.OpSendWithImm {
		wc.Imm, wc.HasImm = op.wr.Imm, true
	}
	q.deliver(slot, &wc)
	return transport.StatusSuccess, 0
}

func (q *qp) execWrite(op *sendOp) (transport.Status, time.Duration) {
	src, total, ok := q.localSegs(op, false)
	if !ok {
		return transport.StatusLocQPOpErr, 0 // as execSend
	}
	imm := op.wr.Opcode == transport.OpWriteWithImm
	var slot uint64
	if imm {
		// The responder takes a receive before checking the rkey.
		var st transport.Status
		var wait time.Duration
		slot, st, wait = q.claimRecv(op)
		if st != transport.StatusSuccess || wait > 0 {
			return st, wait
		}
	} else if q.peer.ring.state() == transport.QPSErr {
		return q.unresponsive(op)
	}
	if total > 0 {
		dst, ok := q.remoteRegion(op.wr.RKey, op.wr.RemoteAddr, total, transport.AccessRemoteWrite)
		if !ok {
			if imm {
				q.failResponder(slot, transport.StatusRemAccessErr)
			} else {
				q.failResponder(noSlot, 0)
			}
			return transport.StatusRemAccessErr, 0
		}
		scatter([][]byte{dst}, src)
		q.unpinAll()
	}
	if imm {
		q.deliver(slot, &transport.WorkCompletion{
			Opcode: transport.WCRecvRDMAWithImm, ByteLen: uint32(total), Imm: op.wr.Imm, HasImm: true,
		})
	}
	return transport.StatusSuccess, 0
}

func (q *qp) execRead(op *sendOp) (transport.Status, time.Duration) {
	dst, total, ok := q.localSegs(op, true)
	if !ok {
		return transport.StatusLocProtErr, 0
	}
	if q.peer.ring.state() == transport.QPSErr {
		return q.unresponsive(op)
	}
	if total > 0 {
		src, ok := q.remoteRegion(op.wr.RKey, op.wr.RemoteAddr, total, transport.AccessRemoteRead)
		if !ok {
			q.failResponder(noSlot, 0)
			return transport.StatusRemAccessErr, 0
		}
		scatter(dst, [][]byte{src})
		q.unpinAll()
	}
	return transport.StatusSuccess, 0
}

// claimRecv takes the responder's next posted receive, or says how to wait.
func (q *qp) claimRecv(op *sendOp) (uint64, transport.Status, time.Duration) {
	slot, res := q.peer.ring.claim()
	switch res {
	case claimOK:
		return slot, transport.StatusSuccess, 0
	case claimEmpty:
		// Receiver not ready: retry RNRRetry times (7 = forever)
		// spaced by the RNR timer.
		if q.cfg.RNRRetry != 7 {
			if op.rnrLeft == 0 {
				return 0, transport.StatusRNRRetryExcErr, 0
			}
			op.rnrLeft--
		}
		return 0, transport.StatusSuccess, max(q.cfg.MinRNRTimer, minRNRDelay)
	case claimQPErr:
		st, wait := q.unresponsive(op)
		return 0, st, wait
	default:
		q.failResponder(noSlot, 0)
		return 0, transport.StatusRemOpErr, 0
	}
}

// unresponsive handles a responder QP in ERROR: it drops requests, so the
// requester retransmits until its retry count is exhausted.
func (q *qp) unresponsive(op *sendOp) (transport.Status, time.Duration) {
	now := time.Now()
	if op.deadline.IsZero() {
		t := q.cfg.Timeout
		if t <= 0 {
			t = defaultTimeout
		}
		op.deadline = now.Add(t * time.Duration(q.cfg.RetryCount+1))
	}
	if !now.Before(op.deadline) {
		return transport.StatusRetryExcErr, 0
	}
	return transport.StatusSuccess, op.deadline.Sub(now)
}

const noSlot = ^uint64(0)

// failResponder does what a responder NIC does on a class A/C error: it
// completes the receive it took (if any) with status and moves its QP to
// ERROR. The peer is told so that it flushes and wakes promptly. That is
// done by run once the requester's own error completion is queued: the
// responder, seeing ERROR, may disconnect at once, and the requester must
// still see why (a NIC's NAK reaches it before the CM's disconnect).
func (q *qp) failResponder(slot uint64, st transport.Status) {
	q.respFail = respFail{set: true, slot: slot, st: st}
}

// respFail is a responder failure decided by execute, carried out by run.
type respFail struct {
	set  bool
	slot uint64
	st   transport.Status
}

func (q *qp) applyRespFail() {
	f := q.respFail
	if !f.set {
		return
	}
	q.respFail = respFail{}
	pr := q.peer
	if f.slot != noSlot {
		q.deliver(f.slot, &transport.WorkCompletion{Status: f.st, Opcode: transport.WCRecv})
	}
	pr.ring.setErr()
	q.sock.send([]byte{msgErrNote})
}

// deliver publishes a receive completion into the responder's ring and CQ.
func (q *qp) deliver(slot uint64, wc *transport.WorkCompletion) {
	pr := q.peer
	ok := pr.cq.add(pr.cqCap)
	pr.ring.complete(slot, wc)
	if !ok {
		// The responder's CQ overflowed (IBV_EVENT_CQ_ERR): its QP
		// goes to ERROR, and it learns about it on its next Poll.
		pr.ring.setErr()
		q.sock.send([]byte{msgErrNote})
	}
	q.notifyPeer()
}

// notifyPeer wakes the responder's receive CQ if it is armed.
func (q *qp) notifyPeer() {
	pr := q.peer
	if !pr.cq.disarm() {
		return
	}
	if pr.localCQ != nil {
		pr.localCQ.signal()
		return
	}
	q.sock.send([]byte{msgWake})
}

// localSegs resolves op's local scatter/gather list (or inline data).
func (q *qp) localSegs(op *sendOp, write bool) ([][]byte, uint64, bool) {
	segs := q.scratchL[:0]
	if op.inline {
		segs = append(segs, op.data)
		q.scratchL = segs
		return segs, uint64(len(op.data)), true
	}
	var total uint64
	for _, s := range op.wr.SG {
		if s.Length == 0 {
			continue
		}
		m := q.dev.mrs.lookupLocal(s.LKey)
		if m == nil || m.pd != q.pd || (write && m.access&transport.AccessLocalWrite == 0) {
			return nil, 0, false
		}
		b, ok := m.slice(s.Addr, s.Length)
		if !ok {
			return nil, 0, false
		}
		segs = append(segs, b)
		total += uint64(s.Length)
	}
	q.scratchL = segs
	return segs, total, true
}

// peerRecvSegs resolves a responder receive's scatter list through the
// responder's MR table, as the responder's NIC would with its lkeys.
func (q *qp) peerRecvSegs(sg []transport.SGE) ([][]byte, uint64, bool) {
	// With several SGEs, fetch every mapping first: a fetch may wait on
	// the peer, and no earlier SGE's pin may be held meanwhile (a Dereg
	// would wait on it, see pinWait). A single SGE holds no pin yet.
	for i := 0; len(sg) > 1 && i < len(sg); i++ {
		if sg[i].Length != 0 {
			if e, ok := q.peer.mrt.lookup(sg[i].LKey); ok {
				q.peerMem(&e)
			}
		}
	}
	segs := q.scratchR[:0]
	var room uint64
	for _, s := range sg {
		if s.Length == 0 {
			continue
		}
		b, ok := q.peerRegion(s.LKey, s.Addr, uint64(s.Length), transport.AccessLocalWrite)
		if !ok {
			return nil, 0, false
		}
		segs = append(segs, b)
		room += uint64(s.Length)
	}
	q.scratchR = segs
	return segs, room, true
}

// remoteRegion checks an rkey as the responder's NIC would: valid, of the
// responder QP's PD, with the access, covering the range.
func (q *qp) remoteRegion(rkey uint32, addr, n uint64, need transport.Access) ([]byte, bool) {
	return q.peerRegion(rkey, addr, n, need)
}

func (q *qp) peerRegion(key uint32, addr, n uint64, need transport.Access) ([]byte, bool) {
	pr := q.peer
	e, ok := pr.mrt.lookup(key)
	if !ok || e.pd != pr.pd || e.access&need != need || !e.covers(addr, n) {
		return nil, false
	}
	mem, err := q.peerMem(&e)
	if err != nil {
		return nil, false
	}
	off := e.memfdOff + (addr - e.addr)
	if off > uint64(len(mem)) || n > uint64(len(mem))-off {
		return nil, false
	}
	// Held until the copy is done, so that the peer's Dereg waits for it
	// (see pinWait). The entry is read again once pinned: a slot can be
	// reused under the same key after 255 registrations.
	if !pr.mrt.pin(key) {
		return nil, false
	}
	if again, ok := pr.mrt.lookup(key); !ok || again != e {
		pr.mrt.unpin(key)
		return nil, false
	}
	q.pins = append(q.pins, key)
	return mem[off : off+n], true
}

func (q *qp) unpinAll() {
	for _, k := range q.pins {
		q.peer.mrt.unpin(k)
	}
	q.pins = q.pins[:0]
}

// scatter copies the concatenation of src into the concatenation of dst,
// whose total size must be at least that of src.
func scatter(dst, src [][]byte) {
	di, doff := 0, 0
	for _, s := range src {
		for len(s) > 0 && di < len(dst) {
			k := copy(dst[di][doff:], s)
			s = s[k:]
			doff += k
			if doff == len(dst[di]) {
				di++
				doff = 0
			}
		}
	}
}
