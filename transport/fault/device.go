package fault

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

type device struct {
	inj   *Injector
	inner transport.Device

	mu     sync.Mutex
	qps    map[uint32]*qp // live and closed-but-not-drained QPs, by number
	closed atomic.Int32   // closed QPs still in qps: reap has work
}

func (d *device) Name() string     { return d.inner.Name() }
func (d *device) Provider() string { return d.inj.name }
func (d *device) Attr() transport.DeviceAttr {
	a := d.inner.Attr()
	if n := d.inj.maxInline.Load(); n >= 0 {
		a.MaxInline = min(a.MaxInline, int(n))
	}
	return a
}

func (d *device) AllocMemory(size int) ([]byte, error) {
	mem, err := d.inner.AllocMemory(size)
	if err == nil {
		d.inj.live.memory.Add(int64(len(mem)))
	}
	return mem, err
}

func (d *device) FreeMemory(mem []byte) error {
	err := d.inner.FreeMemory(mem)
	if err == nil {
		d.inj.live.memory.Add(-int64(len(mem)))
	}
	return err
}

func (d *device) AllocPD() (transport.PD, error) {
	p, err := d.inner.AllocPD()
	if err != nil {
		return nil, err
	}
	d.inj.live.pds.Add(1)
	return &pd{dev: d, inner: p, mrs: map[uint32]transport.MR{}}, nil
}

func (d *device) CreateCQ(entries int) (transport.CQ, error) {
	c, err := d.inner.CreateCQ(entries)
	if err != nil {
		return nil, err
	}
	d.inj.live.cqs.Add(1)
	return newCQ(d, c), nil
}

func (d *device) Listen(addr string) (transport.Listener, error) {
	l, err := d.inner.Listen(addr)
	if err != nil {
		return nil, err
	}
	return &listener{dev: d, inner: l}, nil
}

func (d *device) Connect(ctx context.Context, addr string, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	inner, p, scq, rcq, err := d.unwrap(cfg)
	if err != nil {
		return nil, err
	}
	q, err := d.inner.Connect(ctx, addr, inner, private)
	if err != nil {
		return nil, err
	}
	return d.wrapQP(q, cfg, p, scq, rcq), nil
}

func (d *device) Close() error {
	d.inj.forget(d)
	return d.inner.Close()
}

// earlyDevice is the wrapper of a device that dials early
// (transport.EarlyConnector), so that the faults of the data path reach
// connections whose dial returned before the listener answered.
type earlyDevice struct{ *device }

func (d earlyDevice) ConnectEarly(ctx context.Context, addr string, cfg transport.QPConfig, private []byte) (transport.EarlyQP, error) {
	inner, p, scq, rcq, err := d.unwrap(cfg)
	if err != nil {
		return nil, err
	}
	q, err := d.inner.(transport.EarlyConnector).ConnectEarly(ctx, addr, inner, private)
	if err != nil {
		return nil, err
	}
	return earlyQP{d.wrapQP(q, cfg, p, scq, rcq), q}, nil
}

// earlyQP is the wrapper's QP with the inner QP's wait for the answer.
type earlyQP struct {
	*qp
	early transport.EarlyQP
}

func (q earlyQP) Established(ctx context.Context) error { return q.early.Established(ctx) }

// unwrap swaps the wrapper's PD and CQs in cfg for the inner ones, which
// is what the inner provider checks and uses.
func (d *device) unwrap(cfg transport.QPConfig) (transport.QPConfig, *pd, *cq, *cq, error) {
	p, ok := cfg.PD.(*pd)
	scq, ok1 := cfg.SendCQ.(*cq)
	rcq, ok2 := cfg.RecvCQ.(*cq)
	if !ok || !ok1 || !ok2 || p.dev != d || scq.dev != d || rcq.dev != d {
		return cfg, nil, nil, nil, fmt.Errorf("fault: create QP: PD and CQs must come from this %s device: %w", d.inj.name, transport.ErrInvalidWR)
	}
	cfg.PD, cfg.SendCQ, cfg.RecvCQ = p.inner, scq.inner, rcq.inner
	// The inner provider posts the initial receives under the wrapper's
	// ids (wrapQP records them); no fault is injected on them, as there
	// is no QP yet to move to ERROR.
	cfg.InitialRecvs = slices.Clone(cfg.InitialRecvs)
	for i := range cfg.InitialRecvs {
		cfg.InitialRecvs[i].ID = uint64(i) | recvTag
	}
	return cfg, p, scq, rcq, nil
}

// wrapQP wraps inner, made with cfg (the caller's, before unwrap).
func (d *device) wrapQP(inner transport.QP, cfg transport.QPConfig, p *pd, scq, rcq *cq) *qp {
	q := &qp{dev: d, inner: inner, num: inner.Num(), pd: p, scq: scq, rcq: rcq}
	for i, wr := range cfg.InitialRecvs {
		e := &recvEntry{seq: uint64(i), wr: wr}
		e.wr.SG = slices.Clone(wr.SG)
		q.recvQ = append(q.recvQ, e)
	}
	q.recvSeq = uint64(len(cfg.InitialRecvs))
	d.inj.live.qps.Add(1)
	d.mu.Lock()
	d.qps[q.num] = q
	d.mu.Unlock()
	return q
}

func (d *device) lookup(num uint32) *qp {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.qps[num]
}

