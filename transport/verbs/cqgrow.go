package verbs

// #include "shim.h"
import "C"

import (
	"fmt"
	"slices"
	"sync"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A CQ is sized by its consumer for the busiest phase of its connection
// (conn asks for room for every receive and send of its deepest rings),
// but an idle connection has a few receives posted and nothing in
// flight, and the device's queue is memory mapped into the process and
// resident from creation (rxe maps all of it; a NIC's driver pins it).
// So where the device resizes CQs, a CQ starts at initialCQE entries and
// grows to the size asked for, once, before a post could bring more
// completions than the device queue holds: the consumer's contract
// (never more outstanding than Cap) is kept without the memory.
//
// What may still arrive is counted exactly: every posted receive
// completes once; sends complete in order on an RC send queue, so a
// successful signaled send retires itself and every unsignaled one
// posted before it. Error completions retire nothing (their opcode is
// undefined): the count only errs upwards, which at worst grows a queue
// early.

// cqAcct counts, while the CQ's device queue is small, the completions
// that may still arrive on it.
type cqAcct struct {
	mu  sync.Mutex
	out int
	// The QPs whose send CQ this is: one, for a connection's CQ (a
	// slice, not a map: a map of one costs every connection 200 bytes).
	sends []*sendAcct
}

// send is QP num's account, or nil.
func (a *cqAcct) send(num uint32) *sendAcct {
	for _, s := range a.sends {
		if s.num == num {
			return s
		}
	}
	return nil
}

// sendAcct is one QP's send queue as its send CQ counts it: WRs posted
// and retired, and the positions of the signaled WRs not yet completed,
// oldest first.
type sendAcct struct {
	num             uint32
	posted, retired uint64
	signaled        []uint64
	head            int
}

func (s *sendAcct) push(pos uint64) {
	if s.head > 0 && s.head == len(s.signaled) {
		s.signaled, s.head = s.signaled[:0], 0
	}
	s.signaled = append(s.signaled, pos)
}

// attachSend makes c count q's sends.
func (c *cq) attachSend(num uint32) {
	if c.grown.Load() {
		return
	}
	c.acct.mu.Lock()
	defer c.acct.mu.Unlock()
	c.acct.sends = append(c.acct.sends, &sendAcct{num: num})
}

// detachSend forgets a destroyed QP's sends; what it left outstanding
// stays counted (its completions may still be polled).
func (c *cq) detachSend(num uint32) {
	c.acct.mu.Lock()
	c.acct.sends = slices.DeleteFunc(c.acct.sends, func(s *sendAcct) bool { return s.num == num })
	c.acct.mu.Unlock()
}

// reserveLocked makes room for n more completions: the device queue
// grows to its full size if the count would pass what it holds. It
// returns false once the queue has its full size (nothing to count).
// The caller holds c.acct.mu and c.mu's read side.
func (c *cq) reserveLocked(n int) (bool, error) {
	if c.grown.Load() {
		return false, nil
	}
	if c.acct.out+n <= c.cap {
		c.acct.out += n
		return true, nil
	}
	if c.sh != nil {
		// A view keeps counting: its allotment of the shared CQ must
		// cover what may complete, the consumer's Cap and beyond.
		if err := c.sh.growView(c, max(c.want, c.acct.out+n)); err != nil {
			return false, err
		}
		c.acct.out += n
		return true, nil
	}
	return false, c.growLocked()
}

// growLocked resizes the device queue to the size asked for. The caller
// holds c.acct.mu and c.mu's read side: libibverbs orders the resize
// against polling itself.
func (c *cq) growLocked() error {
	if c.grown.Load() {
		return nil
	}
	if c.closed {
		return fmt.Errorf("verbs: CQ closed: %w", transport.ErrQPState)
	}
	if rc := C.shim_resize_cq(c.cq, C.int(c.want)); rc != 0 {
		return fmt.Errorf("verbs: growing CQ from %d to %d entries: %w", c.cap, c.want, opErr("ibv_resize_cq", rc))
	}
	c.cap = int(C.shim_cq_cqe(c.cq))
	c.acct.sends = nil
	c.grown.Store(true)
	return nil
}

// polled retires what wc completed.
func (c *cq) polled(wc []transport.WorkCompletion) {
	c.acct.mu.Lock()
	defer c.acct.mu.Unlock()
	if c.grown.Load() {
		return
	}
	for i := range wc {
		w := &wc[i]
		if w.Status != transport.StatusSuccess {
			continue
		}
		switch w.Opcode {
		case transport.WCRecv, transport.WCRecvRDMAWithImm:
			c.acct.out--
		default:
			s := c.acct.send(w.QPNum)
			if s == nil || s.head == len(s.signaled) {
				continue
			}
			pos := s.signaled[s.head]
			s.head++
			c.acct.out -= int(pos - s.retired)
			s.retired = pos
		}
	}
}

// sendBegin reserves room on q's send CQ for n sends; counting reports
// whether sendEnd must be called with what was posted. The caller holds
// q.mu's read side.
func (q *qp) sendBegin(n int) (counting bool, err error) { return q.scq.begin(n) }

// begin reserves room on c for n completions; counting: c stays locked
// (its read side and its account) until the matching End.
func (c *cq) begin(n int) (counting bool, err error) {
	if c == nil || c.grown.Load() {
		return false, nil
	}
	c.mu.RLock()
	c.acct.mu.Lock()
	counting, err = c.reserveLocked(n)
	if !counting {
		c.acct.mu.Unlock()
		c.mu.RUnlock()
	}
	return counting, err
}

// sendEnd records the sends posted of those reserved by sendBegin (held
// until now, so that Poll retires none it does not know of).
func (q *qp) sendEnd(reserved int, wrs []C.struct_shim_send, posted int) {
	c := q.scq
	c.acct.out -= reserved - posted
	if s := c.acct.send(q.num); s != nil {
		for i := range wrs[:posted] {
			s.posted++
			if wrs[i].flags&C.SHIM_F_SIGNALED != 0 {
				s.push(s.posted)
			}
		}
	}
	c.acct.mu.Unlock()
	c.mu.RUnlock()
}

// recvBegin and recvEnd are sendBegin and sendEnd for receives.
func (q *qp) recvBegin(n int) (counting bool, err error) { return q.rcq.begin(n) }

func (q *qp) recvEnd(reserved, posted int) {
	c := q.rcq
	c.acct.out -= reserved - posted
	c.acct.mu.Unlock()
	c.mu.RUnlock()
}
