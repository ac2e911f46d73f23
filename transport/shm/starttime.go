package shm

import (
	"bytes"
	"errors"
	"os"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// A peer process is named by its pid and start time (peerID). Reading the
// start time from /proc/PID/stat cost about 25 µs per connection end, a
// tenth of a dial's CPU, so it is read once per peer process and kept
// with a pidfd of that process: while the pidfd says the process has not
// been reaped, its pid cannot name another one, and asking costs one
// system call.
var startTimes = struct {
	sync.Mutex
	m map[int]cachedStart
}{m: map[int]cachedStart{}}

type cachedStart struct {
	start uint64
	fd    int // pidfd of the process start was read for
}

// maxCachedStarts bounds the descriptors the cache holds; the entries of
// gone processes are dropped first.
const maxCachedStarts = 1024

// startTime is field 22 of /proc/PID/stat, 0 when unreadable.
func startTime(pid int) uint64 {
	startTimes.Lock()
	defer startTimes.Unlock()
	if e, ok := startTimes.m[pid]; ok {
		if running(e.fd) {
			return e.start
		}
		unix.Close(e.fd)
		delete(startTimes.m, pid)
	}
	// The pidfd first: if the process still runs once its start time is
	// read, that start time is the pidfd's process's.
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return readStartTime(pid) // no pidfds (before Linux 5.3), or gone
	}
	start := readStartTime(pid)
	if start == 0 || !running(fd) {
		unix.Close(fd)
		return start
	}
	if len(startTimes.m) >= maxCachedStarts {
		for p, e := range startTimes.m {
			if !running(e.fd) {
				unix.Close(e.fd)
				delete(startTimes.m, p)
			}
		}
	}
	if len(startTimes.m) >= maxCachedStarts {
		unix.Close(fd)
		return start
	}
	startTimes.m[pid] = cachedStart{start: start, fd: fd}
	return start
}

// running reports whether the process of pidfd fd has not been reaped:
// signal 0 checks without signalling (EPERM: it exists, we may not
// signal it).
func running(fd int) bool {
	err := unix.PidfdSendSignal(fd, 0, nil, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}

func readStartTime(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := bytes.Fields(b[i+1:]) // field 3 on
	if len(f) < 20 {
		return 0
	}
	n, _ := strconv.ParseUint(string(f[19]), 10, 64)
	return n
}
