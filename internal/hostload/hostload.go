// Package hostload tells whether the host's processors are taken by
// processes other than this one and its peers on the host, which is when
// a thread that spins waiting for a peer costs more than it saves.
//
// Spinning pays while a processor is free: it saves a wake-up, and the
// peer it waits for runs on another processor. On a host whose processors
// are taken (a CPU-bound neighbour, a build, another service's burst) a
// spinning thread is a CPU-bound task to the scheduler: it takes turns
// with the neighbour and with the very peer it waits for, and the answer
// comes later than a sleeping thread would have seen it, since a thread
// woken from sleep preempts a CPU-bound one.
//
// The signals Linux offers host-wide (CPU pressure, the run queue, load
// averages) count this process's spinning threads and its peer's, which
// take a processor each on an idle host too, as load. So the count here
// is of what strangers use: the host's user time (/proc/stat) less this
// process's (getrusage) less that of the local peer processes its
// connections registered (AddPeer; /proc/PID/stat), over a window of
// Window. The host is busy while the strangers leave fewer than 1.5
// processors free: one for a spinning thread, and half of one for the
// rest of this process and its peer.
//
// Kernel time is left out, the host's and the processes' alike. Much of
// it on a host running connections is their own traffic's, done outside
// any of their threads: softirqs of the network stack, and with
// Soft-RoCE the whole RDMA transport, run by kernel workers. Counted as a
// stranger's, it made the host of a busy verbs connection look busy, and
// the connection stopped spinning because of its own traffic. What a
// CPU-bound neighbour takes is user time; a hypervisor's other guests
// show as steal, which counts.
//
// What strangers use is not what they want: a neighbour that shares a
// processor with spinning threads gets less of it, and the next window
// counts less of it. So a busy host becomes idle again only after
// idleWindows windows in a row say so, windows in which nothing here
// spun (Busy said busy throughout) and the count is fair, unless the
// strangers all but stopped (under a quarter of a processor: a burst
// that ended, not a neighbour held back). Without that, one window in
// which a CPU-bound neighbour happened to get little (two busy processes
// and it on two processors) let both ends of a gRPC pair spin, which
// squeezed the neighbour further and kept the count low: the pair spun
// through about a twentieth of its quiet periods.
//
// A peer whose pid this process cannot see (another PID namespace) is
// counted as a stranger: while it works hard, its peers here stop
// spinning, which costs them wake-ups, not correctness. Where /proc
// cannot be read the host counts as idle.
package hostload

