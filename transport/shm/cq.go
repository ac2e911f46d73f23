package shm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A CQ's header is shared memory because completions are added by the
// peer process too (receive completions of our QPs). The armed flag and
// the completion count live there; the eventfd that wakes Wait is handed
// to peers over the connection's unix socket.
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

// notify wakes a waiter if the queue is armed. The completion must be
// published before this runs; ReqNotify stores armed before the caller's
// final Poll, so with both sides using sequentially consistent atomics a
// completion is either seen by that Poll or finds the queue armed.
func (h cqHeader) notify(efd int) {
	if atomic.CompareAndSwapUint32(word32(h, cqArmed), 1, 0) {
		var one = [8]byte{1}
		unix.Write(efd, one[:])
	}
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
	cap   int
	seg   *segment
	hdr   cqHeader
	rfile *os.File // nonblocking eventfd in the netpoller, for Wait
	wfd   int      // a dup of the eventfd for notifying and for peers

	mu      sync.Mutex
	local   []cqe
	rings   []*qp       // QPs whose receive completions land here
	users   map[*qp]int // QPs using this CQ, as send and/or receive CQ
	rr      int         // round-robin start over rings
	closed  bool
	ovfSeen bool
}

func newCQ(entries int) (*cq, error) {
	seg, err := newSegment("rdmagrpc-shm-cq", cqHdrSize)
	if err != nil {
		return nil, fmt.Errorf("shm: create CQ: %w", err)
	}
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		seg.close()
		return nil, fmt.Errorf("shm: create CQ: eventfd: %w", err)
	}
	wfd, err := unix.FcntlInt(uintptr(efd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		unix.Close(efd)
		seg.close()
		return nil, fmt.Errorf("shm: create CQ: dup eventfd: %w", err)
	}
	// A nonblocking fd given to os.NewFile is registered with the
	// netpoller, so Wait parks a goroutine, not a thread.
	return &cq{
		cap:   entries,
		seg:   seg,
		hdr:   cqHeader(seg.mem),
		rfile: os.NewFile(uintptr(efd), "shm-cq-eventfd"),
		wfd:   wfd,
		users: map[*qp]int{},
	}, nil
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
	c.hdr.notify(c.wfd)
}

// wake notifies an armed waiter that completions (flushes, computed at
// Poll time) became available.
func (c *cq) wake() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.closed {
		c.hdr.notify(c.wfd)
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
	for q := range c.users {
		q.ring.setErr()
		q.kick()
	}
	c.hdr.notify(c.wfd)
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
	var buf [8]byte
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := c.rfile.SetReadDeadline(time.Time{}); err != nil {
			return c.waitErr(err)
		}
		stop := context.AfterFunc(ctx, func() { c.rfile.SetReadDeadline(aLongTimeAgo) })
		_, err := c.rfile.Read(buf[:])
		stop()
		if err == nil {
			return nil
		}
		// A deadline from an earlier Wait's cancelled context can land
		// here; only our own ctx ends the wait.
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		return c.waitErr(err)
	}
}

func (c *cq) waitErr(err error) error {
	if errors.Is(err, os.ErrClosed) {
		return fmt.Errorf("shm: CQ wait: %w", net.ErrClosed)
	}
	return fmt.Errorf("shm: CQ wait: %w", err)
}

// dupFDs returns dups of the header and eventfd for a peer.
func (c *cq) dupFDs() (hdr, efd int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return -1, -1, fmt.Errorf("shm: CQ closed: %w", net.ErrClosed)
	}
	if hdr, err = c.seg.dupFD(); err != nil {
		return -1, -1, fmt.Errorf("shm: dup CQ header for peer: %w", err)
	}
	if efd, err = dupFD(c.wfd); err != nil {
		unix.Close(hdr)
		return -1, -1, fmt.Errorf("shm: dup CQ eventfd for peer: %w", err)
	}
	return hdr, efd, nil
}

func (c *cq) attach(q *qp, recv bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.users[q]++
	if recv {
		c.rings = append(c.rings, q)
	}
}

func (c *cq) detach(q *qp, recv bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if recv {
		for i, r := range c.rings {
			if r == q {
				c.rings = append(c.rings[:i], c.rings[i+1:]...)
				break
			}
		}
	}
	if c.users[q]--; c.users[q] <= 0 {
		delete(c.users, q)
	}
	c.releaseLocked()
}

// releaseLocked frees the shared header once the queue is closed and no
// QP can still add to it.
func (c *cq) releaseLocked() {
	if c.closed && len(c.users) == 0 && c.seg != nil {
		c.seg.close()
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
	err := errors.Join(c.rfile.Close(), unix.Close(c.wfd))
	c.releaseLocked()
	if err != nil {
		return fmt.Errorf("shm: close CQ: %w", err)
	}
	return nil
}
