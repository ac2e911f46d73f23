package verbs

// #include "shim.h"
import "C"

import (
	"fmt"
	"net"
	"sync"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

type pd struct {
	dev *device
	pd  *C.struct_ibv_pd

	mu     sync.Mutex
	closed bool
}

func (p *pd) RegMR(mem []byte, access transport.Access) (transport.MR, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, fmt.Errorf("verbs: RegMR on closed PD: %w", net.ErrClosed)
	}
	if access&^(transport.AccessLocalWrite|transport.AccessRemoteWrite|transport.AccessRemoteRead) != 0 {
		return nil, fmt.Errorf("verbs: RegMR: unknown access bits %#x", uint32(access))
	}
	r, err := p.dev.mem.pin(mem)
	if err != nil {
		return nil, err
	}
	// transport.Access is numbered as IBV_ACCESS_LOCAL_WRITE,
	// REMOTE_WRITE, REMOTE_READ (1, 2, 4).
	m, err := C.shim_reg_mr(p.pd, C.uintptr_t(uintptr(unsafe.Pointer(&mem[0]))), C.size_t(len(mem)), C.int(access))
	if m == nil {
		p.dev.mem.unpin(r)
		err = errnoNow(err)
		if memlockErrno(err) {
			if hint := memlockHint(len(mem)); hint != "" {
				return nil, fmt.Errorf("verbs: ibv_reg_mr(%d bytes, access %#x): %w (%s)", len(mem), uint32(access), err, hint)
			}
		}
		return nil, fmt.Errorf("verbs: ibv_reg_mr(%d bytes, access %#x): %w", len(mem), uint32(access), err)
	}
	return &mr{pd: p, mr: m, mem: mem, access: access, region: r,
		addr: uint64(C.shim_mr_addr(m)), lkey: uint32(m.lkey), rkey: uint32(m.rkey)}, nil
}

func (p *pd) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if rc := C.shim_ibv_dealloc_pd(p.pd); rc != 0 {
		return fmt.Errorf("verbs: PD still in use (MRs or QPs open): %w", opErr("ibv_dealloc_pd", rc))
	}
	p.closed = true
	return nil
}

type mr struct {
	pd     *pd
	mr     *C.struct_ibv_mr
	mem    []byte
	access transport.Access
	region *region
	// Copied at registration: the ibv_mr is freed by Dereg.
	addr       uint64
	lkey, rkey uint32

	mu     sync.Mutex
	closed bool
}

func (m *mr) Addr() uint64             { return m.addr }
func (m *mr) Len() int                 { return len(m.mem) }
func (m *mr) LKey() uint32             { return m.lkey }
func (m *mr) RKey() uint32             { return m.rkey }
func (m *mr) Access() transport.Access { return m.access }
func (m *mr) Bytes() []byte            { return m.mem }

func (m *mr) Dereg() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	if rc := C.shim_ibv_dereg_mr(m.mr); rc != 0 {
		return opErr("ibv_dereg_mr", rc)
	}
	m.closed = true
	m.pd.dev.mem.unpin(m.region)
	return nil
}
