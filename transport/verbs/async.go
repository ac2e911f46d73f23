package verbs

// #include "shim.h"
import "C"

import (
	"sync"
)

// asyncReader reads the async events of one verbs context (shared by every
// Device opened on it: rdma_cm hands out one context per device per
// process). IBV_EVENT_CQ_ERR marks the CQ so that Poll reports
// ErrCQOverflow; a QP's asynchronous error flushes the receives of its
// shared queue (srq.go).
type asyncReader struct {
	ctx  *C.struct_ibv_context
	poll *pollFD
	done chan struct{}
	refs int // guarded by asyncMu
}

var (
	asyncMu      sync.Mutex
	asyncReaders = map[*C.struct_ibv_context]*asyncReader{}

	cqMu sync.Mutex
	cqs  = map[uint64]*cq{} // by handle, for async events
)

func acquireAsync(ctx *C.struct_ibv_context) (*asyncReader, error) {
	asyncMu.Lock()
	defer asyncMu.Unlock()
	if r := asyncReaders[ctx]; r != nil {
		r.refs++
		return r, nil
	}
	p, err := newPollFD(C.shim_async_fd(ctx), "ibv_async")
	if err != nil {
		return nil, err
	}
	r := &asyncReader{ctx: ctx, poll: p, done: make(chan struct{}), refs: 1}
	asyncReaders[ctx] = r
	go r.serve()
	return r, nil
}

func (r *asyncReader) release() {
	asyncMu.Lock()
	r.refs--
	last := r.refs == 0
	if last {
		delete(asyncReaders, r.ctx)
	}
	asyncMu.Unlock()
	if last {
		r.poll.close()
		<-r.done
	}
}

func (r *asyncReader) serve() {
	defer close(r.done)
	var ev C.struct_shim_async
	r.poll.serve("ibv_get_async_event", func() C.int { return C.shim_get_async_event(r.ctx, &ev) }, func() {
		switch ev.event {
		case C.IBV_EVENT_QP_FATAL, C.IBV_EVENT_QP_REQ_ERR, C.IBV_EVENT_QP_ACCESS_ERR:
			asyncQPFailed(r.ctx, uint32(ev.qp_num))
			return
		case C.IBV_EVENT_SRQ_LIMIT_REACHED:
			poolLow(uint64(ev.srq_handle))
			return
		case C.IBV_EVENT_CQ_ERR:
		default:
			return
		}
		cqMu.Lock()
		c := cqs[uint64(ev.cq_handle)]
		s := sharedCQs[uint64(ev.cq_handle)]
		cqMu.Unlock()
		if s != nil {
			s.kickAll()
		}
		if c != nil {
			c.overflow.Store(true)
			c.kick()
		}
	})
}
