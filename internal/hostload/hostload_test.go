package hostload

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	b := []byte("cpu  100 5 50 1000 7 1 2 3 40 0\ncpu0 50 2 25 500 3 0 1 1 0 0\ncpu1 50 3 25 500 4 1 1 2 0 0\nintr 1 2 3\n")
	busy, cpus, ok := parseStat(b)
	// user+nice+steal; the kernel's times, idle, iowait and the guest
	// times (already in user) are not.
	if !ok || busy != 100+5+3 || cpus != 2 {
		t.Fatalf("parseStat = %d, %d, %v", busy, cpus, ok)
	}
	for _, bad := range []string{"", "intr 1 2\n", "cpu  1 2 x 4 5\ncpu0 1\n", "cpu  1 2\n"} {
		if _, _, ok := parseStat([]byte(bad)); ok {
			t.Errorf("parseStat(%q) accepted", bad)
		}
	}
}

func TestParseProcStat(t *testing.T) {
	// The command may hold spaces and parentheses.
	b := []byte("4242 (a (b) c) R 1 1 1 0 -1 4194304 10 0 0 0 123 45 0 0 20 0 3 0 99 0 0\n")
	if v, ok := parseProcStat(b); !ok || v != 123 {
		t.Fatalf("parseProcStat = %d, %v, want 123 (utime)", v, ok)
	}
	for _, bad := range []string{"", "1 (x R 1", "1 (x) R 1 2 3", "1 (x) R 1 1 1 0 -1 0 0 0 0 0 u s"} {
		if _, ok := parseProcStat([]byte(bad)); ok {
			t.Errorf("parseProcStat(%q) accepted", bad)
		}
	}
}

// fakeHost is a /proc of two processors, a peer (pid 7) and this
// process's CPU time, each set by the test between samples.
type fakeHost struct {
	t    *testing.T
	dir  string
	host uint64 // user ticks
	sys  uint64 // the kernel's ticks: system and softirq
	peer uint64 // ticks
	self int64  // µs
}

func newFakeHost(t *testing.T) *fakeHost {
	f := &fakeHost{t: t, dir: t.TempDir()}
	if err := os.Mkdir(filepath.Join(f.dir, "7"), 0o755); err != nil {
		t.Fatal(err)
	}
	f.write()
	return f
}

func (f *fakeHost) write() {
	stat := fmt.Sprintf("cpu  %d 0 %d 5000 0 0 %d 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n", f.host, f.sys/2, f.sys-f.sys/2)
	peer := fmt.Sprintf("7 (peer) S 1 1 1 0 -1 0 0 0 0 0 %d 0 0 0 20 0 1 0 1 0 0\n", f.peer)
	for name, s := range map[string]string{"stat": stat, "7/stat": peer} {
		if err := os.WriteFile(filepath.Join(f.dir, name), []byte(s), 0o644); err != nil {
			f.t.Fatal(err)
		}
	}
}

func TestBusyCountsStrangersOnly(t *testing.T) {
	f := newFakeHost(t)
	var st shared
	st.s = sampler{procFS: f.dir, selfFn: func() int64 { return f.self }}
	st.peers = map[int]*peerClock{}
	now := time.Now().UnixNano()
	if st.sample(now) {
		t.Fatal("a first sample, with nothing to compare, said busy")
	}
	// st.s.hostFD was opened on the first sample: the file is read
	// again at offset 0 each time, as /proc/stat is.
	step := func(host, self, peer uint64, withPeer bool) bool {
		t.Helper()
		f.host += host
		f.self += int64(self) * 10_000 // ticks of 10 ms
		f.peer += peer
		f.write()
		if withPeer && st.peers[7] == nil {
			st.peers[7] = &peerClock{refs: 1, ticks: f.peer - peer, ok: true}
		}
		if !withPeer {
			delete(st.peers, 7)
		}
		now += int64(Window) // 10 ticks of each of two processors
		return st.sample(now)
	}
	// Both ends spinning on two processors: the host is full, of us.
	if step(20, 10, 10, true) {
		t.Error("this process and its peer alone made the host busy")
	}
	// A stranger takes one processor; ours share the other.
	if !step(20, 5, 5, true) {
		t.Error("a CPU-bound stranger on one of two processors: not busy")
	}
	// A stranger takes a third of one: one and two thirds left.
	if step(14, 5, 5, true) {
		t.Error("a stranger using a third of a processor made the host busy")
	}
	// Kernel workers busy with the connections' own traffic (Soft-RoCE
	// runs the RDMA transport in them) take a whole processor: theirs is
	// kernel time, which a stranger's CPU-bound loop is not.
	f.sys += 10
	if step(10, 5, 5, true) {
		t.Error("kernel time, outside any process, made the host busy")
	}
	// A peer it cannot see (not added) counts as a stranger.
	if !step(20, 10, 10, false) {
		t.Error("a peer not registered was counted as ours")
	}
}