import (
	"bytes"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Window is how often the host is sampled, by whichever caller of Busy
// finds the last sample that old: its readings cost some tens of µs.
const Window = 100 * time.Millisecond

// freeWanted is the processors, ×4, that must be left free by strangers
// for spinning to pay.
const freeWanted = 6

// idleWindows is how many idle windows in a row make a busy host idle,
// unless the strangers used under faintX4 processors (×4) in the last.
const (
	idleWindows = 3
	faintX4     = 1
)

// clkTck is USER_HZ, the unit of /proc's CPU times: 100 on every Linux
// architecture Go supports.
const clkTck = 100

var state shared

// epoch starts the monotonic clock of the samples.
var epoch = time.Now()

type shared struct {
	forced atomic.Int32 // Force: 0 none, 1 idle, 2 busy
	busy   atomic.Bool
	at     atomic.Int64 // of the last sample: ns since epoch (monotonic)

	mu    sync.Mutex // held by the one sampling, and by AddPeer/DropPeer
	s     sampler
	peers map[int]*peerClock
	idle  int  // idle windows in a row since the last busy one
	faint bool // the strangers used under faintX4 in the last window
}

type peerClock struct {
	refs  int
	ticks uint64 // at the last sample, or at AddPeer
	ok    bool
}

// Busy reports whether strangers left too few processors free in the
// last Window. It is cheap: an atomic load, and a sample when the last
// one is older than Window (one caller samples, the others go on).
func Busy() bool {
	if f := state.forced.Load(); f != 0 {
		return f == 2
	}
	// One monotonic clock read: Busy is asked at every round of a spin,
	// and time.Now also reads the wall clock, which nothing here needs.
	now := int64(time.Since(epoch))
	if at := state.at.Load(); now-at >= int64(Window) && state.mu.TryLock() {
		if state.at.Load() == at {
			state.at.Store(now)
			state.busy.Store(state.verdict(state.sample(now)))
		}
		state.mu.Unlock()
	}
	return state.busy.Load()
}

// verdict is Busy's answer after a window that was busy or not (sample):
// busy from the first busy window, idle again after idleWindows idle
// ones in a row, or one in which the strangers were faint. state.mu is
// held.
func (st *shared) verdict(busy bool) bool {
	if busy || st.faint {
		st.idle = 0
		return busy
	}
	st.idle++
	return st.busy.Load() && st.idle < idleWindows
}

// AddPeer counts pid's CPU time as this process's own: it is the other
// end of a connection on this host. Each AddPeer is matched by a DropPeer.
func AddPeer(pid int) {
	if pid <= 0 {
		return
	}
	state.mu.Lock()
	defer state.mu.Unlock()
	if state.peers == nil {
		state.peers = map[int]*peerClock{}
	}
	p := state.peers[pid]
	if p == nil {
		p = &peerClock{}
		p.ticks, p.ok = state.s.procTicks(pid)
		state.peers[pid] = p
	}
	p.refs++
}

// DropPeer undoes an AddPeer.
func DropPeer(pid int) {
	state.mu.Lock()
	defer state.mu.Unlock()
	if p := state.peers[pid]; p != nil {
		if p.refs--; p.refs <= 0 {
			delete(state.peers, pid)
		}
	}
}

// sample takes a reading and reports whether the window since the last
// one was busy. state.mu is held.
func (st *shared) sample(now int64) bool {
	s := &st.s
	host, cpus, ok := s.hostTicks()
	if !ok {
		return false
	}
	self := s.selfUS()
	var peers uint64
	for pid, p := range st.peers {
		t, ok := s.procTicks(pid)
		if ok && p.ok && t >= p.ticks {
			peers += t - p.ticks
		}
		p.ticks, p.ok = t, ok
	}
	busy := false
	if s.have && now > s.at && host >= s.host {
		window := float64(now-s.at) / 1e9 * clkTck // ticks of one processor
		ours := float64(self-s.self)/1e6*clkTck + float64(peers)
		strangers := float64(host-s.host) - ours
		free := float64(cpus) - strangers/window
		busy = free*4 < freeWanted
		st.faint = strangers/window*4 < faintX4
	}
	s.have, s.at, s.host, s.self = true, now, host, self
	return busy
}

// sampler reads the host's, this process's and the peers' user time; its
// zero value reads /proc and getrusage.
type sampler struct {
	procFS string       // "": /proc
	selfFn func() int64 // nil: this process's user time, µs (getrusage)
	hostFD int          // procFS/stat, open once; -1: unreadable
	opened bool
	buf    []byte

	// The last reading.
	have bool
	at   int64  // ns, on the caller's clock
	host uint64 // busy ticks, every processor
	self int64  // µs
}

func (s *sampler) root() string {
	if s.procFS == "" {
		return "/proc"
	}
	return s.procFS
}

// hostTicks reads the busy ticks of every processor, and their count.
func (s *sampler) hostTicks() (uint64, int, bool) {
	if !s.opened {
		s.opened = true
		fd, err := syscall.Open(s.root()+"/stat", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			fd = -1
		}
		s.hostFD = fd
	}
	if s.hostFD < 0 {
		return 0, 0, false
	}
	if s.buf == nil {
		s.buf = make([]byte, 4096)
	}
	for {
		n, err := syscall.Pread(s.hostFD, s.buf, 0)
		if err != nil || n <= 0 {
			return 0, 0, false
		}
		// The cpuN lines, one per processor, must all be in: on a host
		// of more than some sixty processors they pass 4 KiB.
		if n < len(s.buf) || len(s.buf) >= 1<<20 {
			return parseStat(s.buf[:n])
		}
		s.buf = make([]byte, 2*len(s.buf))
	}
}

// parseStat reads /proc/stat's first line ("cpu  user nice system idle
// iowait irq softirq steal ...") into busy ticks (user, nice and steal:
// steal is time this host's processors were not ours; the kernel's
// fields are left out, see the package doc), and counts the "cpuN" lines
// that follow (in the part of the file given).
func parseStat(b []byte) (busy uint64, cpus int, ok bool) {
	line, rest, _ := bytes.Cut(b, []byte{'\n'})
	f := bytes.Fields(line)
	if len(f) < 5 || string(f[0]) != "cpu" {
		return 0, 0, false
	}
	for i, v := range f[1:] {
		if i >= 8 { // guest and guest_nice are inside user and nice already
			break
		}
		n, err := strconv.ParseUint(string(v), 10, 64)
		if err != nil {
			return 0, 0, false
		}
		if i == 0 || i == 1 || i == 7 { // user, nice, steal
			busy += n
		}
	}
	for len(rest) > 0 {
		var l []byte
		l, rest, _ = bytes.Cut(rest, []byte{'\n'})
		if !bytes.HasPrefix(l, []byte("cpu")) {
			break
		}
		cpus++
	}
	return busy, cpus, cpus > 0
}

// procTicks reads pid's user time, in ticks.
func (s *sampler) procTicks(pid int) (uint64, bool) {
	b, err := os.ReadFile(s.root() + "/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	return parseProcStat(b)
}

// parseProcStat reads utime (field 14) out of /proc/PID/stat, whose
// second field (the command, in parentheses) may hold spaces and
// parentheses of its own.
func parseProcStat(b []byte) (uint64, bool) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state): utime is field 14.
	if len(f) < 13 {
		return 0, false
	}
	u, err := strconv.ParseUint(string(f[11]), 10, 64)
	if err != nil {
		return 0, false
	}
	return u, true
}

func (s *sampler) selfUS() int64 {
	if s.selfFn != nil {
		return s.selfFn()
	}
	return rusageUS()
}

func rusageUS() int64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return ru.Utime.Nano() / 1e3
}

// Force makes Busy report busy, or not, whatever the host does, until
// restore is called: for tests of what callers do on a busy host.
func Force(busy bool) (restore func()) {
	v := int32(1)
	if busy {
		v = 2
	}
	prev := state.forced.Swap(v)
	return func() { state.forced.Store(prev) }
}
