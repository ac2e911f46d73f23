// Command regmr is the harness's own check that a cgo program linked
// against libibverbs runs in the guest: it opens rxe0, registers a buffer
// and prints the keys. It exits non-zero on any failure.
package main

/*
#cgo LDFLAGS: -libverbs
#include <stdlib.h>
#include <infiniband/verbs.h>

// ibv_reg_mr is a macro over an inline function in rdma-core 44: wrap it.
static struct ibv_mr *regmr_reg(struct ibv_pd *pd, void *buf, size_t len) {
	return ibv_reg_mr(pd, buf, len,
		IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
}
*/
import "C"

import (
	"fmt"
	"os"
	"unsafe"
)

func main() {
	if err := run(os.Getenv("RXE_DEV"), 1<<20); err != nil {
		fmt.Fprintln(os.Stderr, "regmr:", err)
		os.Exit(1)
	}
}

func run(want string, size int) error {
	var n C.int
	list := C.ibv_get_device_list(&n)
	if list == nil {
		return fmt.Errorf("ibv_get_device_list failed")
	}
	defer C.ibv_free_device_list(list)
	devs := unsafe.Slice(list, int(n))
	var dev *C.struct_ibv_device
	for _, d := range devs {
		if want == "" || C.GoString(C.ibv_get_device_name(d)) == want {
			dev = d
			break
		}
	}
	if dev == nil {
		return fmt.Errorf("device %q not among %d devices", want, n)
	}
	ctx := C.ibv_open_device(dev)
	if ctx == nil {
		return fmt.Errorf("ibv_open_device failed")
	}
	defer C.ibv_close_device(ctx)
	pd := C.ibv_alloc_pd(ctx)
	if pd == nil {
		return fmt.Errorf("ibv_alloc_pd failed")
	}
	defer C.ibv_dealloc_pd(pd)
	buf := C.malloc(C.size_t(size))
	if buf == nil {
		return fmt.Errorf("malloc failed")
	}
	defer C.free(buf)
	mr := C.regmr_reg(pd, buf, C.size_t(size))
	if mr == nil {
		return fmt.Errorf("ibv_reg_mr of %d bytes failed", size)
	}
	fmt.Printf("regmr: registered %d bytes on %s lkey=%#x rkey=%#x\n", size,
		C.GoString(C.ibv_get_device_name(dev)), uint32(mr.lkey), uint32(mr.rkey))
	if rc := C.ibv_dereg_mr(mr); rc != 0 {
		return fmt.Errorf("ibv_dereg_mr: %d", rc)
	}
	fmt.Println("regmr: ok")
	return nil
}
