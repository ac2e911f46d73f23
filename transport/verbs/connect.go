package verbs

// #include "shim.h"
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// IB CM reject reasons (IBTA vol. 1, table 112) that rdma_cm reports as
// the status of RDMA_CM_EVENT_REJECTED.
const (
	rejInvalidServiceID = 8  // nothing listens on that port
	rejConsumerDefined  = 28 // rdma_reject by the peer application
)

// resolveTimeout bounds address and route resolution when ctx has no
// earlier deadline (rdma_cm needs a number of milliseconds).
const resolveTimeout = 5 * time.Second

func connect(ctx context.Context, d *device, addr string, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	if len(private) > transport.MaxPrivateData {
		return nil, fmt.Errorf("verbs: %d bytes of private data, limit is %d", len(private), transport.MaxPrivateData)
	}
	dst, err := resolveHostPort(ctx, addr, false)
	if err != nil {
		return nil, err
	}
	q := newQPEndpoint(d)
	id, h, err := d.cm.createID(q)
	if err != nil {
		return nil, err
	}
	q.id, q.handle = id, h
	if err := q.activeSetup(ctx, addr, dst, cfg, private); err != nil {
		q.destroy()
		return nil, err
	}
	return q, nil
}

func (q *qp) activeSetup(ctx context.Context, addr string, dst netip.AddrPort, cfg transport.QPConfig, private []byte) error {
	q.stepAt = time.Now()
	ms := timeoutMS(ctx)
	sa, err := toShimAddr(dst)
	if err != nil {
		return err
	}
	if rc := C.shim_resolve_addr(q.id, &sa, ms); rc != 0 {
		return fmt.Errorf("verbs: connect %s: %w", addr, opErr("rdma_resolve_addr", rc))
	}
	if err := q.expect(ctx, addr, C.RDMA_CM_EVENT_ADDR_RESOLVED); err != nil {
		return err
	}
	q.step(stepAddr)
	if rc, err := C.shim_rdma_resolve_route(q.id, ms); rc != 0 {
		return fmt.Errorf("verbs: connect %s: rdma_resolve_route: %w", addr, errnoNow(err))
	}
	if err := q.expect(ctx, addr, C.RDMA_CM_EVENT_ROUTE_RESOLVED); err != nil {
		return err
	}
	q.step(stepRoute)
	if err := q.createQP(cfg); err != nil {
		return fmt.Errorf("verbs: connect %s: %w", addr, err)
	}
	q.step(stepCreate)
	var pp unsafe.Pointer
	if len(private) > 0 {
		pp = unsafe.Pointer(&private[0]) // copied by librdmacm during the call
	}
	if rc := C.shim_connect(q.id, C.uint32_t(q.num), pp, C.uint8_t(len(private)),
		C.uint8_t(q.dev.initDepth), C.uint8_t(q.dev.respRes), q.cfgC.retry_cnt, q.cfgC.rnr_retry); rc != 0 {
		return fmt.Errorf("verbs: connect %s: %w", addr, opErr("rdma_connect", rc))
	}
	ev, err := q.awaitEvent(ctx)
	if err != nil {
		return fmt.Errorf("verbs: connect %s: %w", addr, err)
	}
	switch ev.kind {
	case C.RDMA_CM_EVENT_CONNECT_RESPONSE:
	case C.RDMA_CM_EVENT_REJECTED:
		switch ev.status {
		case rejConsumerDefined:
			return &transport.RejectError{Addr: addr, Private: ev.private}
		case rejInvalidServiceID:
			return fmt.Errorf("verbs: connect %s: nothing listens there (CM reject reason %d): %w",
				addr, ev.status, transport.ErrConnRefused)
		}
		return fmt.Errorf("verbs: connect %s: rejected by the CM with reason %d: %w",
			addr, ev.status, transport.ErrConnRefused)
	default:
		return fmt.Errorf("verbs: connect %s: %v", addr, ev)
	}
	q.peerPrivate = ev.private
	q.step(stepConnect)
	if err := q.toRTR(); err != nil {
		return err
	}
	if err := q.moveTo(C.IBV_QPS_RTS); err != nil {
		return err
	}
	if rc, err := C.shim_rdma_establish(q.id); rc != 0 {
		return fmt.Errorf("verbs: connect %s: rdma_establish: %w", addr, errnoNow(err))
	}
	q.step(stepReady)
	q.established()
	return nil
}

// The steps of a dial that SetupSteps reports.
const (
	stepAddr    = iota // rdma_resolve_addr to ADDR_RESOLVED
	stepRoute          // rdma_resolve_route to ROUTE_RESOLVED
	stepCreate         // ibv_create_qp and the move to INIT
	stepConnect        // rdma_connect to CONNECT_RESPONSE: the CM's REQ and REP, the listener's accept between them
	stepReady          // RTR, RTS and rdma_establish (the CM's RTU)
	nSteps
)

var stepNames = [nSteps]string{"resolve address", "resolve route", "create QP", "CM request to reply", "RTR, RTS, establish"}

// step ends the set-up step s.
func (q *qp) step(s int) {
	now := time.Now()
	q.steps[s] = now.Sub(q.stepAt)
	q.stepAt = now
}

// SetupSteps implements transport.SetupTimer: nil on the listening side,
// whose set-up is the answer to the dialer's.
func (q *qp) SetupSteps() []transport.SetupStep {
	if q.steps[nSteps-1] == 0 {
		return nil
	}
	out := make([]transport.SetupStep, nSteps)
	for i := range out {
		out[i] = transport.SetupStep{Name: stepNames[i], Took: q.steps[i]}
	}
	return out
}

// timeoutMS is the resolution time-out rdma_cm takes: ctx's deadline, at
// most resolveTimeout.
func timeoutMS(ctx context.Context) C.int {
	ms := C.int(resolveTimeout / time.Millisecond)
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < resolveTimeout {
			ms = C.int(max(left/time.Millisecond, 1))
		}
	}
	return ms
}

// expect waits for one set-up event and turns any other into an error.
func (q *qp) expect(ctx context.Context, addr string, want C.int) error {
	ev, err := q.awaitEvent(ctx)
	if err != nil {
		return fmt.Errorf("verbs: connect %s: %w", addr, err)
	}
	if ev.kind != want {
		var cause error = syscall.Errno(-ev.status)
		if ev.status >= 0 {
			cause = errors.New("no errno")
		}
		return fmt.Errorf("verbs: connect %s: %v: %w", addr, ev, cause)
	}
	return nil
}
