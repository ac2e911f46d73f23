package verbs

// #include "shim.h"
import "C"

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A QP's receive queue is sized when the QP is created and never grows,
// and the device maps it into the process, resident from the start. The
// consumer sizes it for the deepest phase of its connection (conn: every
// slot of its small and deepest rings, and the control messages), but an
// idle connection has a few receives posted. So where the device has
// shared receive queues, a QP gets one of its own instead: created at
// the provider's depth (RecvDepthEnv; 31 fills one page of rxe's queue
// at one scatter entry), grown with ibv_modify_srq, once, to the depth
// asked for when a post finds it full.
//
// What the interface promises of a receive queue, the provider keeps:
// a QP in ERROR completes every outstanding receive as flushed. A device
// does not flush a shared queue (its receives serve other QPs); so the
// provider keeps the IDs of the receives outstanding, in order, and
// completes them as flushed itself once the QP is known to have failed
// and its CQ has been polled empty. It knows of a failure from its own
// transitions (SetError, Disconnect, the peer's disconnect), from an
// error completion of the QP, and from the device's asynchronous QP
// errors. A receive the device completes after the provider flushed it
// (the responder was past its state check) is dropped: each receive
// completes once.
type recvQueue struct {
	srq *C.struct_ibv_srq
	// pool: the device's receive pool serves the QP (pool.go), and srq is
	// the pool's; ids are the consumer's receives, none on the device.
	pool *recvPool
	max  int // the depth asked for: the queue grows to it

	mu     sync.Mutex
	size   int      // what the queue holds now
	ids    []uint64 // the receives outstanding, oldest first from head
	head   int
	failed atomic.Bool
}

// recvDepthFor is the depth of the shared queue a QP starts with, or 0
// for a receive queue of its own (the device has no shared queues, the
// setting is 0, or the depth asked for is no deeper).
func (d *device) recvDepthFor(a *qpAttrs, initial int) int {
	start := d.qpEnv.recvDepth
	if start <= 0 || d.maxSRQ == 0 || a.maxRecvWR <= start || a.maxRecvWR > d.maxSRQWR {
		return 0
	}
	return max(start, initial)
}

// newRecvQueue creates the shared queue q receives through; on failure
// q has none.
func (q *qp) newRecvQueue(p *pd, a *qpAttrs, start int) error {
	var wr, sge C.uint32_t
	s, err := C.shim_create_srq(p.pd, 0, C.uint32_t(start), C.uint32_t(a.maxRecvSGE), &wr, &sge)
	if s == nil {
		return fmt.Errorf("verbs: ibv_create_srq(%d WRs): %w", start, errnoNow(err))
	}
	q.rq = &recvQueue{srq: s, max: a.maxRecvWR, size: int(wr)}
	a.maxRecvSGE = int(sge)
	return nil
}

// newPooledQueue has the QP receive from pool.
func (q *qp) newPooledQueue(pool *recvPool, a *qpAttrs) {
	q.rq = &recvQueue{srq: pool.srq, pool: pool, max: a.maxRecvWR, size: a.maxRecvWR}
	a.maxRecvSGE = 0
}

// dropRecvQueue undoes newRecvQueue or newPooledQueue for a QP that was
// not created.
func (q *qp) dropRecvQueue() {
	if q.rq != nil && q.rq.pool == nil {
		C.shim_destroy_srq(q.rq.srq)
	}
	q.rq = nil
}

// destroyRecvQueue releases the shared queue of a destroyed QP.
func (q *qp) destroyRecvQueue() {
	if q.rq == nil {
		return
	}
	q.rcq.detachRecvs(q.num)
	unregisterRecvQueue(q)
	if rq := q.rq; rq.pool != nil {
		rq.mu.Lock()
		n := len(rq.ids) - rq.head
		rq.ids, rq.head = nil, 0
		rq.mu.Unlock()
		rq.pool.remove(n)
		return
	}
	C.shim_destroy_srq(q.rq.srq)
}

