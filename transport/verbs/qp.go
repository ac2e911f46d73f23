package verbs

// #include "shim.h"
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// qp is an RC queue pair with its rdma_cm id. It is the id's endpoint
// from creation: during set-up events go to setupEvents, afterwards only
// DISCONNECTED matters.
type qp struct {
	dev    *device
	handle uint64
	id     *C.struct_rdma_cm_id
	qp     *C.struct_ibv_qp
	num    uint32
	attrs  qpAttrs
	cfgC   C.struct_shim_qp_cfg
	// scq and rcq count what posts may complete on them (cqgrow.go).
	scq, rcq *cq
	// hold keeps the send WRs beyond the device queue's depth
	// (sendhold.go); nil when the device holds the depth asked for.
	hold *sendHold
	// rq is the shared receive queue the QP receives through (srq.go);
	// nil when it has a receive queue of its own.
	rq *recvQueue

	local, remote net.Addr
	peerPrivate   []byte

	// The dial's set-up steps (connect.go): when the current one began,
	// and how long each took.
	stepAt time.Time
	steps  [nSteps]time.Duration

	setupEvents chan cmEvent
	disc        chan struct{}
	discOnce    sync.Once

	// postMu guards the scratch arrays the work requests are built in.
	postMu  sync.Mutex
	sendWRs []C.struct_shim_send
	recvWRs []C.struct_shim_recv
	sges    []C.struct_ibv_sge

	// mu orders posting and state changes (read side) against Close.
	mu           sync.RWMutex
	closed       bool
	disconnected bool
}

func newQPEndpoint(d *device) *qp {
	// Set-up waits for one event at a time; a few more (an error
	// racing the step's own event) fit, and the rest are dropped.
	return &qp{dev: d, setupEvents: make(chan cmEvent, 4), disc: make(chan struct{})}
}

// onEvent runs on the dispatcher goroutine.
func (q *qp) onEvent(ev cmEvent) {
	if ev.kind == C.RDMA_CM_EVENT_DISCONNECTED {
		q.mu.RLock()
		if !q.closed && q.qp != nil {
			// The kernel does not touch a QP it did not create: move
			// it to ERROR so outstanding work flushes, as the
			// interface promises.
			C.shim_qp_set_state(q.qp, C.IBV_QPS_ERR)
			q.fail()
		}
		q.mu.RUnlock()
		q.discOnce.Do(func() { close(q.disc) })
		// The flushes land in a CQ that may not be armed: its owner
		// left the polling to a goroutine that is not coming back (a
		// reader that stopped reading), and would see them only at its
		// backstop. A NIC raises no completion event for them then;
		// the disconnect is the event.
		for _, c := range []*cq{q.rcq, q.scq} {
			if c != nil {
				c.signal()
			}
		}
	}
	select {
	case q.setupEvents <- ev:
	default: // nobody is setting up any more; only DISCONNECTED mattered
	}
}

// awaitEvent waits for the next rdma_cm event of the id during set-up.
func (q *qp) awaitEvent(ctx context.Context) (cmEvent, error) {
	select {
	case ev := <-q.setupEvents:
		return ev, nil
	case <-ctx.Done():
		return cmEvent{}, ctx.Err()
	case <-q.dev.cm.done:
		return cmEvent{}, fmt.Errorf("verbs: device %s closed: %w", q.dev.name, net.ErrClosed)
	}
}

