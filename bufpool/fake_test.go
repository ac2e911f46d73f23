package bufpool

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// fakeDevice is the smallest transport.Device a pool needs: memory and
// registrations, counted, with switches to make them fail. It covers the
// error paths the shm provider cannot be made to take on demand.
type fakeDevice struct {
	mu      sync.Mutex
	live    map[*byte]int // allocations not yet freed
	regs    int           // live registrations
	failReg error
	failDer error
}

func newFakeDevice() *fakeDevice { return &fakeDevice{live: map[*byte]int{}} }

func (d *fakeDevice) Name() string     { return "fake0" }
func (d *fakeDevice) Provider() string { return "fake" }
func (d *fakeDevice) Attr() transport.DeviceAttr {
	return transport.DeviceAttr{MaxMRSize: 1 << 30}
}

func (d *fakeDevice) AllocMemory(size int) ([]byte, error) {
	b := make([]byte, size)
	d.mu.Lock()
	d.live[&b[0]] = size
	d.mu.Unlock()
	return b, nil
}

func (d *fakeDevice) FreeMemory(mem []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.live[&mem[0]]; !ok {
		return errors.New("fake: free of unknown memory")
	}
	delete(d.live, &mem[0])
	return nil
}

func (d *fakeDevice) liveAllocs() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.live)
}

func (d *fakeDevice) liveRegs() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.regs
}

func (d *fakeDevice) AllocPD() (transport.PD, error)            { return &fakePD{d: d}, nil }
func (d *fakeDevice) CreateCQ(int) (transport.CQ, error)        { return nil, errors.ErrUnsupported }
func (d *fakeDevice) Listen(string) (transport.Listener, error) { return nil, errors.ErrUnsupported }
func (d *fakeDevice) Connect(context.Context, string, transport.QPConfig, []byte) (transport.QP, error) {
	return nil, errors.ErrUnsupported
}
func (d *fakeDevice) Close() error { return nil }

type fakePD struct{ d *fakeDevice }

func (p *fakePD) RegMR(mem []byte, access transport.Access) (transport.MR, error) {
	p.d.mu.Lock()
	defer p.d.mu.Unlock()
	if p.d.failReg != nil {
		return nil, p.d.failReg
	}
	if _, ok := p.d.live[&mem[0]]; !ok {
		return nil, syscall.EFAULT
	}
	p.d.regs++
	return &fakeMR{d: p.d, mem: mem, access: access, key: uint32(p.d.regs)}, nil
}

func (p *fakePD) Close() error {
	if n := p.d.liveRegs(); n > 0 {
		return syscall.EBUSY
	}
	return nil
}

type fakeMR struct {
	d      *fakeDevice
	mem    []byte
	access transport.Access
	key    uint32
	dead   bool
}

func (m *fakeMR) Addr() uint64             { return uint64(uintptr(unsafe.Pointer(&m.mem[0]))) }
func (m *fakeMR) Len() int                 { return len(m.mem) }
func (m *fakeMR) LKey() uint32             { return m.key }
func (m *fakeMR) RKey() uint32             { return m.key }
func (m *fakeMR) Access() transport.Access { return m.access }
func (m *fakeMR) Bytes() []byte            { return m.mem }
func (m *fakeMR) Dereg() error {
	m.d.mu.Lock()
	defer m.d.mu.Unlock()
	if m.d.failDer != nil {
		return m.d.failDer
	}
	if m.dead {
		return errors.New("fake: double dereg")
	}
	m.dead = true
	m.d.regs--
	return nil
}

func newFakePool(t testing.TB, opts Options) (*Pool, *fakeDevice) {
	t.Helper()
	d := newFakeDevice()
	pd, _ := d.AllocPD()
	if opts.Budget == nil {
		opts.Budget = NewBudget(0)
	}
	p, err := New(d, pd, opts)
	if err != nil {
		t.Fatal(err)
	}
	return p, d
}
