package verbs

// #include "shim.h"
import "C"

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// The receive pool: one shared receive queue per device for every QP
// whose receives carry no data (QPConfig.RecvImmOnly: conn's, whose
// messages are RDMA writes with immediate into the peer's ring).
//
// A receive queue is mapped into the process whole, a page at least, and
// a QP's own (or a shared queue of its own, srq.go) holds every receive
// its consumer posts, most of which wait for traffic that an idle
// connection never sees. Such receives hold no buffer, so they need not
// be the consumer's: the device's queue holds receives of the provider,
// all alike (ID PooledRecvID, no SGE), as many as are likely to be in
// flight at once over all connections (RecvPoolEnv), and each QP keeps
// its consumer's receive IDs in a list. A completion of a pooled receive
// on a QP takes the oldest ID of that QP's list (an RC QP completes its
// receives in order), and the pool posts another. rsockets and UCX's
// shared receive queue serve their endpoints alike.
//
// The pool learns that a receive was used only from its completion, so
// one that sits unpolled would be lost to every connection. Pooled QPs
// receive on views of shared device CQs (sharedcq.go), and a completion
// is given its consumer's ID, and counted, by whoever polls the device
// CQ: any view's poll, the completion event's handler. A device CQ that
// nobody polls or arms is drained when the pool runs low: the device
// raises the SRQ limit event once a quarter of the pool is left.
//
// What the interface promises of a receive queue holds: a receive
// completes once, in order, with the consumer's ID; a QP in ERROR
// flushes its consumer's receives (the provider does, srq.go, as it does
// for a shared queue of its own).
//
// What differs from a queue of the QP's own:
//   - A message that finds the pool empty (more in flight at once than
//     the pool holds) meets receiver-not-ready and is sent again after the
//     RNR timer; so a pooled QP retries such messages without limit, and
//     asks its peer to in the connection's handshake.
//   - A peer that sends more messages than the consumer posted receives
//     for (a protocol violation: a device queue would have held it back
//     with receiver-not-ready) fails the QP: the completion has no
//     receive to take.
//   - Every pooled receive may complete on any of the device's CQs. So
//     a device CQ shared by many connections keeps room for the whole
//     pool (sharedcq.go), so that a peer that floods its connection
//     fails that connection only.
//   - The SRQ lives on the pool's own PD: its receives name no memory,
//     so no PD's memory is reachable through it.
type recvPool struct {
	dev    *device
	handle uint64 // the SRQ's context, for its limit event
	srq    *C.struct_ibv_srq
	pd     *C.struct_ibv_pd
	size   int          // the receives the queue holds, as granted
	lows   atomic.Int32 // limit events served

	mu     sync.Mutex
	armed  bool // for the SRQ limit event (armLocked)
	posted int  // the pool's receives on the device
	want   int  // the consumers' receives outstanding on pooled QPs
	wrs    []C.struct_shim_recv
	closed bool
}

// poolRoom is the CQ entries a shared CQ keeps for pooled receives: all
// of the pool (see recvPool), where the device can have one: it has
// shared receive queues, and its CQs are views of shared device CQs,
// whose pollers give pooled receives their consumers' IDs (mapPooled).
func (d *device) poolRoom() int {
	if d.qpEnv.recvPool <= 0 || d.maxSRQ == 0 || !d.sharesCQs() {
		return 0
	}
	return min(d.qpEnv.recvPool, d.maxSRQWR)
}

// sharesCQs says whether the consumers' CQs are views of shared device
// CQs (sharedcq.go).
func (d *device) sharesCQs() bool {
	return d.cqGrows && d.qpEnv.cqShare > 1 && d.attr.MaxCQE > 0
}

// mapPooled gives w, a pooled receive completed on a QP served by view o
// (nil: none), its consumer's ID: that QP's oldest receive outstanding.
// It returns false for a completion to drop: its QP is gone, or its peer
// sent beyond the receives posted, which fails the QP (see recvPool).
// The pool's account is the caller's.
func mapPooled(o *cq, w *transport.WorkCompletion) bool {
	var q *qp
	if o != nil {
		if l := o.rqs.Load(); l != nil {
			q = qpOf(*l, w.QPNum)
		}
	}
	if q == nil || q.rq.pool == nil {
		return false
	}
	id, ok := q.rq.take()
	if !ok {
		q.overrun()
		return false
	}
	w.ID = id
	if w.Status != transport.StatusSuccess {
		// An error completion's opcode is undefined; the ID says it
		// ended a receive.
		q.rq.failed.Store(true)
		w.Opcode = transport.WCRecv
	}
	return true
}

