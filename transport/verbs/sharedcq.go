package verbs

// #include "shim.h"
import "C"

import (
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A device CQ is mapped into the process and resident from creation, a
// page at least per CQ on rxe (128-byte entries after a 384-byte
// header), however few completions an idle connection can have in it.
// So where the device resizes CQs, the CQs the consumer creates are
// views of a device CQ shared by up to CQShareEnv of them, as brpc and
// UCX share one CQ among many connections. A view is a CQ to its
// consumer (arm-then-notify, Poll, Wait) and serves the QPs created on
// it: polling it polls the shared CQ, under the shared CQ's lock, and
// routes each completion to its view by QP number; a view's completions
// that another view's poll took wait in its lane, a Go slice, empty when
// idle. A QP's completions on one device CQ go to one view: an error
// completion does not say whether it ended a send or a receive (its
// opcode is undefined), so a QP whose send and receive CQs are two views
// has them on two device CQs (holdViews).
//
// The shared CQ never overflows: each view holds an allotment of it,
// which covers everything that may still complete on the view (the
// account of cqgrow.go, always kept for a view), and the device queue
// is resized to hold the sum of the allotments. A view starts with
// initialCQE entries (an idle connection's receives) and takes the
// entries its consumer asked for when a post needs more; a consumer
// that posts beyond that is given more still, and its view reports
// ErrCQOverflow once more completions wait in it than it was created
// for, as a device CQ of that size would have overflowed.
//
// Notification: a view armed by ReqNotify arms the shared CQ. Whoever
// polls the shared CQ (a view's Poll, or the completion event's
// handler) and routes a completion to an armed view disarms it and
// wakes it as the completion event of a CQ of its own would; the event
// handler arms the shared CQ again while any view is armed.
type sharedCQ struct {
	dev    *device
	handle uint64
	cq     *C.struct_ibv_cq

	// mu orders polling, the lanes and armed flags of the views, the
	// routes, resizing and the allotments.
	mu     sync.Mutex
	cap    int // the device queue's entries
	allot  int // the views' allotments, summed
	wants  int // the entries the views were created for, summed
	views  []*cq
	routes map[uint32]*cq // by QP number
	buf    [16]transport.WorkCompletion
	// private: the device CQ of one view, which no other joins
	// (holdViews).
	private bool

	closed  bool         // destroyed with its last view; guarded by mu
	narmed  atomic.Int32 // views armed
	unacked uint32       // events not yet acknowledged; guarded by cqMu
}

// sharedCQs are the shared CQs by handle, for events; guarded by cqMu.
var sharedCQs = map[uint64]*sharedCQ{}

// newView creates a view of entries of a shared CQ of d with room for it.
func newView(d *device, entries int) (*cq, error) {
	start := min(entries, initialCQE)
	c := &cq{dev: d, view: true, want: entries, cap: start, woke: make(chan struct{}, 1), closing: make(chan struct{})}
	d.sharedMu.Lock()
	defer d.sharedMu.Unlock()
	var s *sharedCQ
	for _, x := range d.shared {
		x.mu.Lock()
		room := !x.private && len(x.views) < d.qpEnv.cqShare && x.wants+entries+d.poolRoom() <= d.attr.MaxCQE
		x.mu.Unlock()
		if room {
			s = x
			break
		}
	}
	if s == nil {
		var err error
		if s, err = newSharedCQ(d, start+d.poolRoom()); err != nil {
			return nil, err
		}
		d.shared = append(d.shared, s)
	}
	s.mu.Lock()
	if err := s.resizeLocked(s.allot + start); err != nil {
		empty := len(s.views) == 0
		s.mu.Unlock()
		if empty {
			d.dropShared(s)
		}
		return nil, err
	}
	s.allot += start
	s.wants += entries
	s.views = append(s.views, c)
	c.sh = s
	s.mu.Unlock()
	return c, nil
}

func newSharedCQ(d *device, entries int) (*sharedCQ, error) {
	h := newHandle()
	q, err := C.shim_create_cq(d.ctx, C.int(entries), d.comp.ch, C.uint64_t(h))
	if q == nil {
		return nil, fmt.Errorf("verbs: ibv_create_cq(%d): %w", entries, errnoNow(err))
	}
	s := &sharedCQ{dev: d, handle: h, cq: q, cap: int(C.shim_cq_cqe(q)), routes: map[uint32]*cq{}}
	cqMu.Lock()
	sharedCQs[h] = s
	cqMu.Unlock()
	return s, nil
}

// resizeLocked grows the device queue to hold n entries, doubling, so
// that a fleet of views resizes it a few times. The caller holds s.mu.
//
// Beside the allotments it keeps room for the device's whole receive
// pool, which may complete on any CQ (see recvPool).
func (s *sharedCQ) resizeLocked(n int) error {
	n += s.dev.poolRoom()
	if n <= s.cap {
		return nil
	}
	if n > s.dev.attr.MaxCQE {
		return fmt.Errorf("verbs: a shared CQ of %d entries would pass the device's %d", n, s.dev.attr.MaxCQE)
	}
	size := s.cap
	for size < n {
		size = 2*size + 1 // a power of two of slots, one kept empty
	}
	size = min(size, s.dev.attr.MaxCQE)
	if rc := C.shim_resize_cq(s.cq, C.int(size)); rc != 0 {
		return fmt.Errorf("verbs: growing a shared CQ from %d to %d entries: %w", s.cap, size, opErr("ibv_resize_cq", rc))
	}
	s.cap = int(C.shim_cq_cqe(s.cq))
	return nil
}

// growView raises view c's allotment to n entries. The caller holds
// c.acct.mu and c.mu's read side.
func (s *sharedCQ) growView(c *cq, n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.resizeLocked(s.allot - c.cap + n); err != nil {
		return err
	}
	s.allot += n - c.cap
	c.cap = n
	return nil
}

// bind routes QP num's completions to view c.
func (s *sharedCQ) bind(c *cq, num uint32) {
	s.mu.Lock()
	s.routes[num] = c
	c.nqp++
	s.mu.Unlock()
}

// unbind forgets a destroyed QP: what it completed is first taken from
// the device queue into its views' lanes, where their consumers may
// still poll it (a device queue of their own would keep it too).
func (s *sharedCQ) unbind(c *cq, num uint32) {
	s.mu.Lock()
	_, _, wake := s.drainLocked(nil, nil, 0, nil)
	delete(s.routes, num)
	c.nqp--
	s.mu.Unlock()
	wakeViews(wake, false)
}

// pollFor is ibv_poll_cq for view v: what waits in its lane, then what
// the device queue has for it, the rest routed to the other views. It
// returns fewer than len(wc) only when v has nothing more for now.
func (s *sharedCQ) pollFor(v *cq, wc []transport.WorkCompletion) C.int {
	s.mu.Lock()
	n := copy(wc, v.lane)
	if v.lane = v.lane[n:]; len(v.lane) == 0 {
		v.lane = nil
	}
	var rc C.int
	var wake []*cq
	if n < len(wc) {
		n, rc, wake = s.drainLocked(v, wc, n, nil)
	}
	if len(v.lane)+n > v.want && !v.overflow.Load() {
		// More wait than the view was created for: the device queue of
		// its own would have overflowed. Reported from the next Poll.
		v.overflow.Store(true)
	}
	s.mu.Unlock()
	wakeViews(wake, false)
	if n == 0 && rc < 0 {
		return rc
	}
	return C.int(n)
}

// drainLocked polls the device queue, into wc from n on for view v, the
// rest into the lanes of their views, until it is empty or wc is full.
// It returns the armed views that completions were routed to, disarmed,
// for the caller to wake once it let go of s.mu.
//
// A pooled receive is given its consumer's ID here (mapPooled), by
// whoever polls, so that the pool posts it again without waiting for its
// view's consumer to poll.
func (s *sharedCQ) drainLocked(v *cq, wc []transport.WorkCompletion, n int, wake []*cq) (int, C.int, []*cq) {
	pool := s.dev.pool.Load()
	spent, took := 0, 0
	defer func() {
		if spent > 0 {
			pool.spent(spent, took)
		}
	}()
	for {
		m := C.shim_poll_cq(s.cq, (*C.struct_shim_wc)(unsafe.Pointer(&s.buf[0])), C.int(len(s.buf)))
		if m < 0 {
			return n, m, wake
		}
		for i := range s.buf[:m] {
			w := &s.buf[i]
			o := s.routes[w.QPNum]
			if pool != nil && w.ID == transport.PooledRecvID {
				spent++
				if !mapPooled(o, w) {
					continue
				}
				took++
			}
			switch {
			case o == nil:
				// A QP destroyed with its views: nobody polls it.
			case o == v && n < len(wc):
				wc[n] = *w
				n++
			case o == v:
				// Polling now: the rest waits for its next Poll.
				o.lane = append(o.lane, *w)
			default:
				o.lane = append(o.lane, *w)
				if len(o.lane) > o.want {
					o.overflow.Store(true)
				}
				if o.armed.CompareAndSwap(true, false) {
					s.narmed.Add(-1)
					wake = append(wake, o)
				}
			}
		}
		if int(m) < len(s.buf) || (v != nil && n == len(wc)) {
			return n, 0, wake
		}
	}
}

// wakeViews does for each view what a completion event does for a CQ of
// its own: the provider serves its held sends, and its consumer wakes.
// inline: the caller holds no lock of the provider (the completion
// channel's goroutine); a poller, which may hold its own view's locks,
// leaves held sends to a goroutine of their own (a view whose held sends
// wait on the room a completion frees, which is rare), since serving
// them polls the view.
func wakeViews(views []*cq, inline bool) {
	for _, c := range views {
		switch {
		case inline:
			c.serveHolds()
		case c.holdsWaiting():
			go c.serveHolds()
		}
		c.signal()
	}
}

// arm arms view c, and the device queue for it.
func (s *sharedCQ) arm(c *cq) C.int {
	if c.armed.CompareAndSwap(false, true) {
		s.narmed.Add(1)
	}
	return C.shim_req_notify_cq(s.cq)
}

// onEvent runs on the shared CQ's completion event: the completions go
// to their views, and the armed ones wake. The device queue is armed
// again while a view is; what completed between the drain and the arm
// raised no event and is taken by a second drain.
func (s *sharedCQ) onEvent() {
	for range 2 {
		s.mu.Lock()
		if s.closed {
			// Its last view closed after the event was read.
			s.mu.Unlock()
			return
		}
		_, _, wake := s.drainLocked(nil, nil, 0, nil)
		s.mu.Unlock()
		wakeViews(wake, true)
		if s.narmed.Load() == 0 {
			return
		}
		s.mu.Lock()
		rc := C.int(-1)
		if !s.closed {
			rc = C.shim_req_notify_cq(s.cq)
		}
		s.mu.Unlock()
		if rc != 0 {
			return
		}
	}
}

// leave removes closed view c: its allotment returns to the shared CQ,
// which is destroyed with its last view. Its QPs are destroyed, and
// unbind took their completions from the device queue, so none of the
// entries given back can still be in use.
func (s *sharedCQ) leave(c *cq) error {
	d := s.dev
	d.sharedMu.Lock()
	defer d.sharedMu.Unlock()
	s.mu.Lock()
	s.removeLocked(c)
	if c.armed.CompareAndSwap(true, false) {
		s.narmed.Add(-1)
	}
	last := len(s.views) == 0
	s.mu.Unlock()
	if !last {
		return nil
	}
	return d.dropShared(s)
}

// dropShared destroys a shared CQ that has no view. The caller holds
// d.sharedMu, not s.mu.
func (d *device) dropShared(s *sharedCQ) error {
	s.mu.Lock()
	s.closed = true // the event handler, which holds no view, checks it
	// What the device queue still holds is of QPs that are gone; drained
	// as any poll does, so that the pool counts its receives in it.
	s.drainLocked(nil, nil, 0, nil)
	s.mu.Unlock()
	if i := slices.Index(d.shared, s); i >= 0 {
		d.shared = slices.Delete(d.shared, i, i+1)
	}
	forgetEvents(s.cq, &s.unacked, func() { delete(sharedCQs, s.handle) })
	if rc := C.shim_ibv_destroy_cq(s.cq); rc != 0 {
		return fmt.Errorf("verbs: destroying a shared CQ: %w", opErr("ibv_destroy_cq", rc))
	}
	return nil
}

// kickAll reports an overflow of the device queue to every view.
func (s *sharedCQ) kickAll() {
	s.mu.Lock()
	views := append([]*cq(nil), s.views...)
	s.mu.Unlock()
	for _, c := range views {
		c.overflow.Store(true)
		c.kick()
	}
}

// ibv is the device CQ that QPs of c complete on.
func (c *cq) ibv() *C.struct_ibv_cq {
	if c.sh != nil {
		return c.sh.cq
	}
	return c.cq
}

// bindQPs routes a new QP's completions to its CQs that are views; the
// caller holds what holdViews returned.
func bindQPs(scq, rcq *cq, num uint32) {
	if scq.view {
		scq.sh.bind(scq, num)
	}
	if rcq.view && rcq != scq {
		rcq.sh.bind(rcq, num)
	}
}

// unbindQPs undoes bindQPs for a destroyed QP.
func unbindQPs(scq, rcq *cq, num uint32) {
	if scq.view {
		scq.sh.unbind(scq, num)
	}
	if rcq.view && rcq != scq {
		rcq.sh.unbind(rcq, num)
	}
}

// holdViews readies the CQs of a QP about to be created, and holds the
// device's views in place until the QP is bound to them (the caller
// calls release). A QP whose send and receive CQs are two views of one
// device CQ has one of them moved to a device CQ of its own, which only
// a view no QP uses yet can be.
func holdViews(scq, rcq *cq) (release func(), err error) {
	if !scq.view && !rcq.view {
		return func() {}, nil
	}
	d := scq.dev
	d.sharedMu.Lock()
	if scq != rcq && scq.view && rcq.view && scq.sh == rcq.sh {
		if err = d.isolateLocked(rcq); err != nil {
			if err2 := d.isolateLocked(scq); err2 != nil {
				d.sharedMu.Unlock()
				return nil, fmt.Errorf("verbs: the send and receive CQs of a QP are views of one device CQ, and neither can move to one of its own: %w", err)
			}
		}
	}
	return d.sharedMu.Unlock, nil
}

// isolateLocked moves view c, which no QP uses, to a device CQ of its
// own. The caller holds d.sharedMu.
func (d *device) isolateLocked(c *cq) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("verbs: CQ closed: %w", net.ErrClosed)
	}
	old := c.sh
	old.mu.Lock()
	busy := c.nqp > 0
	old.mu.Unlock()
	if busy {
		return fmt.Errorf("verbs: a QP uses the CQ: %w", transport.ErrQPState)
	}
	s, err := newSharedCQ(d, c.cap)
	if err != nil {
		return err
	}
	s.private = true
	old.mu.Lock()
	old.removeLocked(c)
	armed := c.armed.Load()
	if armed {
		old.narmed.Add(-1)
	}
	empty := len(old.views) == 0
	old.mu.Unlock()
	s.allot, s.wants, s.views = c.cap, c.want, []*cq{c}
	if armed {
		s.narmed.Add(1)
		C.shim_req_notify_cq(s.cq)
	}
	c.sh = s
	d.shared = append(d.shared, s)
	if empty {
		return d.dropShared(old)
	}
	return nil
}

// removeLocked takes view c out of s. The caller holds s.mu.
func (s *sharedCQ) removeLocked(c *cq) {
	if i := slices.Index(s.views, c); i >= 0 {
		s.views = slices.Delete(s.views, i, i+1)
	}
	s.allot -= c.cap
	s.wants -= c.want
	c.lane = nil
}

// closeView is Close of a view. As verbs refuses to destroy a CQ that
// QPs use, a view refuses to close. It lets go of c.mu before the
// device's lock (holdViews takes them the other way round).
func (c *cq) closeView() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	s := c.sh
	s.mu.Lock()
	busy := c.nqp > 0
	s.mu.Unlock()
	if busy {
		c.mu.Unlock()
		return fmt.Errorf("verbs: CQ still in use by a QP: %w", opErr("ibv_destroy_cq", C.int(syscall.EBUSY)))
	}
	close(c.closing)
	c.closed = true
	c.mu.Unlock()
	return s.leave(c)
}
