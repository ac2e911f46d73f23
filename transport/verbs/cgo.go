package verbs

// #cgo LDFLAGS: -libverbs -lrdmacm
// #include "shim.h"
import "C"

import (
	"fmt"
	"syscall"
)

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