// createQP makes the verbs QP for cfg on the id's device and moves it to INIT.
func (q *qp) createQP(cfg transport.QPConfig) error {
	if v := C.shim_id_verbs(q.id); v != q.dev.ctx {
		name := "?"
		if v != nil {
			name = C.GoString(C.shim_dev_name(v))
		}
		return fmt.Errorf("verbs: connection goes through RDMA device %s, not %s (open that device)", name, q.dev.name)
	}
	p, ok := cfg.PD.(*pd)
	if !ok || p.dev.ctx != q.dev.ctx {
		return fmt.Errorf("verbs: QPConfig.PD is not a PD of device %s", q.dev.name)
	}
	scq, ok1 := cfg.SendCQ.(*cq)
	rcq, ok2 := cfg.RecvCQ.(*cq)
	if !ok1 || !ok2 || scq.dev.ctx != q.dev.ctx || rcq.dev.ctx != q.dev.ctx {
		return fmt.Errorf("verbs: QPConfig.SendCQ and RecvCQ must be CQs of device %s", q.dev.name)
	}
	a, err := resolveQPAttrs(cfg, q.dev.attr)
	if err != nil {
		return err
	}
	q.dev.qpEnv.apply(&a)
	depth := a.maxSendWR
	if d := q.dev.qpEnv.sendDepth; d > 0 && d < depth {
		depth = d
	}
	var srq *C.struct_ibv_srq
	if pool := q.dev.recvPoolFor(&a, cfg.RecvImmOnly && rcq.view); pool != nil {
		q.newPooledQueue(pool, &a)
		srq = pool.srq
		if q.dev.qpEnv.rnr < 0 {
			// A burst beyond the pool waits for its receives, as
			// long as it takes (see recvPool).
			a.rnrRetry = 7
		}
	} else if start := q.dev.recvDepthFor(&a, len(cfg.InitialRecvs)); start > 0 {
		// A device out of shared queues (or memory for one) can still
		// give the QP a receive queue of its own: only memory is lost.
		if q.newRecvQueue(p, &a, start) == nil {
			srq = q.rq.srq
		}
	}
	in := C.struct_shim_qp_cfg{
		max_send_wr: C.uint32_t(depth), max_recv_wr: C.uint32_t(a.maxRecvWR),
		max_send_sge: C.uint32_t(a.maxSendSGE), max_recv_sge: C.uint32_t(a.maxRecvSGE),
		max_inline: C.uint32_t(a.maxInline),
		timeout:    C.uint8_t(a.timeout), retry_cnt: C.uint8_t(a.retryCnt),
		rnr_retry: C.uint8_t(a.rnrRetry), min_rnr_timer: C.uint8_t(a.minRNRTimer),
		sl: -1, sgid_index: -1,
	}
	release, err := holdViews(scq, rcq)
	if err != nil {
		q.dropRecvQueue()
		return err
	}
	p.mu.Lock()
	closed := p.closed
	var h *C.struct_ibv_qp
	if !closed {
		h, err = C.shim_create_qp(p.pd, scq.ibv(), rcq.ibv(), srq, &in, &q.cfgC)
	}
	p.mu.Unlock()
	if h != nil {
		bindQPs(scq, rcq, uint32(h.qp_num))
	}
	release()
	if h == nil {
		q.dropRecvQueue()
	}
	if closed {
		return fmt.Errorf("verbs: QPConfig.PD is closed: %w", net.ErrClosed)
	}
	if h == nil {
		return fmt.Errorf("verbs: ibv_create_qp(%+v): %w", cfg, errnoNow(err))
	}
	q.qp = h
	q.num = uint32(h.qp_num)
	q.scq, q.rcq = scq, rcq
	scq.attachSend(q.num)
	// Keep what the device granted: it can round capacities up.
	q.attrs = a
	if q.rq != nil {
		rcq.attachRecvs(q)
		registerRecvQueue(q)
	} else {
		q.attrs.maxRecvWR = int(q.cfgC.max_recv_wr)
		q.attrs.maxRecvSGE = int(q.cfgC.max_recv_sge)
	}
	if granted := int(q.cfgC.max_send_wr); granted < a.maxSendWR {
		q.hold = newSendHold(a.maxSendWR, granted)
		scq.attachHold(q)
	} else {
		q.attrs.maxSendWR = granted
	}
	q.attrs.maxSendSGE = int(q.cfgC.max_send_sge)
	q.attrs.maxInline = int(q.cfgC.max_inline)
	if err := q.moveTo(C.IBV_QPS_INIT); err != nil {
		return err
	}
	// INIT takes receives; the peer cannot send before RTR and the
	// handshake.
	if n, err := q.PostRecv(cfg.InitialRecvs...); err != nil || n < len(cfg.InitialRecvs) {
		return fmt.Errorf("verbs: QP %d: initial receives: %d of %d posted: %w", q.num, n, len(cfg.InitialRecvs), err)
	}
	// The scratch the initial receives were built in is the largest
	// batch most QPs ever post: later posts grow their own.
	q.recvWRs, q.sges = nil, nil
	return nil
}

