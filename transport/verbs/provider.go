// Package verbs is the RDMA provider of rdmagrpc: transport's interface
// over libibverbs and librdmacm, through cgo. It registers itself as
// "verbs"; importing it is what brings real RDMA (RoCE, InfiniBand,
// Soft-RoCE) into a binary.
//
// The libraries are loaded at run time (dlopen of libibverbs.so.1 and
// librdmacm.so.1), not linked: a binary importing this package starts on
// a node without rdma-core, and Open then reports the provider
// unavailable with the reason (no RDMA device, library not found, port
// down), so conn picks shm. Building needs no rdma-core headers either
// (abi.h declares the ABI used). Built with CGO_ENABLED=0 the provider is
// always unavailable ("built without cgo").
//
// Design:
//   - Connections are set up by rdma_cm (RDMA_PS_TCP port space, so
//     addresses are "ip:port"); the QPs are created by this package and
//     moved through INIT/RTR/RTS with rdma_init_qp_attr plus our own
//     reliability attributes (see qpattr.go).
//   - No OS thread is parked anywhere: the rdma_cm event channel, the
//     completion channel and the device's async event fd are switched to
//     O_NONBLOCK and read through Go's netpoller (os.File + RawConn).
//   - One goroutine per Device serves the rdma_cm event channel and
//     dispatches events to listeners and ids; one serves the device's
//     completion channel, which every CQ of the device shares, and hands
//     each event to its CQ (the SetNotify function of transport.NotifyCQ,
//     else a wake-up for Wait); one per verbs context reads async events
//     (CQ overflow). All end on Close. A CQ costs no descriptor and no
//     goroutine of its own.
//   - Work requests and completions cross into C as flat, pointer-free
//     arrays; completions are written straight into the caller's
//     []transport.WorkCompletion.
//
// Behaviour a user of the interface sees and that comes from rdma_cm over
// IB/RoCE, not from us: private data arrives zero-padded to the size of the
// CM message that carried it (56 bytes for a connect request, 196 for an
// accept, 148 for a reject); what the peer sent is a prefix.
package verbs

import (
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Name is the name the provider registers under.
const Name = "verbs"

type provider struct{}

func init() { transport.Register(provider{}) }

func (provider) Name() string { return Name }

// Open opens the RDMA device called name ("" = the first one, in
// libibverbs order). On a machine where RDMA cannot work the error names
// the missing piece and wraps transport.ErrUnavailable (no device, no
// libraries, a binary built without cgo) or transport.ErrUnusable (a
// device is here but cannot be used).
func (provider) Open(name string) (transport.Device, error) {
	if !cgoBuilt {
		return nil, errNoCgo
	}
	if err := diagnose(); err != nil {
		return nil, err
	}
	if err := load(); err != nil {
		return nil, err
	}
	return open(name)
}

// Devices lists the RDMA devices libibverbs can open, for logs and tests.
func Devices() []string {
	if !cgoBuilt || diagnose() != nil || load() != nil {
		return nil
	}
	return devices()
}
