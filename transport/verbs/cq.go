package verbs

// #include "shim.h"
import "C"

import (
	"context"
	"fmt"
	"net"
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

type cq struct {
	dev    *device
	handle uint64
	ch     *C.struct_ibv_comp_channel
	cq     *C.struct_ibv_cq
	poll   *pollFD
	cap    int

	overflow atomic.Bool
	// waitSem serialises Wait: the poller deadline belongs to the file
	// and a notification wakes one waiter, as in verbs. unacked is
	// guarded by it.
	waitSem chan struct{}
	unacked uint32
	closing chan struct{}

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
	ch, err := C.ibv_create_comp_channel(d.ctx)
	if ch == nil {
		return nil, fmt.Errorf("verbs: ibv_create_comp_channel: %w", errnoNow(err))
	}
	h := newHandle()
	q, err := C.shim_create_cq(d.ctx, C.int(entries), ch, C.uint64_t(h))
	if q == nil {
		C.ibv_destroy_comp_channel(ch)
		return nil, fmt.Errorf("verbs: ibv_create_cq(%d): %w", entries, errnoNow(err))
	}
	p, err := newPollFD(C.shim_comp_channel_fd(ch), "ibv_comp_channel")
	if err != nil {
		C.ibv_destroy_cq(q)
		C.ibv_destroy_comp_channel(ch)
		return nil, err
	}
	c := &cq{dev: d, handle: h, ch: ch, cq: q, poll: p, cap: int(C.shim_cq_cqe(q)),
		waitSem: make(chan struct{}, 1), closing: make(chan struct{})}
	cqMu.Lock()
	cqs[h] = c
	cqMu.Unlock()
	return c, nil
}

func (c *cq) Cap() int { return c.cap }

func (c *cq) Poll(wc []transport.WorkCompletion) (int, error) {
	if len(wc) == 0 {
		return 0, nil
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return 0, fmt.Errorf("verbs: Poll on closed CQ: %w", net.ErrClosed)
	}
	if c.overflow.Load() {
		return 0, transport.ErrCQOverflow
	}
	n := C.shim_poll_cq(c.cq, (*C.struct_shim_wc)(unsafe.Pointer(&wc[0])), C.int(len(wc)))
	if n < 0 {
		return 0, opErr("ibv_poll_cq", n)
	}
	return int(n), nil
}

func (c *cq) ReqNotify() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return fmt.Errorf("verbs: ReqNotify on closed CQ: %w", net.ErrClosed)
	}
	return opErr("ibv_req_notify_cq", C.shim_req_notify_cq(c.cq))
}

// What the poll callback returns when Close or an async CQ error wakes
// the waiter instead of a completion event.
const (
	cqOverflowed = -1
	cqClosing    = -2
)

func (c *cq) Wait(ctx context.Context) error {
	select {
	case c.waitSem <- struct{}{}:
	case <-c.closing:
		return fmt.Errorf("verbs: Wait on closed CQ: %w", net.ErrClosed)
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-c.waitSem }()
	select {
	case <-c.closing:
		return fmt.Errorf("verbs: Wait on closed CQ: %w", net.ErrClosed)
	default:
	}
	rc, err := c.poll.readCtx(ctx, func() C.int {
		select {
		case <-c.closing:
			return cqClosing
		default:
		}
		if c.overflow.Load() {
			return cqOverflowed
		}
		return C.shim_get_cq_event(c.ch)
	})
	if err != nil {
		select {
		case <-c.closing:
			return fmt.Errorf("verbs: Wait on closed CQ: %w", net.ErrClosed)
		default:
		}
		return err
	}
	switch rc {
	case 0:
		c.unacked++
		if c.unacked >= ackBatch {
			C.shim_ack_cq_events(c.cq, C.uint(c.unacked))
			c.unacked = 0
		}
		return nil
	case cqOverflowed:
		return nil // Poll reports ErrCQOverflow
	case cqClosing:
		return fmt.Errorf("verbs: Wait on closed CQ: %w", net.ErrClosed)
	}
	return opErr("ibv_get_cq_event", rc)
}

// kick wakes a blocked Wait so that it re-checks the CQ's flags.
func (c *cq) kick() { c.poll.f.SetReadDeadline(aLongTimeAgo) }

// Close destroys the CQ. QPs using it must be closed first: otherwise
// verbs refuses (EBUSY), Close returns the error, Poll still works and
// Wait reports the CQ closed.
func (c *cq) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	// Wake and exclude waiters before touching the channel.
	select {
	case <-c.closing:
	default:
		close(c.closing)
	}
	c.kick()
	c.waitSem <- struct{}{}
	defer func() { <-c.waitSem }()
	if c.unacked > 0 {
		C.shim_ack_cq_events(c.cq, C.uint(c.unacked))
		c.unacked = 0
	}
	if rc := C.ibv_destroy_cq(c.cq); rc != 0 {
		return fmt.Errorf("verbs: CQ still in use by a QP: %w", opErr("ibv_destroy_cq", rc))
	}
	c.closed = true
	cqMu.Lock()
	delete(cqs, c.handle)
	cqMu.Unlock()
	c.poll.close()
	if rc := C.ibv_destroy_comp_channel(c.ch); rc != 0 {
		return opErr("ibv_destroy_comp_channel", rc)
	}
	return nil
}