// toRTR moves the QP to RTR with the environment's path overrides: the
// service level, and the source GID (an index, or the entry of the
// preferred RoCE version for the address rdma_cm chose).
func (q *qp) toRTR() error {
	e := q.dev.qpEnv
	if e.sl >= 0 {
		q.cfgC.sl = C.int16_t(e.sl)
	}
	var p C.struct_shim_path
	if e.gidIndex < 0 && e.roce > 0 || len(q.dev.allowed.entries) > 0 {
		if rc := C.shim_cm_path(q.id, &p); rc != 0 {
			return fmt.Errorf("verbs: QP %d: %w", q.num, opErr("rdma_init_qp_attr", rc))
		}
		if !q.dev.allowed.allows(q.dev.name, int(p.port)) {
			return fmt.Errorf("verbs: the route to %v goes through port %d of %s, which %s=%s does not allow (rdma_cm routes by address: use an address of an allowed device)",
				q.remoteAddrOrNil(), p.port, q.dev.name, DevicesEnv, q.dev.allowed)
		}
	}
	switch {
	case e.gidIndex >= 0:
		q.cfgC.sgid_index = C.int16_t(e.gidIndex)
	case e.roce > 0:
		idx, err := gidOfVersion(sysfsRoot, q.dev.name, int(p.port), int(p.sgid_index), e.roce)
		if err != nil {
			return err
		}
		q.cfgC.sgid_index = C.int16_t(idx)
	}
	return q.moveTo(C.IBV_QPS_RTR)
}

// remoteAddrOrNil is the peer's address as rdma_cm has it, before the
// connection is established.
func (q *qp) remoteAddrOrNil() net.Addr {
	var a C.struct_shim_addr
	C.shim_peer_addr(q.id, &a)
	return fromShimAddr(&a)
}

// Path implements transport.PathQP: the path the QP was programmed with.
func (q *qp) Path() (transport.Path, error) {
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.closed {
		return transport.Path{}, fmt.Errorf("verbs: Path of closed QP: %w", transport.ErrQPState)
	}
	var p C.struct_shim_path
	if rc := C.shim_qp_path(q.qp, &p); rc != 0 {
		return transport.Path{}, fmt.Errorf("verbs: QP %d: %w", q.num, opErr("ibv_query_qp", rc))
	}
	path := transport.Path{
		Port: int(p.port), GIDIndex: int(p.sgid_index), TrafficClass: int(p.traffic_class),
		ServiceLevel: int(p.sl), MTU: mtuBytes(int(p.path_mtu)),
	}
	path.GIDType = gidType(sysfsRoot, q.dev.name, path.Port, path.GIDIndex)
	return path, nil
}

// mtuBytes decodes enum ibv_mtu (1 = 256 ... 5 = 4096); 0 if unknown.
func mtuBytes(m int) int {
	if m < 1 || m > 5 {
		return 0
	}
	return 128 << m
}

func (q *qp) moveTo(state C.int) error {
	if rc := C.shim_qp_to(q.id, q.qp, state, &q.cfgC); rc != 0 {
		return fmt.Errorf("verbs: QP %d to %v: %w", q.num, transport.QPState(state), errnoErr(rc))
	}
	return nil
}

// established records the addresses once the connection is up.
func (q *qp) established() {
	var a C.struct_shim_addr
	C.shim_local_addr(q.id, &a)
	local := fromShimAddr(&a)
	C.shim_peer_addr(q.id, &a)
	remote := fromShimAddr(&a)
	q.mu.Lock()
	q.local, q.remote = local, remote
	q.mu.Unlock()
}

