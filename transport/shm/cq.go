package shm

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A CQ's header is shared memory because completions are added by the
// peer process too (receive completions of our QPs). The armed flag and
// the completion count live there. A peer that finds the queue armed wakes
// it with a message on the connection's unix socket (or directly, when the
// peer is this process): an eventfd per queue, handed to each peer, would
// cost three descriptors per connection end.
const (
	cqArmed    = 0 // u32: 1 after ReqNotify, cleared by the notifier
	cqOverflow = 4 // u32: 1 once a completion was lost
	cqCount    = 8 // u64: completions added and not yet polled
	cqHdrSize  = 64
)

// cqHeader is a view of a CQ header, ours or a peer's.
type cqHeader []byte

// add counts one new completion and reports false if it overflows the queue.
func (h cqHeader) add(capacity int) bool {
	if atomic.AddUint64(word64(h, cqCount), 1) > uint64(capacity) {
		atomic.StoreUint32(word32(h, cqOverflow), 1)
		return false
	}
	return true
}

func (h cqHeader) done(n int) { atomic.AddUint64(word64(h, cqCount), ^uint64(n-1)) }

func (h cqHeader) overflowed() bool { return atomic.LoadUint32(word32(h, cqOverflow)) != 0 }

// disarm reports whether the queue was armed, and disarms it: the caller
// then owes the waiter a wake-up. The completion must be published before
// this runs; ReqNotify stores armed before the caller's final Poll, so with
// both sides using sequentially consistent atomics a completion is either
// seen by that Poll or finds the queue armed.
func (h cqHeader) disarm() bool {
	return atomic.CompareAndSwapUint32(word32(h, cqArmed), 1, 0)
}

// cqe is a completion generated in this process (send completions and
// flushes), queued until Poll.
type cqe struct {
	wc    transport.WorkCompletion
	q     *qp
	sqIdx uint64
	send  bool
}

type cq struct {
	dev  *device // whose control arenas hold the header
	id   uint64
	cap  int
	seg  *segment
	hdr  cqHeader
	fn   atomic.Pointer[func()] // SetNotify's: called instead of waking Wait
	wait atomic.Pointer[cqWait] // Wait's, made at its first use (waiter)

	mu    sync.Mutex
	local []cqe
	rings []*qp // QPs whose receive completions land here
	// users: the QPs using this CQ, once as send and once as receive CQ
	// (a list: a connection's CQ has one QP, and a map cost each 140 B).
	users   []*qp
	rr      int // round-robin start over rings
	closed  bool
	ovfSeen bool
	tainted bool // a QP closed without its peer's word that it stopped
}

// cqWait is what Wait sleeps on. A queue with a SetNotify callback, as
// every conn connection's on shm, never needs it: it is made at the first
// Wait or wake-up without a callback (192 B of every connection end).
type cqWait struct {
	woke chan struct{} // a wake-up, buffered so none is lost
	done chan struct{} // closed by Close
}

// waiter returns the queue's cqWait, made now if needed. Close closes
// done if it finds it; Wait checks closed after it has it.
func (c *cq) waiter() *cqWait {
	if w := c.wait.Load(); w != nil {
		return w
	}
	w := &cqWait{woke: make(chan struct{}, 1), done: make(chan struct{})}
	if !c.wait.CompareAndSwap(nil, w) {
		return c.wait.Load()
	}
	return w
}

var cqIDs atomic.Uint64

// liveCQs finds a CQ of this process by id, for a peer in the same
// process. procToken tells this process from others with the same pid
// seen through another namespace.
var (
	liveCQs   sync.Map // uint64 → *cq
	procToken = newToken()
	// ownPID is this process's pid (os.Getpid is a system call each time).
	ownPID = os.Getpid()
)

func newToken() uint64 {
	var b [8]byte
	rand.Read(b[:]) // never fails (it would crash the program first)
	return le64(b[:]) | 1
}

func lookupCQ(id uint64) *cq {
	if v, ok := liveCQs.Load(id); ok {
		return v.(*cq)
	}
	return nil
}

func newCQ(d *device, entries int) (*cq, error) {
	seg, err := newSegment(d.ctl, cqHdrSize)
	if err != nil {
		return nil, fmt.Errorf("shm: create CQ: %w", err)
	}
	c := &cq{
		dev: d,
		id:  cqIDs.Add(1),
		cap: entries,
		seg: seg,
		hdr: cqHeader(seg.mem),
	}
	liveCQs.Store(c.id, c)
	return c, nil
}

// signal wakes Wait (or the next Wait), or calls SetNotify's function.
func (c *cq) signal() {
	if fn := c.fn.Load(); fn != nil {
		(*fn)()
		return
	}
	sendKick(c.waiter().woke)
}

func (c *cq) SetNotify(fn func()) {
	if fn == nil {
		c.fn.Store(nil)
		return
	}
	c.fn.Store(&fn)
}

