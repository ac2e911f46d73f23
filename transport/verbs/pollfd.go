package verbs

// #include "shim.h"
import "C"

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/internal/logx"
)

// pollFD puts a library-owned file descriptor (completion channel,
// rdma_cm event channel, async event fd) into Go's netpoller. The library
// keeps its own descriptor and closes it itself; we poll a duplicate, which
// shares the open file description and so its O_NONBLOCK flag and its
// readiness.
type pollFD struct {
	f  *os.File
	rc syscall.RawConn
}

func newPollFD(fd C.int, name string) (*pollFD, error) {
	if rc := C.shim_set_nonblock(fd); rc != 0 {
		return nil, opErr("fcntl(O_NONBLOCK) on "+name, rc)
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("verbs: dup %s: %w", name, err)
	}
	f := os.NewFile(uintptr(dup), name)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("verbs: %s: %w", name, err)
	}
	return &pollFD{f: f, rc: rc}, nil
}

// read calls try until it returns something other than EAGAIN, sleeping
// in the netpoller in between. It returns try's result, or the poller's
// error (deadline, closed file).
func (p *pollFD) read(try func() C.int) (C.int, error) {
	var rc C.int
	err := p.rc.Read(func(uintptr) bool {
		rc = try()
		return rc != C.EAGAIN
	})
	return rc, err
}

// serve is the body of the goroutines that read a library's event
// channel: it calls try until the descriptor is closed and handle after
// every event try took; EINTR is tried again, any other error ends the
// loop, logged under what.
func (p *pollFD) serve(what string, try func() C.int, handle func()) {
	for {
		rc, err := p.read(try)
		if err != nil {
			return // closed by the channel's owner
		}
		if rc != 0 {
			if errors.Is(errnoErr(rc), errInterrupted) {
				continue
			}
			logx.L().Error("rdmagrpc verbs: event loop stops", "loop", what, "err", errnoErr(rc))
			return
		}
		handle()
	}
}

// aLongTimeAgo is a deadline in the past: setting it wakes a blocked read.
var aLongTimeAgo = time.Unix(1, 0)

// readCtx is read honouring ctx. Only one readCtx may run at a time on a
// pollFD (callers serialise), because deadlines belong to the file.
func (p *pollFD) readCtx(ctx context.Context, try func() C.int) (C.int, error) {
	dl, hasDL := ctx.Deadline()
	for {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		if err := p.f.SetReadDeadline(dl); err != nil { // zero dl clears it
			return 0, err
		}
		var rc C.int
		var err error
		if ctx.Done() == nil {
			rc, err = p.read(try)
		} else {
			fired := make(chan struct{})
			stop := context.AfterFunc(ctx, func() {
				defer close(fired)
				p.f.SetReadDeadline(aLongTimeAgo)
			})
			rc, err = p.read(try)
			if !stop() {
				// The AfterFunc has started: let it finish so that
				// its deadline cannot leak into the next read.
				<-fired
			}
		}
		if err == nil {
			return rc, nil
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return 0, err
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		if hasDL && !time.Now().Before(dl) {
			return 0, context.DeadlineExceeded
		}
		// A stale wake-up: loop with the deadline restored.
	}
}

func (p *pollFD) close() error { return p.f.Close() }
