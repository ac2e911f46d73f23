package transporttest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

const (
	memSize   = 64 << 10
	allAccess = transport.AccessLocalWrite | transport.AccessRemoteWrite | transport.AccessRemoteRead
)

// endpoint is one side's resources: PD, CQs, registered memory and, once
// connected, its QP.
type endpoint struct {
	dev      transport.Device
	pd       transport.PD
	scq, rcq transport.CQ
	mem      []byte
	mr       transport.MR
	qp       transport.QP
	cfg      transport.QPConfig
}

// setup tunes an endpoint before its QP is created.
type setup struct {
	access transport.Access // of the MR; 0 = all
	cqSize int              // of both CQs; 0 = 256
	qp     func(*transport.QPConfig)
}

func newEndpoint(dev transport.Device, s setup) (*endpoint, error) {
	e := &endpoint{dev: dev}
	var err error
	if e.pd, err = dev.AllocPD(); err != nil {
		return nil, fmt.Errorf("alloc PD: %w", err)
	}
	cq := s.cqSize
	if cq == 0 {
		cq = 256
	}
	if e.scq, err = dev.CreateCQ(cq); err != nil {
		e.close()
		return nil, fmt.Errorf("create CQ: %w", err)
	}
	if e.rcq, err = dev.CreateCQ(cq); err != nil {
		e.close()
		return nil, fmt.Errorf("create CQ: %w", err)
	}
	if e.mem, err = dev.AllocMemory(memSize); err != nil {
		e.close()
		return nil, fmt.Errorf("alloc memory: %w", err)
	}
	acc := s.access
	if acc == 0 {
		acc = allAccess
	}
	if e.mr, err = e.pd.RegMR(e.mem, acc); err != nil {
		e.close()
		return nil, fmt.Errorf("register memory: %w", err)
	}
	e.cfg = transport.QPConfig{
		PD: e.pd, SendCQ: e.scq, RecvCQ: e.rcq,
		MaxSendWR: 64, MaxRecvWR: 64, MaxSendSGE: 4, MaxRecvSGE: 4, MaxInline: 64,
		RetryCount: 7, RNRRetry: 7, MinRNRTimer: time.Millisecond,
	}
	if s.qp != nil {
		s.qp(&e.cfg)
	}
	return e, nil
}

func (e *endpoint) close() {
	if e.qp != nil {
		e.qp.Close()
	}
	if e.mr != nil {
		e.mr.Dereg()
	}
	if e.mem != nil {
		e.dev.FreeMemory(e.mem)
	}
	for _, cq := range []transport.CQ{e.scq, e.rcq} {
		if cq != nil {
			cq.Close()
		}
	}
	if e.pd != nil {
		e.pd.Close()
	}
}

// sge names n bytes of the endpoint's memory at off.
func (e *endpoint) sge(off, n int) transport.SGE {
	return transport.SGE{Addr: e.mr.Addr() + uint64(off), Length: uint32(n), LKey: e.mr.LKey()}
}

// postSend posts one work request and reports an immediate error.
func (e *endpoint) postSend(wr transport.SendWR) error {
	if _, err := e.qp.PostSend(wr); err != nil {
		return fmt.Errorf("post %v: %w", wr.Opcode, err)
	}
	return nil
}

func (e *endpoint) postRecv(id uint64, sg ...transport.SGE) error {
	if _, err := e.qp.PostRecv(transport.RecvWR{ID: id, SG: sg}); err != nil {
		return fmt.Errorf("post receive: %w", err)
	}
	return nil
}

// poll collects exactly n completions from cq, or fails at ctx's end.
func poll(ctx context.Context, cq transport.CQ, n int) ([]transport.WorkCompletion, error) {
	out := make([]transport.WorkCompletion, 0, n)
	buf := make([]transport.WorkCompletion, n)
	for len(out) < n {
		k, err := cq.Poll(buf[:n-len(out)])
		if err != nil {
			return out, fmt.Errorf("poll: %w", err)
		}
		out = append(out, buf[:k]...)
		if k == 0 {
			select {
			case <-ctx.Done():
				return out, fmt.Errorf("waiting for %d completions, got %d: %w", n, len(out), ctx.Err())
			case <-time.After(200 * time.Microsecond):
			}
		}
	}
	return out, nil
}

