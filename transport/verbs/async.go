package verbs

// #include "shim.h"
import "C"

import (
	"errors"
	"log"
	"sync"
)

// asyncReader reads the async events of one verbs context (shared by every
// Device opened on it: rdma_cm hands out one context per device per
// process). Its only job today is CQ overflow: IBV_EVENT_CQ_ERR marks the
// CQ so that Poll reports ErrCQOverflow.
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
	for {
		rc, err := r.poll.read(func() C.int { return C.shim_get_async_event(r.ctx, &ev) })
		if err != nil {
			return
		}
		if rc != 0 {
			if errors.Is(errnoErr(rc), errInterrupted) {
				continue
			}
			log.Printf("verbs: ibv_get_async_event: %v; async event loop stops", errnoErr(rc))
			return
		}
		if ev.event == C.IBV_EVENT_CQ_ERR {
			cqMu.Lock()
			c := cqs[uint64(ev.cq_handle)]
			cqMu.Unlock()
			if c != nil {
				c.overflow.Store(true)
				c.kick()
			}
		}
	}
}
