package bpf

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// verbsHelper returns testdata/verbsreg, a Go program registering memory
// through rdmagrpc's verbs provider, or skips where no RDMA device is
// usable. In the rxe guest (no Go toolchain) tests/rxe ships a prebuilt
// copy named by RDMATRACE_VERBSREG.
func verbsHelper(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("RDMATRACE_VERBSREG")
	if bin == "" {
		if ents, _ := os.ReadDir("/sys/class/infiniband"); len(ents) == 0 {
			t.Skip("skipping: no RDMA device here (the rxe tier runs this test inside its guest with RDMATRACE_VERBSREG)")
		}
		bin = filepath.Join(t.TempDir(), "verbsreg")
		cmd := exec.Command("go", "build", "-o", bin, "./testdata/verbsreg")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build testdata/verbsreg (cgo, needs libibverbs-dev): %v\n%s", err, out)
		}
	}
	probe := exec.Command(bin, "-mode", "probe")
	probe.Stderr = os.Stderr
	out, err := probe.Output()
	if err != nil {
		t.Fatalf("%s -mode probe: %v", bin, err)
	}
	if strings.TrimSpace(string(out)) == "nodevice" {
		t.Skip("skipping: the verbs provider finds no usable RDMA device here")
	}
	return bin
}

// readJSON reads the target's next stdout line into v.
func (tg *target) readJSON(t *testing.T, v any) {
	t.Helper()
	if !tg.out.Scan() {
		t.Fatalf("target exited before its report: %v", tg.out.Err())
	}
	if err := json.Unmarshal(tg.out.Bytes(), v); err != nil {
		t.Fatalf("target report %q: %v", tg.out.Text(), err)
	}
}

func (tg *target) send(t *testing.T, line string) {
	t.Helper()
	if _, err := io.WriteString(tg.stdin, line+"\n"); err != nil {
		t.Fatal(err)
	}
}

// traceLibibverbs opens a tracer for pid with the real libibverbs.so.1
// that process mapped.
func traceLibibverbs(t *testing.T, pid int) *Tracer {
	t.Helper()
	lib, err := FindLibibverbs(pid)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := Open(Options{PID: pid})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tr.Close() })
	if err := tr.AttachLibibverbs(lib); err != nil {
		t.Fatalf("AttachLibibverbs(%s): %v", lib, err)
	}
	return tr
}

type mrKey struct {
	addr, len  uint64
	lkey, rkey uint32
}

// The verbs provider's own registrations, seen by the probes on
// libibverbs: PD.RegMR/MR.Dereg and bufpool's Get/Discard over verbs,
// counted exactly and matched one to one, keys included, with what the
// provider returned.
func TestVerbsProviderExactCounts(t *testing.T) {
	requireRoot(t)
	bin := verbsHelper(t)
	const n, k, size = 40, 8, 1 << 16 // size: a bufpool class, so Get registers exactly size
	tg := startTarget(t, bin, "-mode", "reg", "-n", fmt.Sprint(n), "-pool", fmt.Sprint(k), "-size", fmt.Sprint(size))
	tr := traceLibibverbs(t, tg.cmd.Process.Pid)
	tg.send(t, "go")
	var rep struct {
		Regions []struct {
			Addr       uint64
			Len        int
			LKey, RKey uint32
			Access     uint32
			Via        string
		}
		Deregs   int
		PoolRegs uint64 `json:"pool_registrations"`
		PoolDone uint64 `json:"pool_deregistrations"`
	}
	tg.readJSON(t, &rep)
	tg.expect(t, "done")
	evs := drain(t, tr)

	if len(rep.Regions) != n+k || rep.Deregs != n+k || rep.PoolRegs != k || rep.PoolDone != k {
		t.Fatalf("verbsreg did %d registrations, %d deregistrations (pool %d/%d); asked for %d through the PD and %d through bufpool",
			len(rep.Regions), rep.Deregs, rep.PoolRegs, rep.PoolDone, n, k)
	}
	c := countByFunc(evs)
	for fn, w := range map[string]tally{"ibv_reg_mr_iova2": {ok: n + k}, "ibv_dereg_mr": {ok: n + k}} {
		if g := c[fn]; g == nil || *g != w {
			t.Errorf("%s: got %+v, want %+v", fn, g, w)
		}
	}
	if len(evs) != 2*(n+k) {
		t.Errorf("got %d events, want %d: %v", len(evs), 2*(n+k), c)
	}
	want := map[mrKey]int{}
	for _, r := range rep.Regions {
		want[mrKey{r.Addr, uint64(r.Len), r.LKey, r.RKey}]++
	}
	for _, ev := range evs {
		if ev.Length != size {
			t.Errorf("event %+v: want %d bytes", ev, size)
		}
		if ev.Kind != KindRegister {
			continue
		}
		if ev.Access != rep.Regions[0].Access {
			t.Errorf("register event %+v: access %#x, want %#x", ev, ev.Access, rep.Regions[0].Access)
		}
		key := mrKey{ev.Addr, ev.Length, ev.LKey, ev.RKey}
		if want[key] == 0 {
			t.Errorf("register event %+v matches no registration the provider returned", ev)
			continue
		}
		want[key]--
	}
	for key, left := range want {
		if left != 0 {
			t.Errorf("registration %+v returned by the provider %d more times than the probes saw", key, left)
		}
	}
	checkStats(t, tr, len(evs))
}