// pollNone checks that no completion shows up for d.
func pollNone(cq transport.CQ, d time.Duration) error {
	buf := make([]transport.WorkCompletion, 4)
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(time.Millisecond) {
		n, err := cq.Poll(buf)
		if err != nil {
			return err
		}
		if n > 0 {
			return fmt.Errorf("unexpected completion %+v", buf[0])
		}
	}
	return nil
}

// check compares one completion with what is expected of it.
func check(wc transport.WorkCompletion, id uint64, st transport.Status, op transport.WCOpcode, qpn uint32) error {
	if wc.ID != id || wc.Status != st || wc.QPNum != qpn {
		return fmt.Errorf("completion id %d status %q qp %d, want id %d status %q qp %d", wc.ID, wc.Status, wc.QPNum, id, st, qpn)
	}
	if st == transport.StatusSuccess && wc.Opcode != op {
		return fmt.Errorf("completion opcode %v, want %v", wc.Opcode, op)
	}
	return nil
}

// connect is the peer's usual start: an endpoint connected to the local
// half's listener with private data.
func (p *peer) connect(ctx context.Context, s setup, private []byte) (*endpoint, error) {
	e, err := newEndpoint(p.dev, s)
	if err != nil {
		return nil, err
	}
	qp, err := p.dev.Connect(ctx, p.addr, e.cfg, private)
	if err != nil {
		e.close()
		return nil, fmt.Errorf("connect to %s: %w", p.addr, err)
	}
	e.qp = qp
	return e, nil
}

// awaitBye holds the peer's connection open until the local half is done.
func (p *peer) awaitBye(ctx context.Context) error {
	_, err := p.ctl.expect(ctx, bye)
	if errors.Is(err, errPeerDone) {
		return nil
	}
	return err
}

// okThenBye reports the peer's checks passed and holds the connection
// until the local half is done.
func (p *peer) okThenBye(ctx context.Context) error {
	if err := p.ctl.sendf("ok"); err != nil {
		return err
	}
	return p.awaitBye(ctx)
}

// sendMR tells the other half where e's memory is.
func sendMR(k *ctl, e *endpoint) error {
	return k.sendf("mr %d %d %d", e.mr.Addr(), e.mr.RKey(), e.mr.Len())
}

// remoteMR is the other half's memory as sendMR described it.
type remoteMR struct {
	addr uint64
	rkey uint32
	len  int
}

func parseMR(f []string) (remoteMR, error) {
	var r remoteMR
	if len(f) != 3 {
		return r, fmt.Errorf("bad mr message %q", f)
	}
	_, err := fmt.Sscan(f[0]+" "+f[1]+" "+f[2], &r.addr, &r.rkey, &r.len)
	return r, err
}

// accept is the local half's usual start: the next connection request
// accepted into a new endpoint.
func (e *env) accept(s setup, private []byte) *endpoint {
	e.t.Helper()
	ep, err := newEndpoint(e.dev, s)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(ep.close)
	ctx := e.ctx()
	r, err := e.l.Accept(ctx)
	if err != nil {
		e.t.Fatalf("accept: %v", err)
	}
	qp, err := r.Accept(ctx, ep.cfg, private)
	if err != nil {
		e.t.Fatalf("accept: %v", err)
	}
	ep.qp = qp
	return ep
}

// remoteMR waits for the peer's memory description.
func (e *env) remoteMR() remoteMR {
	e.t.Helper()
	r, err := parseMR(e.expect("mr"))
	if err != nil {
		e.t.Fatal(err)
	}
	return r
}

func (e *env) poll(cq transport.CQ, n int) []transport.WorkCompletion {
	e.t.Helper()
	wcs, err := poll(e.ctx(), cq, n)
	if err != nil {
		e.t.Fatal(err)
	}
	return wcs
}

func (e *env) check(wc transport.WorkCompletion, id uint64, st transport.Status, op transport.WCOpcode, qpn uint32) {
	e.t.Helper()
	if err := check(wc, id, st, op, qpn); err != nil {
		e.t.Fatal(err)
	}
}

// fill writes a recognisable pattern.
func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7)
	}
}
