//go:build !cgo

package verbs

import "github.com/rdmagrpc/rdmagrpc/transport"

// Built without cgo there is no way to call libibverbs: the provider
// registers, and says why it cannot work.
const cgoBuilt = false

var errNoCgo = unavailable("built without cgo (CGO_ENABLED=0): rebuild with cgo and a C compiler to use RDMA")

func load() error { return errNoCgo }

func open(string) (transport.Device, error) { return nil, errNoCgo }

func devices() []string { return nil }

func libLoaded() bool { return false }