// Real rdmagrpc connections over verbs: the enlargement marker fires once
// per side of each pair, and the memory the probes saw registered and not
// yet deregistered is, to the byte, what the connections report holding;
// closing them deregisters all of it.
func TestVerbsConnEnlargementCounts(t *testing.T) {
	requireRoot(t)
	bin := verbsHelper(t)
	ip := os.Getenv("RXE_ADDR") // tests/rxe: the guest's RoCE address
	if ip == "" {
		ip = os.Getenv("RDMAGRPC_VERBS_ADDR")
	}
	if ip == "" {
		t.Skip("skipping: set RDMAGRPC_VERBS_ADDR to the IPv4 address of the RDMA netdev (tests/rxe sets RXE_ADDR)")
	}
	const n = 3
	tg := startTarget(t, bin, "-mode", "conn", "-n", fmt.Sprint(n), "-addr", net.JoinHostPort(ip, "0"))
	tr := traceLibibverbs(t, tg.cmd.Process.Pid)
	got, err := tr.AttachGoFuncs(bin, KnownGoFuncs)
	if err != nil {
		t.Fatalf("AttachGoFuncs: %v", err)
	}
	if !attachedMarker(got) {
		t.Fatalf("attached %v: no conn.enlargementMarker", got)
	}
	tg.send(t, "go")
	var rep struct {
		Pairs           int
		RegisteredBytes int64 `json:"registered_bytes"`
		Enlargements    int
		Served          int
		FromSize        int `json:"from_size"`
		ToSize          int `json:"to_size"`
	}
	tg.readJSON(t, &rep)
	open := drain(t, tr)

	var regs, deregs, opened int
	var live int64
	outcomes := map[uint32]int{}
	for _, ev := range open {
		switch {
		case ev.Kind == KindRegister && ev.Func == "ibv_reg_mr_iova2" && ev.OK:
			regs++
			live += int64(ev.Length)
		case ev.Kind == KindDeregister && ev.Func == "ibv_dereg_mr" && ev.OK:
			deregs++
			live -= int64(ev.Length)
		case ev.Kind == KindEnlargement:
			outcomes[ev.Outcome]++
			if int(ev.FromSize) != rep.FromSize || int(ev.ToSize) != rep.ToSize || ev.ConnID == 0 {
				t.Errorf("enlargement event %+v: want %d → %d on a connection", ev, rep.FromSize, rep.ToSize)
			}
		case ev.Kind == KindConnection && ev.Outcome == OutcomeOpenedRDMA && ev.ConnID != 0:
			opened++
		default:
			t.Errorf("unexpected event %+v", ev)
		}
	}
	if rep.Enlargements != n || rep.Served != n {
		t.Errorf("connections report %d enlargements and %d served, want %d each", rep.Enlargements, rep.Served, n)
	}
	if outcomes[1] != n || outcomes[5] != n || len(outcomes) != 2 {
		t.Errorf("enlargement outcomes %v, want %d enlarged (1) and %d served (5)", outcomes, n, n)
	}
	if opened != 2*n { // both ends of each pair, over verbs
		t.Errorf("%d connections seen opening over RDMA, want %d", opened, 2*n)
	}
	if live != rep.RegisteredBytes {
		t.Errorf("probes saw %d bytes registered and not deregistered (%d ibv_reg_mr, %d ibv_dereg_mr); the connections report %d",
			live, regs, deregs, rep.RegisteredBytes)
	}
	t.Logf("%d pairs: %d ibv_reg_mr, %d ibv_dereg_mr, %d bytes live = the connections' %d; enlargement %d → %d",
		n, regs, deregs, live, rep.RegisteredBytes, rep.FromSize, rep.ToSize)

	tg.send(t, "close")
	tg.expect(t, "done")
	closing := drain(t, tr)
	closed := 0
	for _, ev := range closing {
		switch {
		case ev.Kind == KindDeregister && ev.OK:
			live -= int64(ev.Length)
		case ev.Kind == KindRegister:
			t.Errorf("registration while closing: %+v", ev)
		case ev.Kind == KindConnection && ev.Outcome == OutcomeClosed:
			closed++
		}
	}
	if live != 0 {
		t.Errorf("after Close, %d bytes are still registered by the probes' count (%d events while closing)", live, len(closing))
	}
	if live == 0 && closed != 2*n { // a connection reports its close before it deregisters
		t.Errorf("%d connections seen closing, want %d", closed, 2*n)
	}
	checkStats(t, tr, len(open)+len(closing))
}

func attachedMarker(attached []string) bool {
	for _, a := range attached {
		if strings.HasSuffix(a, "conn.enlargementMarker") {
			return true
		}
	}
	return false
}