// recvPoolFor is the pool a new QP with attributes a receives from,
// created with the first such QP; nil if the QP is not served by one
// (its receives may carry data, its receive CQ is not a view, or the
// device or the setting has none).
func (d *device) recvPoolFor(a *qpAttrs, immOnly bool) *recvPool {
	size := d.poolRoom()
	if !immOnly || size == 0 || a.maxRecvWR <= 0 {
		return nil
	}
	d.poolMu.Lock()
	defer d.poolMu.Unlock()
	if p := d.pool.Load(); p != nil || d.poolErr != nil {
		return p
	}
	pd, err := C.shim_ibv_alloc_pd(d.ctx)
	if pd == nil {
		d.poolErr = fmt.Errorf("verbs: the receive pool's PD: %w", errnoNow(err))
		return nil
	}
	var wr, sge C.uint32_t
	h := newHandle()
	s, err := C.shim_create_srq(pd, C.uint64_t(h), C.uint32_t(size), 1, &wr, &sge)
	if s == nil {
		C.shim_ibv_dealloc_pd(pd)
		d.poolErr = fmt.Errorf("verbs: the receive pool's ibv_create_srq(%d WRs): %w", size, errnoNow(err))
		return nil
	}
	// Post what the device granted, no more than asked: the shared CQs'
	// room is for size receives.
	p := &recvPool{dev: d, handle: h, srq: s, pd: pd, size: min(int(wr), size)}
	p.wrs = make([]C.struct_shim_recv, p.size)
	for i := range p.wrs {
		p.wrs[i].wr_id = C.uint64_t(transport.PooledRecvID)
	}
	poolsMu.Lock()
	pools[h] = p
	poolsMu.Unlock()
	d.pool.Store(p)
	return p
}

// The pools by handle, for their SRQ limit events.
var (
	poolsMu sync.Mutex
	pools   = map[uint64]*recvPool{}
)

// armLocked asks the device to tell when the pool runs low, a quarter
// left, while consumers want more receives than the pool holds. Only
// then can receives that sit unpolled leave others without: while the
// pool holds every receive consumers want, a connection's unpolled
// messages take only receives its own consumer posted. Armed for every
// pool, the event would come with nearly every message of a pool that
// holds few. A device without the event (the modify is refused)
// refills on polls only. The caller holds p.mu.
func (p *recvPool) armLocked() {
	if p.armed || p.closed || p.want <= p.size {
		return
	}
	p.armed = C.shim_arm_srq(p.srq, C.uint32_t(max(p.size/4, 1))) == 0
}

// poolLow serves a pool's SRQ limit event. The pool posts again what the
// device's pollers found completed; what sits in a device CQ that nobody
// polls (its views' consumers neither poll nor armed them) would hold
// receives back from every connection. So every shared CQ of the device
// is drained into its views' lanes, which counts what they held, the
// pool is refilled, and the event armed again if still needed.
func poolLow(handle uint64) {
	poolsMu.Lock()
	p := pools[handle]
	poolsMu.Unlock()
	if p == nil {
		return
	}
	p.lows.Add(1)
	d := p.dev
	d.sharedMu.Lock()
	shared := slices.Clone(d.shared)
	d.sharedMu.Unlock()
	for _, s := range shared {
		s.mu.Lock()
		var wake []*cq
		if !s.closed {
			_, _, wake = s.drainLocked(nil, nil, 0, nil)
		}
		s.mu.Unlock()
		wakeViews(wake, true)
	}
	p.mu.Lock()
	p.armed = false // the event is raised once per arming
	p.refillLocked()
	p.mu.Unlock()
}

// add records n receives a consumer posted, and fills the pool to them.
func (p *recvPool) add(n int) {
	p.mu.Lock()
	p.want += n
	p.refillLocked()
	p.mu.Unlock()
}

// remove records n consumer receives that are gone without a pooled
// receive (flushed, or their QP destroyed).
func (p *recvPool) remove(n int) {
	if n == 0 {
		return
	}
	p.mu.Lock()
	p.want -= n
	p.mu.Unlock()
}

// spent records n of the pool's receives completed, of which took took a
// consumer's receive, and posts as many again.
func (p *recvPool) spent(n, took int) {
	if n == 0 {
		return
	}
	p.mu.Lock()
	p.posted -= n
	p.want -= took
	p.refillLocked()
	p.mu.Unlock()
}

// refillLocked posts receives up to what consumers have outstanding, at
// most the pool's size. A refused post (ENOMEM: the queue is full) says
// the queue holds all it can.
func (p *recvPool) refillLocked() {
	p.armLocked()
	k := min(p.want, p.size) - p.posted
	if k <= 0 || p.closed {
		return
	}
	var done C.int
	rc := C.shim_post_srq_recv(p.srq, &p.wrs[0], C.int(k), nil, &done)
	p.posted += int(done)
	if rc != 0 && int(done) < k {
		p.posted = p.size
	}
}

// closePool destroys the pool once the device's QPs are gone.
func (d *device) closePool() error {
	d.poolMu.Lock()
	p := d.pool.Swap(nil)
	d.poolMu.Unlock()
	if p == nil {
		return nil
	}
	poolsMu.Lock()
	delete(pools, p.handle)
	poolsMu.Unlock()
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	if rc := C.shim_destroy_srq(p.srq); rc != 0 {
		return fmt.Errorf("verbs: destroying the receive pool: %w", opErr("ibv_destroy_srq", rc))
	}
	if rc := C.shim_ibv_dealloc_pd(p.pd); rc != 0 {
		return fmt.Errorf("verbs: the receive pool's PD: %w", opErr("ibv_dealloc_pd", rc))
	}
	return nil
}
