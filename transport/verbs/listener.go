package verbs

// #include "shim.h"
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/internal/logx"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// backlog is both rdma_listen's backlog and the number of requests
// queued for Accept; requests beyond it are rejected.
const backlog = 128

type listener struct {
	dev    *device
	handle uint64
	id     *C.struct_rdma_cm_id
	addr   net.Addr
	reqs   chan *connReq

	mu     sync.Mutex
	closed bool
	done   chan struct{}
}

func newListener(d *device, addr string) (*listener, error) {
	ap, err := resolveHostPort(context.Background(), addr, true)
	if err != nil {
		return nil, err
	}
	sa, err := toShimAddr(ap)
	if err != nil {
		return nil, err
	}
	l := &listener{dev: d, reqs: make(chan *connReq, backlog), done: make(chan struct{})}
	id, h, err := d.cm.createID(l)
	if err != nil {
		return nil, err
	}
	l.id, l.handle = id, h
	if rc := C.shim_bind_listen(id, &sa, backlog); rc != 0 {
		d.cm.unregister(h)
		C.shim_rdma_destroy_id(id)
		return nil, fmt.Errorf("verbs: listen %s: %w%s", addr, opErr("rdma_bind_addr/rdma_listen", rc), gidHint(sysfsRoot, ap.Addr()))
	}
	var a C.struct_shim_addr
	C.shim_local_addr(id, &a)
	l.addr = fromShimAddr(&a)
	return l, nil
}

func (l *listener) Addr() net.Addr { return l.addr }

// onEvent: a listening id gets no event but CONNECT_REQUEST (routed to
// request) in normal operation; others (DEVICE_REMOVAL) are ignored.
func (l *listener) onEvent(cmEvent) {}

// request runs on the dispatcher goroutine for each CONNECT_REQUEST.
func (l *listener) request(ev cmEvent) {
	// A wildcard listener (or one on another device's address) hears
	// requests that arrive through any device: the connection lives on
	// that one, its events on that device's channel.
	dev, err := l.dev.sibling(C.shim_id_verbs(ev.id))
	if err == nil && dev != l.dev {
		if rc, merr := C.shim_rdma_migrate_id(ev.id, dev.cm.ch); rc != 0 {
			err = fmt.Errorf("rdma_migrate_id: %w", errnoNow(merr))
		}
	}
	if err != nil {
		logx.L().Warn("rdmagrpc verbs: refusing a connection request", "listener", l.addr.String(), "err", err)
		C.shim_rdma_reject(ev.id, nil, 0)
		C.shim_rdma_destroy_id(ev.id)
		return
	}
	q := newQPEndpoint(dev)
	q.id = ev.id
	q.handle = newHandle()
	dev.cm.register(q.handle, q)
	C.shim_set_id_handle(ev.id, C.uint64_t(q.handle))
	var a C.struct_shim_addr
	C.shim_peer_addr(ev.id, &a)
	r := &connReq{q: q, private: ev.private, remote: fromShimAddr(&a)}

	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closed {
		select {
		case l.reqs <- r:
			return
		default: // backlog full
		}
	}
	r.refuse(nil)
}

func (l *listener) Accept(ctx context.Context) (transport.ConnRequest, error) {
	select {
	case r := <-l.reqs:
		return r, nil
	case <-l.done:
		return nil, net.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *listener) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.done)
	l.mu.Unlock()
	l.dev.cm.unregister(l.handle)
	var err error
	if rc, cerr := C.shim_rdma_destroy_id(l.id); rc != 0 {
		err = fmt.Errorf("verbs: rdma_destroy_id(listener): %w", errnoNow(cerr))
	}
	// Requests nobody accepted are refused now, not left to time out.
	for {
		select {
		case r := <-l.reqs:
			r.refuse(nil)
		default:
			return err
		}
	}
}

// connReq is a pending incoming connection; its qp endpoint already
// receives the id's events.
type connReq struct {
	q       *qp
	private []byte
	remote  net.Addr
	used    atomic.Bool
}

func (r *connReq) PeerPrivate() []byte { return r.private }

// Device implements transport.RequestDevice: the device the request came
// through, where the connection's resources must be.
func (r *connReq) Device() transport.Device { return r.q.dev }
func (r *connReq) RemoteAddr() net.Addr     { return r.remote }

var errReqUsed = errors.New("verbs: connection request already accepted or rejected")

func (r *connReq) Reject(private []byte) error {
	if len(private) > transport.MaxPrivateData {
		return fmt.Errorf("verbs: %d bytes of reject private data, limit is %d", len(private), transport.MaxPrivateData)
	}
	if !r.used.CompareAndSwap(false, true) {
		return errReqUsed
	}
	return r.refuse(private)
}

// refuse rejects and destroys the id (also used for requests nobody will
// accept).
func (r *connReq) refuse(private []byte) error {
	var pp unsafe.Pointer
	if len(private) > 0 {
		pp = unsafe.Pointer(&private[0])
	}
	var err error
	if rc, cerr := C.shim_rdma_reject(r.q.id, pp, C.uint8_t(len(private))); rc != 0 {
		err = fmt.Errorf("verbs: rdma_reject: %w", errnoNow(cerr))
	}
	r.q.destroy()
	return err
}

func (r *connReq) Accept(ctx context.Context, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	if len(private) > transport.MaxPrivateData {
		return nil, fmt.Errorf("verbs: %d bytes of accept private data, limit is %d", len(private), transport.MaxPrivateData)
	}
	if !r.used.CompareAndSwap(false, true) {
		return nil, errReqUsed
	}
	q := r.q
	if err := q.passiveSetup(ctx, cfg, private); err != nil {
		if q.qp == nil {
			// Refused before we answered: tell the peer at once.
			C.shim_rdma_reject(q.id, nil, 0)
		}
		q.destroy()
		return nil, fmt.Errorf("verbs: accept from %v: %w", r.remote, err)
	}
	q.peerPrivate = r.private
	return q, nil
}

func (q *qp) passiveSetup(ctx context.Context, cfg transport.QPConfig, private []byte) error {
	if err := q.createQP(cfg); err != nil {
		return err
	}
	// Ready to receive before the peer learns our QP number, and to send
	// before it sees ESTABLISHED (it may send at once).
	if err := q.toRTR(); err != nil {
		return err
	}
	if err := q.moveTo(C.IBV_QPS_RTS); err != nil {
		return err
	}
	var pp unsafe.Pointer
	if len(private) > 0 {
		pp = unsafe.Pointer(&private[0])
	}
	if rc := C.shim_accept(q.id, C.uint32_t(q.num), pp, C.uint8_t(len(private)),
		C.uint8_t(q.dev.initDepth), C.uint8_t(q.dev.respRes), q.cfgC.rnr_retry); rc != 0 {
		return opErr("rdma_accept", rc)
	}
	ev, err := q.awaitEvent(ctx)
	if err != nil {
		return err
	}
	if ev.kind != C.RDMA_CM_EVENT_ESTABLISHED {
		return fmt.Errorf("connection not established: %v", ev)
	}
	q.established()
	return nil
}
