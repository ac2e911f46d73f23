package bpf

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

type tally struct{ ok, failed int }

func countByFunc(evs []Event) map[string]*tally {
	m := map[string]*tally{}
	for _, ev := range evs {
		c := m[ev.Func]
		if c == nil {
			c = &tally{}
			m[ev.Func] = c
		}
		if ev.OK {
			c.ok++
		} else {
			c.failed++
		}
	}
	return m
}

func checkStats(t *testing.T, tr *Tracer, wantEvents int) {
	t.Helper()
	st, err := tr.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Events != uint64(wantEvents) || st.Lost != 0 || st.NoEntry != 0 || st.EntryDropped != 0 {
		t.Errorf("kernel stats = %+v, want %d events and no losses", st, wantEvents)
	}
}

// Go probes: exact counts with goroutines that park inside regMR (and so
// may return on another thread), one filtered PID and a second, unwatched
// process doing the same work at the same time.
func TestGoProbesExactCounts(t *testing.T) {
	requireRoot(t)
	dir := helpers(t)
	bin := filepath.Join(dir, "goreg")
	const gs, n, fail, enl = 4, 25, 3, 5
	args := []string{"-g", "4", "-n", "25", "-fail", "3", "-enlarge", "5", "-park", "50us", "-size", "8192"}
	tg := startTarget(t, bin, args...)
	other := startTarget(t, bin, args...)

	tr, err := Open(Options{PID: tg.cmd.Process.Pid})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	got, err := tr.AttachGoFuncs(bin, asMain(KnownGoFuncs))
	if err != nil {
		t.Fatalf("AttachGoFuncs: %v", err)
	}
	if len(got) != 3 {
		t.Fatalf("attached %v, want 3 functions", got)
	}
	other.run(t)
	tg.run(t)
	evs := drain(t, tr)

	c := countByFunc(evs)
	want := map[string]tally{
		"main.regMR":             {ok: gs * n, failed: gs * fail},
		"main.deregMR":           {ok: gs * n},
		"main.enlargementMarker": {ok: gs * enl},
	}
	for fn, w := range want {
		if g := c[fn]; g == nil || *g != w {
			t.Errorf("%s: got %+v, want %+v", fn, g, w)
		}
	}
	if len(evs) != gs*(2*n+fail+enl) {
		t.Errorf("got %d events, want %d", len(evs), gs*(2*n+fail+enl))
	}
	conns := map[uint64]bool{}
	tids := map[uint32]bool{}
	moved := 0
	for _, ev := range evs {
		if ev.PID != uint32(tg.cmd.Process.Pid) {
			t.Fatalf("event from pid %d, want only %d: %+v", ev.PID, tg.cmd.Process.Pid, ev)
		}
		tids[ev.TID] = true
		if ev.EntryTID != ev.TID {
			moved++
		}
		switch {
		case ev.Kind == KindRegister && ev.OK:
			if ev.Length != 8192 || ev.Access != 7 || ev.Addr == 0 || ev.Duration < 50*time.Microsecond {
				t.Errorf("register event %+v: want 8192 bytes, access 7, ≥50µs", ev)
			}
		case ev.Kind == KindRegister:
			if ev.Length != 0 || ev.Result != 22 {
				t.Errorf("failed register event %+v: want length 0, errno 22", ev)
			}
		case ev.Kind == KindDeregister:
			if ev.Length != 8192 || !ev.OK {
				t.Errorf("deregister event %+v", ev)
			}
		case ev.Kind == KindEnlargement:
			conns[ev.ConnID] = true
			idx := ev.ConnID & 0xffffffff
			if ev.FromSize != 1024 || ev.ToSize != 65536 || ev.Outcome != 1 ||
				ev.EnlargeDuration != time.Duration(1500+idx) {
				t.Errorf("enlargement event %+v", ev)
			}
		}
		if ev.Comm != "goreg" {
			t.Errorf("comm %q, want goreg", ev.Comm)
		}
	}
	if len(conns) != gs*enl {
		t.Errorf("%d distinct connection ids, want %d", len(conns), gs*enl)
	}
	t.Logf("%d events from %d threads; %d calls returned on another thread than they entered", len(evs), len(tids), moved)
	checkStats(t, tr, len(evs))
}

