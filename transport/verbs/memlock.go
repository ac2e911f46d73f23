package verbs

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Registration pins memory, and a process without CAP_IPC_LOCK may pin
// only up to its RLIMIT_MEMLOCK (often 64 KiB or 8 MiB by default, less
// in containers): past it ibv_reg_mr fails with ENOMEM (or EPERM, EAGAIN
// on some kernels), which says nothing of the limit. memlockHint says
// what the limit is, what is locked already and what was asked for, so
// the error names its fix.

// memlockErrno says err is how ibv_reg_mr reports a memlock limit.
func memlockErrno(err error) bool {
	return errors.Is(err, syscall.ENOMEM) || errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EAGAIN)
}

// memlockHint explains a registration of size bytes refused by the
// memlock limit; "" when there is no limit to blame.
func memlockHint(size int) string {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		return ""
	}
	return memlockText(lim.Cur, lockedBytes(), size)
}

// memlockText is memlockHint's sentence for a limit of limit bytes (the
// soft one), locked bytes locked already (-1: unknown) and size asked.
func memlockText(limit uint64, locked int64, size int) string {
	if limit == unix.RLIM_INFINITY {
		return ""
	}
	have := ""
	if locked >= 0 {
		have = fmt.Sprintf(", %s of it locked already", kib(uint64(locked)))
	}
	return fmt.Sprintf("the memlock limit (ulimit -l) is %s%s, and this registration asks for %s more: "+
		"raise it (rdmagrpc pins 8 KiB per idle connection and side, 520 KiB per enlarged direction, 2 MiB more in its deepest phase, and up to 12 MiB per rendezvous transfer), "+
		"or give the process CAP_IPC_LOCK; in a container, set the memlock ulimit of the container runtime or the pod",
		kib(limit), have, kib(uint64(size)))
}

func kib(b uint64) string { return strconv.FormatUint(b>>10, 10) + " KiB" }

// lockedBytes is VmLck of this process: what it has locked (pinned
// registrations count there), or -1.
func lockedBytes() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return -1
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmLck:"); ok {
			if f := strings.Fields(v); len(f) > 0 {
				if n, err := strconv.ParseInt(f[0], 10, 64); err == nil {
					return n << 10
				}
			}
		}
	}
	return -1
}