// postPooled records q.recvWRs as the consumer's receives served by the
// pool, as many as the depth asked for leaves room for. The caller holds
// q.postMu and q.mu's read side.
func (q *qp) postPooled() (int, C.int) {
	rq := q.rq
	rq.mu.Lock()
	k := min(len(q.recvWRs), rq.max-(len(rq.ids)-rq.head))
	for i := range q.recvWRs[:k] {
		rq.ids = append(rq.ids, uint64(q.recvWRs[i].wr_id))
	}
	rq.mu.Unlock()
	rq.pool.add(k)
	if k > 0 && rq.failed.Load() {
		q.rcq.signal() // flushed at once, as by a device
	}
	if k < len(q.recvWRs) {
		return k, C.int(syscall.ENOMEM)
	}
	return k, 0
}

// take is the oldest receive outstanding, which a pooled receive of the
// QP completed.
func (rq *recvQueue) take() (uint64, bool) {
	rq.mu.Lock()
	defer rq.mu.Unlock()
	if rq.head == len(rq.ids) {
		return 0, false
	}
	id := rq.ids[rq.head]
	if rq.head++; rq.head == len(rq.ids) {
		rq.ids, rq.head = rq.ids[:0], 0
	}
	return id, true
}

// overrun fails q, whose peer sent a message no receive of its consumer
// was posted for (see recvPool). From a goroutine: the poller holds the
// CQ's locks, and SetError takes the QP's.
func (q *qp) overrun() {
	if q.rq.failed.Swap(true) {
		return
	}
	// An error is a QP closed meanwhile: nothing left to fail.
	go func() { _ = q.SetError() }()
}

// postShared posts q.recvWRs, with q.sges, to q's shared queue. The
// caller holds q.postMu and q.mu's read side.
func (q *qp) postShared() (int, C.int) {
	rq := q.rq
	k := len(q.recvWRs)
	// Locked across the post (a ring write in user space): the device may
	// complete a receive before the post returns, and Poll must find it
	// recorded, and a flush must not take a receive the post refused.
	rq.mu.Lock()
	for i := range q.recvWRs {
		rq.ids = append(rq.ids, uint64(q.recvWRs[i].wr_id))
	}
	var posted C.int
	rc := C.shim_post_srq_recv(rq.srq, unsafe.SliceData(q.recvWRs), C.int(k), sgePtr(q.sges), &posted)
	done := int(posted)
	if rc != 0 && errnoErr(rc) == syscall.ENOMEM && done < k && rq.growLocked() {
		nsge := 0
		for i := range q.recvWRs[:done] {
			nsge += int(q.recvWRs[i].nsge)
		}
		var more C.int
		rc = C.shim_post_srq_recv(rq.srq, &q.recvWRs[done], C.int(k-done), sgePtr(q.sges[nsge:]), &more)
		done += int(more)
	}
	rq.ids = rq.ids[:len(rq.ids)-(k-done)]
	rq.mu.Unlock()
	if done > 0 && rq.failed.Load() {
		// A device flushes a receive posted to a QP in ERROR at once.
		q.rcq.signal()
	}
	return done, rc
}

// growLocked resizes the queue to the depth asked for; false if it is
// there already or the device refused. The caller holds rq.mu.
func (rq *recvQueue) growLocked() bool {
	if rq.size >= rq.max {
		return false
	}
	if C.shim_resize_srq(rq.srq, C.uint32_t(rq.max)) != 0 {
		return false
	}
	// ibv_modify_srq reports no size: the queue holds at least rq.max.
	rq.size = rq.max
	return true
}

// completed forgets receive id; false if it was not outstanding (the
// provider flushed it already).
func (rq *recvQueue) completed(id uint64) bool {
	rq.mu.Lock()
	defer rq.mu.Unlock()
	if rq.head < len(rq.ids) && rq.ids[rq.head] == id {
		rq.head++
	} else if i := slices.Index(rq.ids[rq.head:], id); i >= 0 {
		rq.ids = slices.Delete(rq.ids, rq.head+i, rq.head+i+1)
	} else {
		return false
	}
	if rq.head == len(rq.ids) {
		rq.ids, rq.head = rq.ids[:0], 0
	}
	return true
}

