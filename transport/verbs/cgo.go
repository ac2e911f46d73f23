package verbs

// libdl: dlopen lives there before glibc 2.34 (an empty stub after).

// #cgo LDFLAGS: -ldl
// #include "shim.h"
import "C"

import (
	"fmt"
	"sync"
	"syscall"
)

const cgoBuilt = true

// errNoCgo is only returned by binaries built without cgo (nocgo.go).
var errNoCgo error

var (
	loadOnce sync.Once
	loadErr  error
)

// load opens libibverbs and librdmacm once per process; every C call into
// them comes after a successful load (Open is the only way to a device).
func load() error {
	loadOnce.Do(func() {
		var msg [512]C.char
		if C.shim_load(&msg[0], C.size_t(len(msg))) != 0 {
			loadErr = unavailable("cannot load rdma-core: %s (install its libibverbs1 and librdmacm1 "+
				"packages, or put the libraries on the loader's path)", C.GoString(&msg[0]))
		}
	})
	return loadErr
}

func libLoaded() bool { return C.shim_loaded() != 0 }

// errnoErr turns an errno returned by the shim into a syscall.Errno
// (which errors.Is matches against fs and os sentinels).
func errnoErr(rc C.int) error {
	if rc == 0 {
		return nil
	}
	if rc < 0 {
		rc = -rc
	}
	return syscall.Errno(rc)
}

// opErr wraps a failed library call with the call's name.
func opErr(call string, rc C.int) error {
	if rc == 0 {
		return nil
	}
	return fmt.Errorf("verbs: %s: %w", call, errnoErr(rc))
}

// errnoNow reports C errno after a call that returned NULL.
func errnoNow(err error) error {
	if err == nil {
		return syscall.EIO
	}
	return err
}