// C probes on a stand-in library with libibverbs' signatures and symbol
// versions: uprobe + uretprobe, default versions only.
func TestLibProbesExactCounts(t *testing.T) {
	requireRoot(t)
	dir := cHelpers(t)
	lib := filepath.Join(dir, "libfakeverbs.so")
	const n, fail, dmabuf, rereg, compat = 20, 3, 4, 5, 6
	tg := startTarget(t, filepath.Join(dir, "fvdriver"), "20", "3", "4", "5", "6")

	tr, err := Open(Options{PID: tg.cmd.Process.Pid})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	if err := tr.AttachLibibverbs(lib); err != nil {
		t.Fatalf("AttachLibibverbs: %v", err)
	}
	tg.run(t)
	evs := drain(t, tr)

	c := countByFunc(evs)
	want := map[string]tally{
		"ibv_reg_mr_iova2":  {ok: n, failed: fail},
		"ibv_reg_dmabuf_mr": {ok: dmabuf},
		"ibv_rereg_mr":      {ok: rereg},
		"ibv_dereg_mr":      {ok: n + dmabuf}, // the compat version's calls are not counted
	}
	for fn, w := range want {
		if g := c[fn]; g == nil || *g != w {
			t.Errorf("%s: got %+v, want %+v", fn, g, w)
		}
	}
	if len(evs) != n+fail+dmabuf+rereg+n+dmabuf {
		t.Errorf("got %d events, want %d", len(evs), n+fail+dmabuf+rereg+n+dmabuf)
	}
	var dereg4k, dereg8k, dereg2k int
	for _, ev := range evs {
		switch ev.Func {
		case "ibv_reg_mr_iova2":
			if ev.OK && (ev.Length != 4096 || ev.Access != 7 || ev.LKey == 0 || ev.RKey == 0) {
				t.Errorf("reg event %+v", ev)
			}
		case "ibv_reg_dmabuf_mr":
			if ev.Length != 2048 || ev.Addr != 0x1000 || ev.Access != 1 {
				t.Errorf("dmabuf event %+v", ev)
			}
		case "ibv_rereg_mr":
			if ev.PrevLength != 4096 || ev.Length != 8192 {
				t.Errorf("rereg event %+v", ev)
			}
		case "ibv_dereg_mr":
			switch ev.Length {
			case 4096:
				dereg4k++
			case 8192:
				dereg8k++
			case 2048:
				dereg2k++
			}
		}
	}
	if dereg4k != n-rereg || dereg8k != rereg || dereg2k != dmabuf {
		t.Errorf("dereg lengths: 4k %d, 8k %d, 2k %d; want %d, %d, %d", dereg4k, dereg8k, dereg2k, n-rereg, rereg, dmabuf)
	}
	checkStats(t, tr, len(evs))
}

// The real libibverbs.so.1 of this host: all four entry points attach at
// their default-version addresses, system wide.
func TestAttachRealLibibverbs(t *testing.T) {
	requireRoot(t)
	lib, err := FindLibibverbs(0)
	if err != nil {
		t.Skipf("skipping: %v", err)
	}
	tr, err := Open(Options{})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	if err := tr.AttachLibibverbs(lib); err != nil {
		t.Fatalf("AttachLibibverbs(%s): %v", lib, err)
	}
	if got := tr.Attached(); len(got) != 4 {
		t.Fatalf("attached %v, want 4 functions", got)
	}
	t.Logf("attached %v", tr.Attached())
}

func TestReadAfterClose(t *testing.T) {
	requireRoot(t)
	tr, err := Open(Options{})
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { _, err := tr.Read(); errc <- err }()
	time.Sleep(50 * time.Millisecond) // fixed: Read must be blocked, a state it does not show
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err != ErrClosed {
			t.Fatalf("Read after Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Read still blocked 5s after Close")
	}
}

