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
	"syscall"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// port is the HCA port used; rdma_cm picks it per id, but attributes and
// the GID lookup of tests use port 1, the only port of rxe and most NICs.
const port = 1

type device struct {
	name string
	list **C.struct_ibv_context // from rdma_get_devices; freed on Close
	ctx  *C.struct_ibv_context
	attr transport.DeviceAttr
	// initDepth and respRes are the RDMA READ depths offered in the CM
	// handshake (outgoing reads in flight, incoming reads served).
	initDepth, respRes uint8
	// cqGrows: the device resizes CQs, so a CQ starts at initialCQE and
	// grows before it could be needed (cqgrow.go).
	cqGrows bool
	// maxSRQ and maxSRQWR: the shared receive queues the device has, and
	// their depth (srq.go); 0 if it has none.
	maxSRQ, maxSRQWR int

	cm      *cmChannel
	qpEnv   qpEnv        // the environment's overrides of the RC attributes
	allowed devList      // DevicesEnv: which devices and ports connections may use
	comp    *compChannel // shared by every CQ of the device
	// The shared CQs that consumers' CQs are views of (sharedcq.go).
	sharedMu sync.Mutex
	shared   []*sharedCQ
	async    *asyncReader
	mem      memRegistry
	// The receive pool (pool.go), created with the first QP it serves;
	// poolErr: creating it failed, and QPs receive as if it were off.
	poolMu  sync.Mutex
	pool    atomic.Pointer[recvPool]
	poolErr error

	// Several devices: ndev is how many rdma_cm listed at Open; the
	// others are opened when a route goes through them (sibling) and
	// closed with this one, their parent.
	ndev     int
	parent   *device
	siblings map[string]*device

	mu     sync.Mutex
	closed bool
}

func newDevice(ctx *C.struct_ibv_context, list **C.struct_ibv_context, ndev int) (*device, error) {
	d := &device{name: C.GoString(C.shim_dev_name(ctx)), list: list, ctx: ctx, ndev: ndev}
	tos, err := trafficClass()
	if err != nil {
		return nil, err
	}
	if d.qpEnv, err = readQPEnv(); err != nil {
		return nil, err
	}
	if d.allowed, err = readDevList(); err != nil {
		return nil, err
	}
	var a C.struct_shim_dev_attr
	if rc := C.shim_query_device(ctx, &a); rc != 0 {
		return nil, fmt.Errorf("verbs: %s: %w", d.name, opErr("ibv_query_device", rc))
	}
	var p C.struct_shim_port
	if rc := C.shim_query_port(ctx, port, &p); rc != 0 {
		return nil, fmt.Errorf("verbs: %s: %w", d.name, opErr("ibv_query_port", rc))
	}
	if p.state != C.IBV_PORT_ACTIVE {
		return nil, unusable("port %d of %s is %s, not ACTIVE (link down, or Soft-RoCE netdev down)",
			port, d.name, C.GoString(C.shim_ibv_port_state_str(p.state)))
	}
	d.attr = transport.DeviceAttr{
		MaxQPWR:     int(a.max_qp_wr),
		MaxSGE:      int(a.max_sge),
		MaxCQE:      int(a.max_cqe),
		MaxInline:   int(C.shim_probe_inline(ctx)),
		MaxMRSize:   uint64(a.max_mr_size),
		MaxQPRdAtom: int(a.max_qp_rd_atom),
	}
	d.cqGrows = C.shim_probe_resize_cq(ctx) != 0
	d.maxSRQ, d.maxSRQWR = int(a.max_srq), int(a.max_srq_wr)
	d.initDepth = uint8(min(int(a.max_qp_init_rd_atom), maxRdAtomic))
	d.respRes = uint8(min(int(a.max_qp_rd_atom), maxRdAtomic))
	if d.async, err = acquireAsync(ctx); err != nil {
		return nil, err
	}
	if d.cm, err = newCMChannel(); err != nil {
		d.async.release()
		return nil, err
	}
	d.cm.tos = tos
	if d.comp, err = newCompChannel(d); err != nil {
		d.cm.close()
		d.async.release()
		return nil, err
	}
	return d, nil
}

func (d *device) Name() string                      { return d.name }
func (d *device) Provider() string                  { return Name }
func (d *device) Attr() transport.DeviceAttr        { return d.attr }
func (d *device) AllocMemory(n int) ([]byte, error) { return d.mem.alloc(n) }
func (d *device) FreeMemory(m []byte) error         { return d.mem.free(m) }

func (d *device) checkOpen() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("verbs: device %s: %w", d.name, net.ErrClosed)
	}
	return nil
}

