package verbs

// #include "shim.h"
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// shim_wc must have the layout of transport.WorkCompletion: Poll hands
// the caller's slice to ibv_poll_cq's wrapper. Each pair of arrays below
// fails to compile unless the two offsets are equal.
var (
	_ [unsafe.Sizeof(transport.WorkCompletion{}) - C.SHIM_WC_SIZE]struct{}
	_ [C.SHIM_WC_SIZE - unsafe.Sizeof(transport.WorkCompletion{})]struct{}
	_ [unsafe.Offsetof(transport.WorkCompletion{}.Status) - C.SHIM_WC_OFF_STATUS]struct{}
	_ [C.SHIM_WC_OFF_STATUS - unsafe.Offsetof(transport.WorkCompletion{}.Status)]struct{}
	_ [unsafe.Offsetof(transport.WorkCompletion{}.Opcode) - C.SHIM_WC_OFF_OPCODE]struct{}
	_ [C.SHIM_WC_OFF_OPCODE - unsafe.Offsetof(transport.WorkCompletion{}.Opcode)]struct{}
	_ [unsafe.Offsetof(transport.WorkCompletion{}.ByteLen) - C.SHIM_WC_OFF_BYTE_LEN]struct{}
	_ [C.SHIM_WC_OFF_BYTE_LEN - unsafe.Offsetof(transport.WorkCompletion{}.ByteLen)]struct{}
	_ [unsafe.Offsetof(transport.WorkCompletion{}.Imm) - C.SHIM_WC_OFF_IMM]struct{}
	_ [C.SHIM_WC_OFF_IMM - unsafe.Offsetof(transport.WorkCompletion{}.Imm)]struct{}
	_ [unsafe.Offsetof(transport.WorkCompletion{}.HasImm) - C.SHIM_WC_OFF_HAS_IMM]struct{}
	_ [C.SHIM_WC_OFF_HAS_IMM - unsafe.Offsetof(transport.WorkCompletion{}.HasImm)]struct{}
	_ [unsafe.Offsetof(transport.WorkCompletion{}.QPNum) - C.SHIM_WC_OFF_QP_NUM]struct{}
	_ [C.SHIM_WC_OFF_QP_NUM - unsafe.Offsetof(transport.WorkCompletion{}.QPNum)]struct{}
	_ [unsafe.Offsetof(transport.WorkCompletion{}.VendorErr) - C.SHIM_WC_OFF_VENDOR_ERR]struct{}
	_ [C.SHIM_WC_OFF_VENDOR_ERR - unsafe.Offsetof(transport.WorkCompletion{}.VendorErr)]struct{}
)

// ackBatch is how many completion events are acknowledged at once:
// ibv_ack_cq_events takes a mutex, and ibv_destroy_cq only needs the
// total to be right at the end.
const ackBatch = 64

// Every CQ of a device shares the device's completion channel, read by
// one goroutine (compChannel.serve) that hands each event to its CQ: the
// function of SetNotify (transport.NotifyCQ), else a wake-up for Wait. So
// a connection waiting for completions has neither a goroutine nor a
// descriptor of its own, as Go's netpoller serves every socket from one
// epoll instance.
type cq struct {
	dev    *device
	handle uint64
	cq     *C.struct_ibv_cq
	cap    int

	// The device queue may start smaller than asked (cqgrow.go); then
	// want is the size asked for and acct counts what may arrive.
	want  int
	grown atomic.Bool // the device queue has its full size: no accounting
	acct  cqAcct

	// QPs whose send queue is partly held by the provider (sendhold.go).
	// The provider polls such a CQ itself when a completion frees room
	// for held WRs; what it polled waits in stash for Poll, which takes
	// it first (pollMu keeps the order). listMu orders changes to this
	// list and the next (attach, detach).
	listMu sync.Mutex
	holds  atomic.Pointer[[]*qp]
	// QPs that receive through shared queues of their own (srq.go),
	// whose receives the provider tracks.
	rqs    atomic.Pointer[[]*qp]
	pollMu sync.Mutex
	stash  []transport.WorkCompletion
	nstash atomic.Int32

	overflow atomic.Bool
	fn       atomic.Pointer[func()] // SetNotify's, called instead of waking Wait
	woke     chan struct{}          // a wake-up for Wait, buffered so none is lost
	unacked  uint32                 // events not yet acknowledged; guarded by cqMu
	closing  chan struct{}

	// A view of a shared device CQ (sharedcq.go), or nil: its lane of
	// completions that other views' polls took, whether it is armed,
	// and how many QPs it serves. lane and nqp are guarded by sh.mu.
	// sh is written under the device's sharedMu and c.mu (holdViews);
	// view is fixed at creation.
	view  bool
	sh    *sharedCQ
	lane  []transport.WorkCompletion
	armed atomic.Bool
	nqp   int

	// mu orders Poll/ReqNotify (read side) against destruction.
	mu     sync.RWMutex
	closed bool
}