// destroy releases everything of a QP whose set-up failed or that was
// never accepted. It is idempotent.
func (q *qp) destroy() {
	q.dev.cm.unregister(q.handle)
	q.mu.Lock()
	was := q.closed
	q.closed = true
	q.mu.Unlock()
	if was {
		return
	}
	if q.qp != nil {
		C.shim_ibv_destroy_qp(q.qp)
		q.scq.detachSend(q.num)
		q.scq.detachHold(q.num)
		q.destroyRecvQueue()
		unbindQPs(q.scq, q.rcq, q.num)
	}
	if q.id != nil {
		C.shim_rdma_destroy_id(q.id) // refuses a request not yet answered
	}
	q.discOnce.Do(func() { close(q.disc) })
}

func (q *qp) Num() uint32                   { return q.num }
func (q *qp) LocalAddr() net.Addr           { return q.local }
func (q *qp) RemoteAddr() net.Addr          { return q.remote }
func (q *qp) PeerPrivate() []byte           { return q.peerPrivate }
func (q *qp) Disconnected() <-chan struct{} { return q.disc }

func (q *qp) State() transport.QPState {
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.closed {
		return transport.QPSErr
	}
	s := C.shim_qp_state(q.qp)
	if s < 0 {
		return transport.QPSErr
	}
	return transport.QPState(s)
}

func (q *qp) SetError() error {
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.closed {
		return fmt.Errorf("verbs: SetError on closed QP: %w", net.ErrClosed)
	}
	err := opErr("ibv_modify_qp(ERR)", C.shim_qp_set_state(q.qp, C.IBV_QPS_ERR))
	if err == nil {
		q.fail()
	}
	return err
}

func (q *qp) Disconnect() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return fmt.Errorf("verbs: Disconnect on closed QP: %w", net.ErrClosed)
	}
	return q.disconnectLocked()
}

func (q *qp) disconnectLocked() error {
	if q.disconnected {
		return nil
	}
	q.disconnected = true
	err := opErr("ibv_modify_qp(ERR)", C.shim_qp_set_state(q.qp, C.IBV_QPS_ERR))
	q.fail()
	if rc, cerr := C.shim_rdma_disconnect(q.id); rc != 0 && !errors.Is(cerr, syscall.EINVAL) {
		// EINVAL: the peer disconnected first; nothing left to tell.
		err = errors.Join(err, fmt.Errorf("verbs: rdma_disconnect: %w", errnoNow(cerr)))
	}
	return err
}

func (q *qp) Close() error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return nil
	}
	if q.qp == nil || q.local == nil {
		// Still being set up or never accepted (Device.Close).
		q.mu.Unlock()
		q.destroy()
		return nil
	}
	err := q.disconnectLocked()
	q.closed = true
	q.mu.Unlock()
	q.dev.cm.unregister(q.handle)
	if rc := C.shim_ibv_destroy_qp(q.qp); rc != 0 {
		err = errors.Join(err, opErr("ibv_destroy_qp", rc))
	} else {
		q.scq.detachSend(q.num)
		q.scq.detachHold(q.num)
		q.destroyRecvQueue()
		unbindQPs(q.scq, q.rcq, q.num)
	}
	C.shim_rdma_destroy_id(q.id)
	q.discOnce.Do(func() { close(q.disc) })
	return err
}

// postErr maps ibv_post_send/recv's errno to the interface's errors.
func (q *qp) postErr(call string, rc C.int) error {
	switch errnoErr(rc) {
	case syscall.ENOMEM:
		return fmt.Errorf("verbs: %s on QP %d: %w", call, q.num, transport.ErrQueueFull)
	case syscall.EINVAL:
		if s := C.shim_qp_state(q.qp); s >= 0 && s < C.IBV_QPS_RTS {
			return fmt.Errorf("verbs: %s on QP %d in state %v: %w", call, q.num, transport.QPState(s), transport.ErrQPState)
		}
		return fmt.Errorf("verbs: %s on QP %d: %w", call, q.num, transport.ErrInvalidWR)
	}
	return fmt.Errorf("verbs: %s on QP %d: %w", call, q.num, errnoErr(rc))
}