// notify wakes a waiter if the queue is armed.
func (c *cq) notify() {
	if c.hdr.disarm() {
		c.signal()
	}
}

func (c *cq) Cap() int { return c.cap }

func (c *cq) ReqNotify() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("shm: CQ ReqNotify: %w", net.ErrClosed)
	}
	atomic.StoreUint32(word32(c.hdr, cqArmed), 1)
	return nil
}

// push adds a completion generated in this process.
func (c *cq) push(e cqe) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	if !c.hdr.add(c.cap) {
		c.overflowLocked()
		return
	}
	c.local = append(c.local, e)
	c.notify()
}

// wake notifies an armed waiter that completions (flushes, computed at
// Poll time) became available.
func (c *cq) wake() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.closed {
		c.notify()
	}
}

// overflowLocked puts every QP using the queue in ERROR, as the
// IBV_EVENT_CQ_ERR affiliated event does, and wakes a waiter so that its
// next Poll reports the overflow.
func (c *cq) overflowLocked() {
	if c.ovfSeen {
		return
	}
	c.ovfSeen = true
	for _, q := range c.users {
		q.ring.setErr()
		q.kick()
	}
	c.notify()
}

// checkOverflow applies an overflow a peer caused to the QPs using us.
func (c *cq) checkOverflow() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.closed && c.hdr.overflowed() {
		c.overflowLocked()
	}
}

func (c *cq) Poll(wc []transport.WorkCompletion) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, fmt.Errorf("shm: CQ poll: %w", net.ErrClosed)
	}
	if c.hdr.overflowed() {
		c.overflowLocked()
		return 0, transport.ErrCQOverflow
	}
	n := 0
	for n < len(wc) && len(c.local) > 0 {
		e := &c.local[0]
		wc[n] = e.wc
		if e.send {
			e.q.retireSend(e.sqIdx)
		}
		c.local[0] = cqe{}
		c.local = c.local[1:]
		n++
	}
	if len(c.local) == 0 {
		c.local = c.local[:0:0]
	}
	if n > 0 {
		c.hdr.done(n)
	}
	for i := 0; i < len(c.rings) && n < len(wc); i++ {
		q := c.rings[(c.rr+i)%len(c.rings)]
		k, counted := q.pollRecv(wc[n:])
		if counted > 0 {
			c.hdr.done(counted)
		}
		n += k
	}
	c.rr++
	return n, nil
}

// aLongTimeAgo makes a pending read return at once.
var aLongTimeAgo = time.Unix(1, 0)

func (c *cq) Wait(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	w := c.waiter()
	c.mu.Lock()
	closed := c.closed // else Close, later, finds w and closes done
	c.mu.Unlock()
	if closed {
		return fmt.Errorf("shm: CQ wait: %w", net.ErrClosed)
	}
	select {
	case <-w.woke:
		return nil
	case <-w.done:
		return fmt.Errorf("shm: CQ wait: %w", net.ErrClosed)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// place returns the inode of the arena of the CQ header and its place there.
func (c *cq) place() (ino, off uint64, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, 0, fmt.Errorf("shm: CQ closed: %w", net.ErrClosed)
	}
	ino, off = c.seg.place()
	return ino, off, nil
}

// share returns a dup of the header's arena fd and the header's place in it.
func (c *cq) share() (fd int, off uint64, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return -1, 0, fmt.Errorf("shm: CQ closed: %w", net.ErrClosed)
	}
	fd, off, err = c.seg.share()
	if err != nil {
		return -1, 0, fmt.Errorf("shm: share CQ header with peer: %w", err)
	}
	return fd, off, nil
}

func (c *cq) attach(q *qp, recv bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.users = append(c.users, q)
	if recv {
		c.rings = append(c.rings, q)
	}
}

func (c *cq) detach(q *qp, recv, clean bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !clean {
		c.tainted = true
	}
	if recv {
		for i, r := range c.rings {
			if r == q {
				c.rings = append(c.rings[:i], c.rings[i+1:]...)
				break
			}
		}
	}
	if i := slices.Index(c.users, q); i >= 0 {
		c.users = slices.Delete(c.users, i, i+1)
	}
	c.releaseLocked()
}

// releaseLocked frees the shared header once the queue is closed and no
// QP can still add to it; a header a peer may still write (tainted) is
// left unused rather than handed to the next queue.
func (c *cq) releaseLocked() {
	if c.closed && len(c.users) == 0 && c.seg != nil {
		if c.tainted {
			c.seg.quarantine()
		} else {
			c.seg.close()
		}
		c.seg = nil
	}
}

func (c *cq) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if w := c.wait.Load(); w != nil {
		close(w.done)
	}
	liveCQs.Delete(c.id)
	c.releaseLocked()
	c.dev.cqs.Add(-1)
	return nil
}
