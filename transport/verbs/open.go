package verbs

// #include "shim.h"
import "C"

import (
	"slices"
	"unsafe"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// open is Open once the kernel side is checked and the libraries loaded.
func open(name string) (transport.Device, error) {
	var n C.int
	list, err := C.shim_rdma_get_devices(&n)
	if list == nil {
		return nil, unusable("rdma_cm cannot list devices (%v); kernel RDMA devices: %v", errnoNow(err), deviceNames())
	}
	allowed, err := readDevList()
	if err != nil {
		C.shim_rdma_free_devices(list)
		return nil, err
	}
	ctxs := unsafe.Slice(list, int(n))
	var names []string
	var ctx *C.struct_ibv_context
	for _, c := range ctxs {
		dn := C.GoString(C.shim_dev_name(c))
		names = append(names, dn)
		if ctx == nil && (name == "" || dn == name) && allowed.allows(dn, 0) {
			ctx = c
		}
	}
	if ctx == nil {
		C.shim_rdma_free_devices(list)
		if len(names) == 0 {
			return nil, unusable("libibverbs found no usable device among kernel devices %v "+
				"(is the userspace provider driver installed, e.g. librxe-rdmav*.so from ibverbs-providers?)", deviceNames())
		}
		if name == "" {
			return nil, unusable("no RDMA device allowed by %s=%s (have %v)", DevicesEnv, allowed, names)
		}
		return nil, unusable("no RDMA device %q allowed by %s=%s (have %v)", name, DevicesEnv, allowed, names)
	}
	d, err := newDevice(ctx, list, len(ctxs))
	if err != nil {
		C.shim_rdma_free_devices(list)
		return nil, err
	}
	return d, nil
}

func devices() []string {
	var n C.int
	list := C.shim_rdma_get_devices(&n)
	if list == nil {
		return nil
	}
	defer C.shim_rdma_free_devices(list)
	var names []string
	for _, c := range unsafe.Slice(list, int(n)) {
		names = append(names, C.GoString(C.shim_dev_name(c)))
	}
	slices.Sort(names)
	return names
}
