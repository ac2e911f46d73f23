// Package verbs is the RDMA provider of rdmagrpc: transport's interface
// over libibverbs and librdmacm, through cgo. It registers itself as
// "verbs"; importing it is what brings real RDMA (RoCE, InfiniBand,
// Soft-RoCE) into a binary.
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

// #include "shim.h"
import "C"

import (
	"slices"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Name is the name the provider registers under.
const Name = "verbs"

type provider struct{}

func init() { transport.Register(provider{}) }

func (provider) Name() string { return Name }

// Open opens the RDMA device called name ("" = the first one, in
// libibverbs order). On a machine where RDMA cannot work the error names
// the missing piece and wraps transport.ErrUnavailable.
func (provider) Open(name string) (transport.Device, error) {
	if err := diagnose(); err != nil {
		return nil, err
	}
	var n C.int
	list, err := C.rdma_get_devices(&n)
	if list == nil {
		return nil, unusable("rdma_cm cannot list devices (%v); kernel RDMA devices: %v", errnoNow(err), deviceNames())
	}
	ctxs := unsafe.Slice(list, int(n))
	var names []string
	var ctx *C.struct_ibv_context
	for _, c := range ctxs {
		dn := C.GoString(C.shim_dev_name(c))
		names = append(names, dn)
		if ctx == nil && (name == "" || dn == name) {
			ctx = c
		}
	}
	if ctx == nil {
		C.rdma_free_devices(list)
		if len(names) == 0 {
			return nil, unusable("libibverbs found no usable device among kernel devices %v "+
				"(is the userspace provider driver installed, e.g. librxe-rdmav*.so from ibverbs-providers?)", deviceNames())
		}
		return nil, unusable("no RDMA device %q (have %v)", name, names)
	}
	d, err := newDevice(ctx, list, len(ctxs))
	if err != nil {
		C.rdma_free_devices(list)
		return nil, err
	}
	return d, nil
}

// Devices lists the RDMA devices libibverbs can open, for logs and tests.
func Devices() []string {
	if diagnose() != nil {
		return nil
	}
	var n C.int
	list := C.rdma_get_devices(&n)
	if list == nil {
		return nil
	}
	defer C.rdma_free_devices(list)
	var names []string
	for _, c := range unsafe.Slice(list, int(n)) {
		names = append(names, C.GoString(C.shim_dev_name(c)))
	}
	slices.Sort(names)
	return names
}