func (d *device) AllocPD() (transport.PD, error) {
	if err := d.checkOpen(); err != nil {
		return nil, err
	}
	p, err := C.shim_ibv_alloc_pd(d.ctx)
	if p == nil {
		return nil, fmt.Errorf("verbs: ibv_alloc_pd on %s: %w", d.name, errnoNow(err))
	}
	return &pd{dev: d, pd: p}, nil
}

func (d *device) CreateCQ(entries int) (transport.CQ, error) {
	if err := d.checkOpen(); err != nil {
		return nil, err
	}
	return newCQ(d, entries)
}

func (d *device) Listen(addr string) (transport.Listener, error) {
	if err := d.checkOpen(); err != nil {
		return nil, err
	}
	return newListener(d, addr)
}

func (d *device) Connect(ctx context.Context, addr string, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	if err := d.checkOpen(); err != nil {
		return nil, err
	}
	return connect(ctx, d, addr, cfg, private)
}

// DeviceFor implements transport.Router: the device rdma_cm's address
// resolution picks for addr, where a connection's PD, CQ and memory must
// be, since its QP can only be created on the device its route goes
// through. With one device there is nothing to resolve.
func (d *device) DeviceFor(ctx context.Context, addr string) (transport.Device, error) {
	if d.ndev <= 1 {
		return d, nil
	}
	if err := d.checkOpen(); err != nil {
		return nil, err
	}
	dst, err := resolveHostPort(ctx, addr, false)
	if err != nil {
		return nil, err
	}
	sa, err := toShimAddr(dst)
	if err != nil {
		return nil, err
	}
	var e C.int
	v := C.shim_route_verbs(&sa, timeoutMS(ctx), &e)
	if v == nil {
		return nil, fmt.Errorf("verbs: connect %s: rdma_resolve_addr: %w", addr, syscall.Errno(e))
	}
	return d.sibling(v)
}

// sibling returns the open device for verbs context v: d itself, or one
// of its siblings, opened on first use.
func (d *device) sibling(v *C.struct_ibv_context) (*device, error) {
	if v == d.ctx {
		return d, nil
	}
	if d.parent != nil {
		return d.parent.sibling(v)
	}
	name := C.GoString(C.shim_dev_name(v))
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("verbs: device %s: %w", d.name, net.ErrClosed)
	}
	if s := d.siblings[name]; s != nil {
		return s, nil
	}
	var n C.int
	list, err := C.shim_rdma_get_devices(&n)
	if list == nil {
		return nil, fmt.Errorf("verbs: open device %s: rdma_get_devices: %w", name, errnoNow(err))
	}
	for _, c := range unsafe.Slice(list, int(n)) {
		if c == v {
			s, err := newDevice(c, list, int(n))
			if err != nil {
				C.shim_rdma_free_devices(list)
				return nil, fmt.Errorf("verbs: open device %s, which the route goes through: %w", name, err)
			}
			s.parent = d
			if d.siblings == nil {
				d.siblings = map[string]*device{}
			}
			d.siblings[name] = s
			return s, nil
		}
	}
	C.shim_rdma_free_devices(list)
	return nil, fmt.Errorf("verbs: the route goes through RDMA device %s, which rdma_cm does not list", name)
}

// Close closes every listener and QP still open on the device, stops its
// event goroutine and releases the verbs context. PDs, MRs, CQs and
// memory should be closed first; any left are reported, not leaked
// silently.
func (d *device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	siblings := d.siblings
	d.siblings = nil
	d.mu.Unlock()

	var errs []error
	for _, s := range siblings {
		if err := s.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, c := range d.cm.endpoints() {
		if err := c.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := d.cm.close(); err != nil {
		errs = append(errs, err)
	}
	if err := d.closePool(); err != nil {
		errs = append(errs, err)
	}
	open := 0
	cqMu.Lock()
	for _, c := range cqs {
		if c.dev == d {
			open++
		}
	}
	for _, s := range sharedCQs {
		if s.dev == d {
			open++ // it has views open
		}
	}
	cqMu.Unlock()
	if open > 0 {
		// verbs would refuse to destroy a channel CQs still use.
		d.comp.poll.close()
		<-d.comp.done
		errs = append(errs, fmt.Errorf("verbs: device %s closed with %d CQs open; its completion channel is left", d.name, open))
	} else if err := d.comp.close(); err != nil {
		errs = append(errs, err)
	}
	d.async.release()
	if n := d.mem.live(); n > 0 {
		errs = append(errs, fmt.Errorf("verbs: device %s closed with %d memory allocations not freed", d.name, n))
	}
	C.shim_rdma_free_devices(d.list)
	return errors.Join(errs...)
}