// The real shm provider: registrations through transport.PD.RegMR reach
// the provider's regMR/deregMR probe points exactly once each.
func TestShmProviderExactCounts(t *testing.T) {
	requireRoot(t)
	bin := shmHelper(t)
	const n, fail, size = 40, 7, 1 << 16
	tg := startTarget(t, bin, "-n", "40", "-fail", "7", "-size", "65536")

	tr, err := Open(Options{PID: tg.cmd.Process.Pid})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	got, err := tr.AttachGoFuncs(bin, KnownGoFuncs)
	if err != nil {
		t.Fatalf("AttachGoFuncs: %v", err)
	}
	if len(got) != 2 {
		t.Fatalf("attached %v, want shm regMR and deregMR", got)
	}
	tg.run(t)
	evs := drain(t, tr)

	c := countByFunc(evs)
	want := map[string]tally{
		Module + "/transport/shm.regMR":   {ok: n, failed: fail},
		Module + "/transport/shm.deregMR": {ok: n},
	}
	for fn, w := range want {
		if g := c[fn]; g == nil || *g != w {
			t.Errorf("%s: got %+v, want %+v", fn, g, w)
		}
	}
	if len(evs) != 2*n+fail {
		t.Errorf("got %d events, want %d", len(evs), 2*n+fail)
	}
	for _, ev := range evs {
		if ev.Length != size || ev.Addr == 0 {
			t.Errorf("event %+v: want a %d-byte region", ev, size)
		}
		if ev.Kind == KindRegister && ev.OK && (ev.Access != 3 || ev.LKey == 0) {
			t.Errorf("register event %+v: want access 3 and a key", ev)
		}
		if ev.Kind == KindRegister && !ev.OK && ev.Result != 22 {
			t.Errorf("refused register event %+v: want errno 22 (EINVAL)", ev)
		}
	}
	checkStats(t, tr, len(evs))
}

// Real registrations through libibverbs on an RDMA device: runs where one
// exists (the rxe qemu guest of tests/rxe). The helper is
// testdata/ibvreg/ibvreg.c; set RDMATRACE_IBVREG to a prebuilt copy where
// there is no C compiler (the guest), else it is built with cc -libverbs.
func TestRealVerbsExactCounts(t *testing.T) {
	requireRoot(t)
	bin := os.Getenv("RDMATRACE_IBVREG")
	if bin == "" {
		if _, err := os.Stat("/usr/include/infiniband/verbs.h"); err != nil {
			t.Skip("skipping: no verbs.h to build testdata/ibvreg (install libibverbs-dev) and RDMATRACE_IBVREG unset")
		}
		bin = filepath.Join(t.TempDir(), "ibvreg")
		if out, err := exec.Command("cc", "-O1", "-Wall", "-o", bin, "testdata/ibvreg/ibvreg.c", "-libverbs").CombinedOutput(); err != nil {
			t.Fatalf("build ibvreg: %v\n%s", err, out)
		}
	}
	const n, size = 50, 1 << 20
	probe := exec.Command(bin, "0", "1")
	probe.Stderr = os.Stderr
	out, err := probe.Output()
	if err != nil {
		t.Fatalf("%s 0 1 (device check): %v", bin, err)
	}
	if strings.TrimSpace(string(out)) == "nodevice" {
		t.Skip("skipping: no RDMA device on this machine (the rxe tier runs this test inside its guest)")
	}
	tg := startTarget(t, bin, "50", "1048576")
	lib, err := FindLibibverbs(tg.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := Open(Options{PID: tg.cmd.Process.Pid})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	if err := tr.AttachLibibverbs(lib); err != nil {
		t.Fatalf("AttachLibibverbs(%s): %v", lib, err)
	}
	tg.run(t)
	evs := drain(t, tr)
	c := countByFunc(evs)
	for fn, w := range map[string]tally{"ibv_reg_mr_iova2": {ok: n}, "ibv_dereg_mr": {ok: n}} {
		if g := c[fn]; g == nil || *g != w {
			t.Errorf("%s: got %+v, want %+v", fn, g, w)
		}
	}
	if len(evs) != 2*n {
		t.Errorf("got %d events, want %d: %v", len(evs), 2*n, c)
	}
	var regNs []time.Duration
	for _, ev := range evs {
		if ev.Length != size {
			t.Errorf("event %+v: want %d bytes", ev, size)
		}
		if ev.Kind == KindRegister {
			regNs = append(regNs, ev.Duration)
			if ev.LKey == 0 && ev.RKey == 0 {
				t.Errorf("register event without keys: %+v", ev)
			}
		}
	}
	slices.Sort(regNs)
	if len(regNs) > 0 {
		t.Logf("ibv_reg_mr of %d bytes: median %v, max %v over %d calls", size, regNs[len(regNs)/2], regNs[len(regNs)-1], len(regNs))
	}
	checkStats(t, tr, len(evs))
}
