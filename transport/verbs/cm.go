package verbs

// #include "shim.h"
import "C"

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

var errInterrupted = syscall.EINTR

// handles name rdma_cm ids and CQs in the C context fields. They are
// never reused, so an event read just before an id was destroyed cannot
// reach the id that replaced it at the same address.
var lastHandle atomic.Uint64

func newHandle() uint64 { return lastHandle.Add(1) }

// cmEvent is an rdma_cm event, already acknowledged to librdmacm.
type cmEvent struct {
	kind    C.int // RDMA_CM_EVENT_*
	status  int
	id      *C.struct_rdma_cm_id
	private []byte
}

func (e cmEvent) String() string {
	return fmt.Sprintf("%s (status %d)", C.GoString(C.shim_rdma_event_str(C.int(e.kind))), e.status)
}

// endpoint receives the events of one rdma_cm id. onEvent runs on the
// dispatcher goroutine and must not block. Close is what Device.Close
// calls on endpoints still open.
type endpoint interface {
	onEvent(ev cmEvent)
	Close() error
}

// cmChannel is a device's rdma_cm event channel and the goroutine that
// serves it.
type cmChannel struct {
	ch   *C.struct_rdma_event_channel
	poll *pollFD
	done chan struct{} // closed when serve returns

	mu  sync.Mutex
	eps map[uint64]endpoint

	// tos is the traffic class set on every id (TrafficClassEnv); -1:
	// rdma_cm's default.
	tos int
}

func newCMChannel() (*cmChannel, error) {
	ch, err := C.shim_rdma_create_event_channel()
	if ch == nil {
		return nil, unusable("rdma_create_event_channel: %v (no rdma_cm: is rdma_ucm loaded?)", errnoNow(err))
	}
	p, err := newPollFD(C.shim_cm_channel_fd(ch), "rdma_cm")
	if err != nil {
		C.shim_rdma_destroy_event_channel(ch)
		return nil, err
	}
	c := &cmChannel{ch: ch, poll: p, done: make(chan struct{}), eps: map[uint64]endpoint{}, tos: -1}
	go c.serve()
	return c, nil
}

// createID creates an rdma_cm id on this channel, routed to ep.
func (c *cmChannel) createID(ep endpoint) (*C.struct_rdma_cm_id, uint64, error) {
	h := newHandle()
	c.register(h, ep)
	var id *C.struct_rdma_cm_id
	if rc := C.shim_create_id(c.ch, &id, C.uint64_t(h)); rc != 0 {
		c.unregister(h)
		return nil, 0, opErr("rdma_create_id", rc)
	}
	if c.tos >= 0 {
		if rc := C.shim_set_tos(id, C.uint8_t(c.tos)); rc != 0 {
			C.shim_rdma_destroy_id(id)
			c.unregister(h)
			return nil, 0, opErr("rdma_set_option(RDMA_OPTION_ID_TOS)", rc)
		}
	}
	return id, h, nil
}

func (c *cmChannel) register(h uint64, ep endpoint) {
	c.mu.Lock()
	c.eps[h] = ep
	c.mu.Unlock()
}

func (c *cmChannel) unregister(h uint64) {
	c.mu.Lock()
	delete(c.eps, h)
	c.mu.Unlock()
}

func (c *cmChannel) lookup(h uint64) endpoint {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.eps[h]
}

func (c *cmChannel) endpoints() []endpoint {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]endpoint, 0, len(c.eps))
	for _, ep := range c.eps {
		out = append(out, ep)
	}
	return out
}

// serve reads events until the channel is closed. librdmacm's
// rdma_get_cm_event returns EAGAIN on the non-blocking fd, and the
// goroutine then sleeps in the netpoller.
func (c *cmChannel) serve() {
	defer close(c.done)
	var ev C.struct_shim_event
	c.poll.serve("rdma_get_cm_event", func() C.int { return C.shim_get_cm_event(c.ch, &ev) }, func() { c.dispatch(&ev) })
}

func (c *cmChannel) dispatch(ev *C.struct_shim_event) {
	e := cmEvent{
		kind:   C.int(ev.event),
		status: int(ev.status),
		id:     ev.id,
	}
	if ev.private_len > 0 {
		e.private = C.GoBytes(unsafe.Pointer(&ev.private_data[0]), C.int(ev.private_len))
	}
	if e.kind == C.RDMA_CM_EVENT_CONNECT_REQUEST {
		if ep, ok := c.lookup(uint64(ev.listen_handle)).(*listener); ok {
			ep.request(e)
			return
		}
		// The listener was closed while this request was queued.
		C.shim_rdma_reject(e.id, nil, 0)
		C.shim_rdma_destroy_id(e.id)
		return
	}
	if ep := c.lookup(uint64(ev.handle)); ep != nil {
		ep.onEvent(e)
	}
}

// close stops the goroutine and destroys the channel. Every id on it must
// have been destroyed.
func (c *cmChannel) close() error {
	err := c.poll.close()
	<-c.done
	C.shim_rdma_destroy_event_channel(c.ch)
	return err
}