func newCQ(d *device, entries int) (*cq, error) {
	if entries <= 0 {
		return nil, fmt.Errorf("verbs: CreateCQ(%d): entries must be positive", entries)
	}
	if d.attr.MaxCQE > 0 && entries > d.attr.MaxCQE {
		return nil, fmt.Errorf("verbs: CreateCQ(%d): device limit is %d entries", entries, d.attr.MaxCQE)
	}
	if d.sharesCQs() {
		return newView(d, entries)
	}
	h := newHandle()
	start := entries
	if d.cqGrows {
		start = min(entries, initialCQE)
	}
	q, err := C.shim_create_cq(d.ctx, C.int(start), d.comp.ch, C.uint64_t(h))
	if q == nil {
		return nil, fmt.Errorf("verbs: ibv_create_cq(%d): %w", start, errnoNow(err))
	}
	c := &cq{dev: d, handle: h, cq: q, cap: int(C.shim_cq_cqe(q)), want: entries,
		woke: make(chan struct{}, 1), closing: make(chan struct{})}
	c.grown.Store(start == entries)
	cqMu.Lock()
	cqs[h] = c
	cqMu.Unlock()
	return c, nil
}

// Cap is the device's capacity for the entries asked for. A queue that
// started small grows to it first, so that the figure holds (a caller may
// count on it, as the overflow tests do).
func (c *cq) Cap() int {
	if c.view {
		// A view takes its entries of the shared CQ when a post needs
		// them: what it was created for is what the consumer may count on.
		return c.want
	}
	if !c.grown.Load() {
		c.mu.RLock()
		if !c.closed {
			c.acct.mu.Lock()
			_ = c.growLocked()
			c.acct.mu.Unlock()
		}
		c.mu.RUnlock()
	}
	c.acct.mu.Lock()
	defer c.acct.mu.Unlock()
	return c.cap
}

func (c *cq) Poll(wc []transport.WorkCompletion) (int, error) {
	if len(wc) == 0 {
		return 0, nil
	}
	if c.holds.Load() == nil && c.nstash.Load() == 0 {
		n, _, _, err := c.pollDevice(wc, nil)
		return n, err
	}
	var buf [2]*qp
	c.pollMu.Lock()
	n := c.takeStash(wc)
	var touched []*qp
	var err error
	if n < len(wc) {
		var m int
		m, _, touched, err = c.pollDevice(wc[n:], buf[:0])
		n += m
	}
	c.pollMu.Unlock()
	// After the CQ's locks: a refill posts, and posting counts on the CQ.
	for _, q := range touched {
		q.refill()
	}
	if n > 0 {
		return n, nil // an error stays for the next Poll
	}
	return n, err
}