// reap forgets closed QPs whose completions can no longer be in c: once
// a QP is destroyed and its CQs were polled empty, no completion of it
// remains to be translated.
func (d *device) reap(c *cq) {
	if c.closedQPs.Load() == 0 {
		return // the common case: no closed QP left on this queue
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for n, q := range d.qps {
		if !q.closed.Load() {
			continue
		}
		if q.scq == c && !q.sendDrained.Swap(true) {
			c.closedQPs.Add(-1)
		}
		if q.rcq == c && !q.recvDrained.Swap(true) {
			c.closedQPs.Add(-1)
		}
		if q.sendDrained.Load() && q.recvDrained.Load() {
			delete(d.qps, n)
			d.closed.Add(-1)
		}
	}
}

type pd struct {
	dev    *device
	inner  transport.PD
	stage  stager
	closed once

	mu  sync.RWMutex
	mrs map[uint32]transport.MR // by lkey: to read and corrupt payloads
}

func (p *pd) RegMR(mem []byte, access transport.Access) (transport.MR, error) {
	ev := Event{Op: OpRegMR, Device: p.dev.inner.Name(), Len: len(mem), Access: access}
	if d := p.dev.inj.decide(&ev); d.fail != nil {
		return nil, fmt.Errorf("fault: rule %q refused to register %d bytes: %w", d.fail.Name, len(mem), d.fail.failErr())
	}
	m, err := p.inner.RegMR(mem, access)
	if err != nil {
		return nil, err
	}
	w := &mr{MR: m, pd: p}
	p.dev.inj.live.mrs.Add(1)
	p.dev.inj.live.mrBytes.Add(int64(len(mem)))
	p.mu.Lock()
	p.mrs[m.LKey()] = m
	p.mu.Unlock()
	if _, ok := m.(transport.PageReleaser); ok {
		return releasingMR{w}, nil // conn parks idle rings over it (shm)
	}
	return w, nil
}

// bytes returns the registered bytes [addr, addr+n) of lkey, if known.
func (p *pd) bytes(lkey uint32, addr uint64, n uint32) ([]byte, bool) {
	p.mu.RLock()
	m := p.mrs[lkey]
	p.mu.RUnlock()
	if m == nil {
		m = p.stage.lookup(lkey)
	}
	if m == nil || addr < m.Addr() || addr-m.Addr() > uint64(m.Len()) || uint64(n) > uint64(m.Len())-(addr-m.Addr()) {
		return nil, false
	}
	off := addr - m.Addr()
	return m.Bytes()[off : off+uint64(n)], true
}

// segments resolves a scatter/gather list to byte slices.
func (p *pd) segments(sg []transport.SGE) ([][]byte, bool) {
	out := make([][]byte, 0, len(sg))
	for _, s := range sg {
		if s.Length == 0 {
			continue
		}
		b, ok := p.bytes(s.LKey, s.Addr, s.Length)
		if !ok {
			return nil, false
		}
		out = append(out, b)
	}
	return out, true
}

func (p *pd) Close() error {
	p.closed.do(func() { p.dev.inj.live.pds.Add(-1) })
	if err := p.stage.close(p.dev.inner); err != nil {
		return fmt.Errorf("fault: close PD: %w", err)
	}
	return p.inner.Close()
}

// mr forgets its lkey on Dereg; everything else is the inner MR.
type mr struct {
	transport.MR
	pd     *pd
	deregd once
}

func (m *mr) Dereg() error {
	m.pd.mu.Lock()
	if m.pd.mrs[m.LKey()] == m.MR {
		delete(m.pd.mrs, m.LKey())
	}
	m.pd.mu.Unlock()
	if err := m.MR.Dereg(); err != nil {
		return err
	}
	m.deregd.do(func() {
		m.pd.dev.inj.live.mrs.Add(-1)
		m.pd.dev.inj.live.mrBytes.Add(-int64(m.Len()))
	})
	return nil
}

// releasingMR is an mr whose inner MR can give its pages back.
type releasingMR struct{ *mr }

func (m releasingMR) ReleasePages() error { return m.MR.(transport.PageReleaser).ReleasePages() }

type listener struct {
	dev   *device
	inner transport.Listener
}

func (l *listener) Accept(ctx context.Context) (transport.ConnRequest, error) {
	r, err := l.inner.Accept(ctx)
	if err != nil {
		return nil, err
	}
	return &connRequest{dev: l.dev, inner: r}, nil
}

func (l *listener) Addr() net.Addr { return l.inner.Addr() }
func (l *listener) Close() error   { return l.inner.Close() }

type connRequest struct {
	dev   *device
	inner transport.ConnRequest
}

func (r *connRequest) PeerPrivate() []byte      { return r.inner.PeerPrivate() }
func (r *connRequest) RemoteAddr() net.Addr     { return r.inner.RemoteAddr() }
func (r *connRequest) Reject(priv []byte) error { return r.inner.Reject(priv) }

func (r *connRequest) Accept(ctx context.Context, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	inner, p, scq, rcq, err := r.dev.unwrap(cfg)
	if err != nil {
		// The request must still be answered exactly once.
		return nil, errors.Join(err, r.inner.Reject(nil))
	}
	q, err := r.inner.Accept(ctx, inner, private)
	if err != nil {
		return nil, err
	}
	return r.dev.wrapQP(q, cfg, p, scq, rcq), nil
}