var shimOpcodes = [...]C.uint8_t{
	transport.OpSend:         C.SHIM_OP_SEND,
	transport.OpSendWithImm:  C.SHIM_OP_SEND_IMM,
	transport.OpWrite:        C.SHIM_OP_WRITE,
	transport.OpWriteWithImm: C.SHIM_OP_WRITE_IMM,
	transport.OpRead:         C.SHIM_OP_READ,
}

// checkSend reports why wr cannot be posted on q, before it reaches the
// device (so that the posted prefix is exact).
func (q *qp) checkSend(wr *transport.SendWR) error {
	if int(wr.Opcode) >= len(shimOpcodes) {
		return fmt.Errorf("verbs: opcode %v: %w", wr.Opcode, transport.ErrInvalidWR)
	}
	if len(wr.SG) > q.attrs.maxSendSGE {
		return fmt.Errorf("verbs: %d SGEs, QP allows %d: %w", len(wr.SG), q.attrs.maxSendSGE, transport.ErrInvalidWR)
	}
	if wr.Data != nil && (!wr.Inline || len(wr.SG) > 0) {
		return fmt.Errorf("verbs: Data without Inline, or with SG too: %w", transport.ErrInvalidWR)
	}
	if wr.Inline {
		if wr.Opcode == transport.OpRead {
			return fmt.Errorf("verbs: inline RDMA READ: %w", transport.ErrInvalidWR)
		}
		n := len(wr.Data)
		for _, s := range wr.SG {
			n += int(s.Length)
		}
		if n > q.attrs.maxInline {
			return fmt.Errorf("verbs: %d inline bytes, QP allows %d: %w", n, q.attrs.maxInline, transport.ErrInvalidWR)
		}
	}
	return nil
}

func (q *qp) PostSend(wrs ...transport.SendWR) (int, error) {
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.closed {
		return 0, fmt.Errorf("verbs: PostSend on closed QP: %w", transport.ErrQPState)
	}
	q.postMu.Lock()
	defer q.postMu.Unlock()
	q.sendWRs = q.sendWRs[:0]
	q.sges = q.sges[:0]
	// Inline Data is read by ibv_post_send itself: pinned for the call.
	var pin runtime.Pinner
	defer pin.Unpin()
	var bad error
	for i := range wrs {
		wr := &wrs[i]
		if bad = q.checkSend(wr); bad != nil {
			break
		}
		sg := wr.SG
		if len(wr.Data) > 0 {
			p := unsafe.SliceData(wr.Data)
			pin.Pin(p)
			sg = []transport.SGE{{Addr: uint64(uintptr(unsafe.Pointer(p))), Length: uint32(len(wr.Data))}}
		}
		var flags C.uint8_t
		if wr.Signaled {
			flags |= C.SHIM_F_SIGNALED
		}
		if wr.Inline {
			flags |= C.SHIM_F_INLINE
		}
		q.sendWRs = append(q.sendWRs, C.struct_shim_send{
			wr_id: C.uint64_t(wr.ID), remote_addr: C.uint64_t(wr.RemoteAddr),
			rkey: C.uint32_t(wr.RKey), imm: C.uint32_t(wr.Imm), nsge: C.uint32_t(len(sg)),
			opcode: shimOpcodes[wr.Opcode], flags: flags,
		})
		q.sges = appendSGEs(q.sges, sg)
	}
	n, err := q.postSendBuilt()
	if err != nil {
		return n, err
	}
	return n, bad
}

// postSendBuilt posts q.sendWRs, built from a prefix of wrs.
func (q *qp) postSendBuilt() (int, error) {
	if len(q.sendWRs) == 0 {
		return 0, nil
	}
	if q.hold != nil {
		return q.postHolding()
	}
	return q.postC(q.sendWRs, q.sges)
}