// pollDevice polls the device queue into wc. It returns what is left for
// the consumer, how many the device gave, and the QPs with held sends
// that had completions.
func (c *cq) pollDevice(wc []transport.WorkCompletion, touched []*qp) (n, raw int, _ []*qp, _ error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return 0, 0, touched, fmt.Errorf("verbs: Poll on closed CQ: %w", net.ErrClosed)
	}
	if c.overflow.Load() {
		return 0, 0, touched, transport.ErrCQOverflow
	}
	for {
		// Which QPs had failed before this poll: only a poll that began
		// after the failure and came up short has every receive the
		// device completed, so only their outstanding receives flush.
		// A QP that fails during the poll waits for the next one (it
		// signals the CQ), lest a receive the device completes just
		// after the poll flush ahead of it.
		var failed uint64
		var l []*qp
		if p := c.rqs.Load(); p != nil {
			l = *p
			failed = failedBefore(l)
		}
		var rc C.int
		if c.sh != nil {
			rc = c.sh.pollFor(c, wc)
		} else {
			rc = C.shim_poll_cq(c.cq, (*C.struct_shim_wc)(unsafe.Pointer(&wc[0])), C.int(len(wc)))
		}
		if rc < 0 {
			return 0, 0, touched, opErr("ibv_poll_cq", rc)
		}
		n = int(rc)
		if n > 0 && !c.grown.Load() {
			c.polled(wc[:n])
		}
		raw = n
		if m := c.holds.Load(); m != nil && n > 0 {
			n, touched = dropForced(*m, wc[:n], touched)
		}
		if l != nil {
			if n > 0 {
				n = trackRecvs(l, wc[:n])
			}
			if raw < len(wc) && failed != 0 {
				// The device has nothing more: a failed QP's receives flush.
				n += flushFailed(l, failed, wc[n:])
			}
		}
		// A full batch that was all the provider's own (completions the
		// consumer did not ask for, receives already flushed) says
		// nothing of what is left: returning none would have the
		// consumer take the queue for empty and sleep on it.
		if n > 0 || raw < len(wc) {
			return n, raw, touched, nil
		}
	}
}

func (c *cq) ReqNotify() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return fmt.Errorf("verbs: ReqNotify on closed CQ: %w", net.ErrClosed)
	}
	if c.sh != nil {
		return opErr("ibv_req_notify_cq", c.sh.arm(c))
	}
	return opErr("ibv_req_notify_cq", C.shim_req_notify_cq(c.cq))
}

// SetNotify implements transport.NotifyCQ.
func (c *cq) SetNotify(fn func()) {
	if fn == nil {
		c.fn.Store(nil)
		return
	}
	c.fn.Store(&fn)
}

// signal is what a completion event (or an overflow) does to the CQ.
func (c *cq) signal() {
	if fn := c.fn.Load(); fn != nil {
		(*fn)()
		return
	}
	select {
	case c.woke <- struct{}{}:
	default:
	}
}

