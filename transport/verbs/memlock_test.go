package verbs

import (
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// A registration refused by the memlock limit says the limit, what is
// locked and what was asked, and how to raise it; with no limit, nothing.
func TestMemlockHint(t *testing.T) {
	s := memlockText(64<<10, 48<<10, 512<<10)
	for _, want := range []string{"ulimit -l) is 64 KiB", "48 KiB of it locked already", "asks for 512 KiB more", "CAP_IPC_LOCK", "container"} {
		if !strings.Contains(s, want) {
			t.Errorf("hint %q lacks %q", s, want)
		}
	}
	if s := memlockText(unix.RLIM_INFINITY, 0, 1<<20); s != "" {
		t.Errorf("hint with no limit: %q", s)
	}
	if !memlockErrno(syscall.ENOMEM) || memlockErrno(syscall.EINVAL) {
		t.Error("memlockErrno: ENOMEM is the limit's errno, EINVAL is not")
	}
	if lockedBytes() < 0 {
		t.Error("VmLck not read from /proc/self/status")
	}
}