// postC posts wrs, whose SGEs are sges in order, to the device.
func (q *qp) postC(wrs []C.struct_shim_send, sges []C.struct_ibv_sge) (int, error) {
	k := len(wrs)
	counting, err := q.sendBegin(k)
	if err != nil {
		return 0, fmt.Errorf("verbs: QP %d: %w", q.num, err)
	}
	var posted C.int
	rc := C.shim_post_send(q.qp, unsafe.SliceData(wrs), C.int(k), sgePtr(sges), &posted)
	if counting {
		q.sendEnd(k, wrs, int(posted))
	}
	if rc != 0 {
		return int(posted), q.postErr("ibv_post_send", rc)
	}
	return int(posted), nil
}

func (q *qp) PostRecv(wrs ...transport.RecvWR) (int, error) {
	q.mu.RLock()
	defer q.mu.RUnlock()
	if q.closed {
		return 0, fmt.Errorf("verbs: PostRecv on closed QP: %w", transport.ErrQPState)
	}
	q.postMu.Lock()
	defer q.postMu.Unlock()
	q.recvWRs = q.recvWRs[:0]
	q.sges = q.sges[:0]
	var bad error
	for i := range wrs {
		if len(wrs[i].SG) > q.attrs.maxRecvSGE {
			bad = fmt.Errorf("verbs: %d SGEs, QP allows %d: %w", len(wrs[i].SG), q.attrs.maxRecvSGE, transport.ErrInvalidWR)
			break
		}
		q.recvWRs = append(q.recvWRs, C.struct_shim_recv{wr_id: C.uint64_t(wrs[i].ID), nsge: C.uint32_t(len(wrs[i].SG))})
		q.sges = appendSGEs(q.sges, wrs[i].SG)
	}
	if len(q.recvWRs) == 0 {
		return 0, bad
	}
	k := len(q.recvWRs)
	counting, err := q.recvBegin(k)
	if err != nil {
		return 0, fmt.Errorf("verbs: QP %d: %w", q.num, err)
	}
	var posted C.int
	var rc C.int
	if q.rq != nil {
		var done int
		if q.rq.pool != nil {
			done, rc = q.postPooled()
		} else {
			done, rc = q.postShared()
		}
		posted = C.int(done)
	} else {
		rc = C.shim_post_recv(q.qp, unsafe.SliceData(q.recvWRs), C.int(k), sgePtr(q.sges), &posted)
	}
	if counting {
		q.recvEnd(k, int(posted))
	}
	if rc != 0 {
		return int(posted), q.postErr("ibv_post_recv", rc)
	}
	return int(posted), bad
}

func appendSGEs(dst []C.struct_ibv_sge, sg []transport.SGE) []C.struct_ibv_sge {
	for _, s := range sg {
		dst = append(dst, C.struct_ibv_sge{addr: C.uint64_t(s.Addr), length: C.uint32_t(s.Length), lkey: C.uint32_t(s.LKey)})
	}
	return dst
}

// sgePtr returns the array's base, or nil when no request has SGEs.
func sgePtr(s []C.struct_ibv_sge) *C.struct_ibv_sge {
	if len(s) == 0 {
		return nil
	}
	return &s[0]
}

// rcAttrsOf are the local ACK timeout exponent, retry count and RNR retry
// of a connected QP of this provider, as the device reports them
// (ibv_query_qp); ok false for another kind or a failed query.
func rcAttrsOf(tq transport.QP) (timeout, retry, rnr int, ok bool) {
	q, isOurs := tq.(*qp)
	if !isOurs || q.qp == nil {
		return 0, 0, 0, false
	}
	var t, r, n C.int
	if C.shim_qp_rc_attrs(q.qp, &t, &r, &n) != 0 {
		return 0, 0, 0, false
	}
	return int(t), int(r), int(n), true
}

// trafficClassOf is the GRH traffic class of a connected QP of this
// provider, as the device reports it (ibv_query_qp); -1 for another kind.
func trafficClassOf(tq transport.QP) int {
	q, ok := tq.(*qp)
	if !ok || q.qp == nil {
		return -1
	}
	return int(C.shim_qp_traffic_class(q.qp))
}