func (c *cq) Wait(ctx context.Context) error {
	select {
	case <-c.closing:
		return fmt.Errorf("verbs: Wait on closed CQ: %w", net.ErrClosed)
	default:
	}
	select {
	case <-c.woke:
		return nil // an overflow too: Poll reports ErrCQOverflow
	case <-c.closing:
		return fmt.Errorf("verbs: Wait on closed CQ: %w", net.ErrClosed)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// kick wakes a waiter so that it re-checks the CQ's flags.
func (c *cq) kick() { c.signal() }

// Close destroys the CQ. QPs using it must be closed first: otherwise
// verbs refuses (EBUSY), Close returns the error, Poll still works and
// Wait reports the CQ closed.
func (c *cq) Close() error {
	if c.view {
		return c.closeView()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	select {
	case <-c.closing:
	default:
		close(c.closing)
	}
	forgetEvents(c.cq, &c.unacked, func() { delete(cqs, c.handle) })
	if rc := C.shim_ibv_destroy_cq(c.cq); rc != 0 {
		cqMu.Lock()
		cqs[c.handle] = c // still usable
		cqMu.Unlock()
		return fmt.Errorf("verbs: CQ still in use by a QP: %w", opErr("ibv_destroy_cq", rc))
	}
	c.closed = true
	return nil
}

// compChannel is a device's completion channel and the goroutine that
// reads it.
type compChannel struct {
	ch   *C.struct_ibv_comp_channel
	poll *pollFD
	done chan struct{}
}

func newCompChannel(d *device) (*compChannel, error) {
	ch, err := C.shim_ibv_create_comp_channel(d.ctx)
	if ch == nil {
		return nil, fmt.Errorf("verbs: ibv_create_comp_channel: %w", errnoNow(err))
	}
	p, err := newPollFD(C.shim_comp_channel_fd(ch), "ibv_comp_channel")
	if err != nil {
		C.shim_ibv_destroy_comp_channel(ch)
		return nil, err
	}
	cc := &compChannel{ch: ch, poll: p, done: make(chan struct{})}
	go cc.serve()
	return cc, nil
}

// serve hands each completion event to its CQ until the channel closes.
func (cc *compChannel) serve() {
	defer close(cc.done)
	var q *C.struct_ibv_cq
	var h C.uint64_t
	cc.poll.serve("ibv_get_cq_event", func() C.int { return C.shim_get_cq_event_of(cc.ch, &q, &h) }, func() {
		cqMu.Lock()
		c := cqs[uint64(h)]
		if s := sharedCQs[uint64(h)]; s != nil {
			countEventLocked(s.cq, &s.unacked)
			cqMu.Unlock()
			s.onEvent()
			return
		}
		if c == nil {
			// Being destroyed: its Close waits for this acknowledgement.
			C.shim_ack_cq_events(q, 1)
			cqMu.Unlock()
			return
		}
		countEventLocked(c.cq, &c.unacked)
		cqMu.Unlock()
		c.serveHolds()
		c.signal()
	})
}

// countEventLocked counts an event of q in *unacked, acknowledging them
// ackBatch at a time. The caller holds cqMu.
func countEventLocked(q *C.struct_ibv_cq, unacked *uint32) {
	if *unacked++; *unacked >= ackBatch {
		C.shim_ack_cq_events(q, C.uint(*unacked))
		*unacked = 0
	}
}

// forgetEvents removes a CQ from the event maps (del, under cqMu) and
// acknowledges the events counted for it: ibv_destroy_cq waits until
// every event of the CQ is. Events the channel's reader takes from then
// on find no CQ and are acknowledged there.
func forgetEvents(q *C.struct_ibv_cq, unacked *uint32, del func()) {
	cqMu.Lock()
	del()
	n := *unacked
	*unacked = 0
	cqMu.Unlock()
	if n > 0 {
		C.shim_ack_cq_events(q, C.uint(n))
	}
}

// close stops the goroutine and destroys the channel; every CQ on it must
// have been destroyed.
func (cc *compChannel) close() error {
	err := cc.poll.close()
	<-cc.done
	if rc := C.shim_ibv_destroy_comp_channel(cc.ch); rc != 0 {
		return errors.Join(err, opErr("ibv_destroy_comp_channel", rc))
	}
	return err
}

// attach adds q to one of the CQ's lists of QPs the provider serves.
// The lists are copied on write: Poll reads them without a lock.
func (c *cq) attach(list *atomic.Pointer[[]*qp], q *qp) {
	c.listMu.Lock()
	defer c.listMu.Unlock()
	var l []*qp
	if old := list.Load(); old != nil {
		l = slices.Clone(*old)
	}
	l = append(l, q)
	list.Store(&l)
}

// detach removes QP num from the list; an empty list is nil.
func (c *cq) detach(list *atomic.Pointer[[]*qp], num uint32) {
	c.listMu.Lock()
	defer c.listMu.Unlock()
	old := list.Load()
	if old == nil {
		return
	}
	l := slices.DeleteFunc(slices.Clone(*old), func(q *qp) bool { return q.num == num })
	if len(l) == 0 {
		list.Store(nil)
		return
	}
	list.Store(&l)
}

// qpOf is QP num of the list, or nil.
func qpOf(l []*qp, num uint32) *qp {
	for _, q := range l {
		if q.num == num {
			return q
		}
	}
	return nil
}