// A busy host turns idle again only after idleWindows idle windows in a
// row: a CPU-bound neighbour that got less than half a processor in one
// window (squeezed by this process and its peer) is still there. A
// neighbour that all but stopped makes it idle at once.
func TestBusyHoldsUntilIdleWindows(t *testing.T) {
	f := newFakeHost(t)
	var st shared
	st.s = sampler{procFS: f.dir, selfFn: func() int64 { return f.self }}
	st.peers = map[int]*peerClock{}
	now := time.Now().UnixNano()
	st.busy.Store(st.verdict(st.sample(now)))
	// Each window: 10 ticks of each of two processors; ours take 10 of
	// them, 5 this process's and 5 its peer's, the stranger strangerTicks.
	window := func(strangerTicks uint64) bool {
		t.Helper()
		f.host += strangerTicks + 10
		f.self += 5 * 10_000
		f.peer += 5
		f.write()
		if st.peers[7] == nil {
			st.peers[7] = &peerClock{refs: 1, ticks: f.peer - 5, ok: true}
		}
		now += int64(Window)
		st.busy.Store(st.verdict(st.sample(now)))
		return st.busy.Load()
	}
	if window(0) {
		t.Fatal("no stranger: busy")
	}
	if !window(10) {
		t.Fatal("a stranger on one of two processors: not busy")
	}
	// Four tenths of a processor: an idle window, were it alone.
	if !window(4) {
		t.Fatal("busy host idle after one window in which the stranger got four tenths of a processor")
	}
	for i := 1; i < idleWindows-1; i++ {
		if !window(4) {
			t.Fatalf("busy host idle after %d windows in which the stranger got four tenths of a processor", i+1)
		}
	}
	if window(4) {
		t.Fatalf("still busy after %d idle windows in a row", idleWindows)
	}
	if !window(10) {
		t.Fatal("the stranger back: not busy")
	}
	if window(1) {
		t.Fatal("a stranger down to a tenth of a processor: still busy")
	}
}

// A host of many processors: /proc/stat's cpuN lines pass the first
// read's buffer, and every one is counted.
func TestManyProcessors(t *testing.T) {
	dir := t.TempDir()
	var b strings.Builder
	b.WriteString("cpu  100 0 0 5000 0 0 0 0 0 0\n")
	for i := range 256 {
		fmt.Fprintf(&b, "cpu%d 1 0 0 20 0 0 0 0 0 0\n", i)
	}
	b.WriteString("intr 1 2 3\n")
	if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	s := sampler{procFS: dir}
	if busy, cpus, ok := s.hostTicks(); !ok || busy != 100 || cpus != 256 {
		t.Fatalf("hostTicks = %d, %d, %v: want 100 busy ticks on 256 processors", busy, cpus, ok)
	}
}

func TestBusyUnreadable(t *testing.T) {
	var st shared
	st.s = sampler{procFS: filepath.Join(t.TempDir(), "none")}
	for range 3 {
		if st.sample(time.Now().UnixNano()) {
			t.Fatal("busy without a /proc to read")
		}
	}
}

func TestForce(t *testing.T) {
	restore := Force(true)
	if !Busy() {
		t.Error("Force(true): not busy")
	}
	inner := Force(false)
	if Busy() {
		t.Error("Force(false): busy")
	}
	inner()
	if !Busy() {
		t.Error("restore did not bring Force(true) back")
	}
	restore()
}

// TestSampleThisHost reads the real /proc and getrusage.
func TestSampleThisHost(t *testing.T) {
	if _, err := os.Stat("/proc/stat"); err != nil {
		t.Skip("no /proc/stat here:", err)
	}
	var st shared
	st.sample(time.Now().UnixNano())
	if !st.s.have || st.s.host == 0 {
		t.Fatalf("no sample taken from /proc/stat: %+v", st.s)
	}
	AddPeer(os.Getpid())
	defer DropPeer(os.Getpid())
	state.mu.Lock()
	p := state.peers[os.Getpid()]
	state.mu.Unlock()
	if p == nil || !p.ok {
		t.Fatalf("AddPeer could not read /proc/%d/stat", os.Getpid())
	}
}