// fail records that q is in ERROR; the receives outstanding flush at its
// CQ's next Poll, which a wake-up brings about.
func (q *qp) fail() {
	if q.rq == nil || q.rq.failed.Swap(true) {
		return
	}
	q.rcq.signal()
}

// flushInto writes flushed completions for q's outstanding receives,
// oldest first, into wc; it returns how many.
func (q *qp) flushInto(wc []transport.WorkCompletion) int {
	rq := q.rq
	rq.mu.Lock()
	defer rq.mu.Unlock()
	n := 0
	for ; n < len(wc) && rq.head < len(rq.ids); n++ {
		wc[n] = transport.WorkCompletion{ID: rq.ids[rq.head], Status: transport.StatusWRFlushErr,
			Opcode: transport.WCRecv, QPNum: q.num}
		rq.head++
	}
	if rq.head == len(rq.ids) {
		rq.ids, rq.head = rq.ids[:0], 0
	}
	if rq.pool != nil {
		rq.pool.remove(n)
	}
	return n
}

// trackRecvs retires the receives of QPs with shared queues of their
// own that wc completed, drops those already flushed, and notes the QPs
// an error completion shows failed. It returns how many of wc are left.
// (A pooled receive had its consumer's ID given where it was polled from
// the device queue: mapPooled.)
func trackRecvs(l []*qp, wc []transport.WorkCompletion) int {
	j := 0
	for i := range wc {
		w := &wc[i]
		if q := qpOf(l, w.QPNum); q != nil {
			if w.Status != transport.StatusSuccess {
				q.rq.failed.Store(true)
			}
			if q.rq.pool == nil && (w.Opcode == transport.WCRecv || w.Opcode == transport.WCRecvRDMAWithImm) {
				if !q.rq.completed(w.ID) {
					continue
				}
			}
		}
		if j != i {
			wc[j] = *w
		}
		j++
	}
	return j
}

// failedBefore marks the QPs of l known to have failed, bit i for l[i];
// a QP past the 63rd shares the last bit, which then stands for "any of
// the rest" (flushFailed checks those again).
func failedBefore(l []*qp) uint64 {
	var m uint64
	for i, q := range l {
		if q.rq.failed.Load() {
			m |= 1 << min(i, 63)
		}
	}
	return m
}

// flushFailed fills wc with the flushes of the outstanding receives of
// the QPs failedBefore marked before a poll the device answered with all
// it had.
func flushFailed(l []*qp, failed uint64, wc []transport.WorkCompletion) int {
	n := 0
	for i, q := range l {
		if n == len(wc) {
			break
		}
		if failed&(1<<min(i, 63)) != 0 && q.rq.failed.Load() {
			n += q.flushInto(wc[n:])
		}
	}
	return n
}

// attachRecvs makes Poll track q's receives.
func (c *cq) attachRecvs(q *qp) { c.attach(&c.rqs, q) }

func (c *cq) detachRecvs(num uint32) { c.detach(&c.rqs, num) }

// QPs with shared queues by context and number, for the device's
// asynchronous QP errors (async.go).
type rqKey struct {
	ctx *C.struct_ibv_context
	num uint32
}

var (
	rqMu     sync.Mutex
	rqByName = map[rqKey]*qp{}
)

func registerRecvQueue(q *qp) {
	rqMu.Lock()
	rqByName[rqKey{q.dev.ctx, q.num}] = q
	rqMu.Unlock()
}

func unregisterRecvQueue(q *qp) {
	rqMu.Lock()
	delete(rqByName, rqKey{q.dev.ctx, q.num})
	rqMu.Unlock()
}

// asyncQPFailed handles an asynchronous error of QP num of ctx.
func asyncQPFailed(ctx *C.struct_ibv_context, num uint32) {
	rqMu.Lock()
	q := rqByName[rqKey{ctx, num}]
	rqMu.Unlock()
	if q != nil {
		q.fail()
	}
}
