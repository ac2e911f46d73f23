package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	tea "github.com/charmbracelet/bubbletea"
	"github.com/charmbracelet/lipgloss"

	"github.com/rdmagrpc/rdmagrpc/bpf"
	"github.com/rdmagrpc/rdmagrpc/conn"
)

// busyStats is a stats with long names, huge counts and every kind of
// event: what makes rows wide.
func busyStats(now time.Time) *stats {
	s := newStats(now)
	s.ranBefore = func(pid uint32) bool { return pid == 4194303 }
	for i, pid := range []uint32{4194303, 12, 99999} {
		comm := "a-very-long-command-name"[:15-i]
		for j := range 50 {
			s.add(bpf.Event{Kind: bpf.KindRegister, Func: "ibv_reg_mr_iova2", PID: pid, Comm: comm, OK: true,
				Length: 1 << 40, Duration: time.Duration(j+1) * 999 * time.Millisecond})
		}
		s.add(bpf.Event{Kind: bpf.KindDeregister, PID: pid, Comm: comm, OK: true, Length: 1 << 62})
		s.add(bpf.Event{Kind: bpf.KindConnection, PID: pid, Comm: comm, ConnID: 1<<64 - 1, Outcome: bpf.OutcomeOpenedRDMA})
		for k := range 20 {
			s.add(bpf.Event{Kind: bpf.KindEnlargement, PID: pid, Comm: comm, ConnID: 1<<64 - 1 - uint64(k), Outcome: 3,
				FromSize: 1<<32 - 1, ToSize: 1<<32 - 1, EnlargeDuration: 123 * time.Hour, Time: now})
		}
	}
	p := s.procs[12]
	p.Regs, p.RegFails, p.Enlargements, p.Shrinks, p.Parks = 1<<63, 1<<62, 1<<61, 1<<60, 1<<59
	p.Registered = 1<<64 - 1
	s.tick(now.Add(time.Nanosecond)) // a huge rate
	return s
}

// Every line of the live view fits 80 columns, however long the names
// and large the numbers; a narrower terminal gets narrower lines.
func TestViewFits80Columns(t *testing.T) {
	now := time.Now()
	hwRoot := t.TempDir()
	fakeCounters(t, hwRoot, "mlx5_0", 1, map[string]uint64{"rnr_nak_retry_err": 1 << 50, "out_of_sequence": 7, "link_downed": 3,
		"local_ack_timeout_err": 12345678, "symbol_error": 99, "port_rcv_errors": 5})
	for _, width := range []int{0, 80, 200, 60} {
		m := &model{st: busyStats(now), scope: "all processes", interval: time.Second, started: now,
			notes: []string{strings.Repeat("a note that goes on and on ", 10), "/a/very/long/path/" + strings.Repeat("x", 120)},
			watch: newWatcher(nil, nil), hw: newHWRates(hwRoot, now), width: width, height: 50,
			filter: strings.Repeat("f", 100)}
		m.watch.skipped["/opt/some/very/long/path/to/an/executable/that/goes/on/forever"] = strings.Repeat("reason ", 20)
		limit := 80
		if width > 0 && width < 80 {
			limit = width
		}
		for _, sel := range []int{0, 1, 2} {
			m.selected = sel
			v := m.View()
			for i, l := range strings.Split(v, "\n") {
				if w := lipgloss.Width(l); w > limit {
					t.Errorf("width %d, line %d is %d columns:\n%s", width, i, w, l)
				}
			}
		}
	}
	// The rows themselves, without fit's cut: 80 at most with the
	// largest values, so no column is ever cut off.
	for _, p := range busyStats(now).procs {
		if w := lipgloss.Width(tableRow(p)); w > 80 {
			t.Errorf("row of %d is %d columns: %s", p.PID, w, tableRow(p))
		}
	}
	if w := lipgloss.Width(tableHeader()); w > 80 {
		t.Errorf("header is %d columns", w)
	}
	if w := lipgloss.Width(eventLine(bpf.Event{Kind: bpf.KindPark, PID: 4194303, Comm: "a-very-long-nam", ConnID: 999999,
		FromSize: 1<<32 - 1, ToSize: 1<<32 - 1, EnlargeDuration: 100 * time.Hour, Outcome: 4})); w > 80 {
		t.Errorf("event line is %d columns", w)
	}
}

// A view of a known process shows the documented columns and the
// connections by provider, "≥" on a process that ran before rdmatrace.
func TestViewRowsAndProviders(t *testing.T) {
	now := time.Now()
	s := newStats(now)
	s.ranBefore = func(pid uint32) bool { return pid == 10 }
	s.add(bpf.Event{Kind: bpf.KindRegister, Func: bpf.Module + "/transport/shm.regMR", PID: 10, Comm: "server", OK: true, Length: 8192, Duration: 3 * time.Microsecond})
	s.add(bpf.Event{Kind: bpf.KindConnection, PID: 10, Comm: "server", ConnID: 3, Outcome: bpf.OutcomeOpenedRDMA})
	s.setFound(map[uint32]map[string]int{10: {provShm: 2}}, func(uint32) string { return "?" })
	m := &model{st: s, scope: "all processes", interval: time.Second, started: now}
	v := m.View()
	for _, want := range []string{
		"    PID COMM          REG/s  REGS  FAIL  REGD   LIVE   p50   p99   ENL   SHR",
		"     10 server          0.0     1     0  8.0K   8.0K 3.0µs 3.0µs     0     0",
		"pid 10 connections: shm ≥3 verbs ≥0 tcp ≥0",
		"≥: this process ran before rdmatrace",
	} {
		if !strings.Contains(v, want) {
			t.Errorf("view lacks %q:\n%s", want, v)
		}
	}
}

// A process's RDMA connections are told apart by the registration that
// came before their open marker: shm's regMR, or libibverbs.
func TestProvidersFromRegistrations(t *testing.T) {
	s := newStats(time.Now())
	open := func(pid uint32, id uint64, outcome uint32) {
		s.add(bpf.Event{Kind: bpf.KindConnection, PID: pid, ConnID: id, Outcome: outcome})
	}
	s.add(bpf.Event{Kind: bpf.KindRegister, Func: bpf.Module + "/transport/shm.regMR", PID: 1, OK: true})
	open(1, 1, bpf.OutcomeOpenedRDMA)
	open(1, 2, bpf.OutcomeOpenedRDMA)
	s.add(bpf.Event{Kind: bpf.KindRegister, Func: "ibv_reg_mr_iova2", PID: 1, OK: true})
	open(1, 3, bpf.OutcomeOpenedRDMA)
	open(1, 4, bpf.OutcomeOpenedTCP)
	open(2, 1, bpf.OutcomeOpenedRDMA) // no registration seen: unknown
	open(1, 2, bpf.OutcomeClosed)
	if n := s.procs[1].providers(); n[provShm] != 1 || n[provVerbs] != 1 || n[provTCP] != 1 {
		t.Errorf("pid 1: %v, want shm 1 verbs 1 tcp 1", n)
	}
	if got := s.procs[1].connCounts(); got != "shm 1 verbs 1 tcp 1" {
		t.Errorf("pid 1 counts %q", got)
	}
	if got := s.procs[2].connCounts(); got != "shm 0 verbs 0 tcp 0 rdma? 1" {
		t.Errorf("pid 2 counts %q", got)
	}
}

// A marker that names its provider is believed over the registration
// that came before it.
func TestProvidersFromMarkers(t *testing.T) {
	s := newStats(time.Now())
	s.add(bpf.Event{Kind: bpf.KindRegister, Func: bpf.Module + "/transport/shm.regMR", PID: 1, OK: true})
	s.add(bpf.Event{Kind: bpf.KindConnection, PID: 1, ConnID: 1, Outcome: bpf.OutcomeOpenedRDMA, FromSize: bpf.OpenedVerbs})
	s.add(bpf.Event{Kind: bpf.KindConnection, PID: 1, ConnID: 2, Outcome: bpf.OutcomeOpenedRDMA, FromSize: bpf.OpenedShm})
	s.add(bpf.Event{Kind: bpf.KindConnection, PID: 2, ConnID: 1, Outcome: bpf.OutcomeOpenedRDMA, FromSize: bpf.OpenedShm})
	if got := s.procs[1].connCounts(); got != "shm 1 verbs 1 tcp 0" {
		t.Errorf("pid 1 counts %q", got)
	}
	if got := s.procs[2].connCounts(); got != "shm 1 verbs 0 tcp 0" {
		t.Errorf("pid 2 counts %q", got)
	}
}

// conns lists why each traced connection has its provider, as its open
// marker said; a closed connection's reason goes with it.
func TestConnsSayWhy(t *testing.T) {
	s := newStats(time.Now())
	open := func(id uint64, prov, why uint32) {
		s.add(bpf.Event{Kind: bpf.KindConnection, PID: 7, Comm: "svc", ConnID: id, Outcome: bpf.OutcomeOpenedRDMA, FromSize: prov, ToSize: why})
	}
	open(1, bpf.OpenedShm, bpf.WhySameHost)
	open(2, bpf.OpenedVerbs, bpf.WhyOtherHost)
	open(3, bpf.OpenedVerbs, 0) // a binary whose marker does not say
	open(4, bpf.OpenedShm, bpf.WhyPinned)
	s.add(bpf.Event{Kind: bpf.KindConnection, PID: 7, ConnID: 4, Outcome: bpf.OutcomeClosed})
	var out strings.Builder
	printConns(&out, connRows(nil, s, 0, nil), 5*time.Second)
	got := out.String()
	for _, want := range []string{
		"Why each traced connection has its provider:",
		"7 conn 1, shm: the peer is on this host (same kernel): shared memory",
		"7 conn 2, verbs: the peer is on another host",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("conns output lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "conn 3,") || strings.Contains(got, "pinned") {
		t.Errorf("conns gave a reason no marker said, or one of a closed connection:\n%s", got)
	}
}

// Not a terminal: plain lines, one per event and per summary, the same
// first five fields on each, no escape codes.
func TestPlainOutput(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if isTerminal(w) {
		t.Fatal("a pipe taken for a terminal")
	}
	src := make(chan bpf.Event, 16)
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	src <- bpf.Event{Kind: bpf.KindRegister, Func: bpf.Module + "/transport/shm.regMR", PID: 42, Comm: "my server", OK: true, Length: 4096, Time: t0}
	src <- bpf.Event{Kind: bpf.KindConnection, PID: 42, Comm: "my server", ConnID: 3, Outcome: bpf.OutcomeOpenedRDMA, Time: t0}
	src <- bpf.Event{Kind: bpf.KindEnlargement, PID: 42, Comm: "my server", ConnID: 3, Outcome: 1, FromSize: 1024, ToSize: 32768, EnlargeDuration: time.Millisecond, Time: t0}
	src <- bpf.Event{Kind: bpf.KindConnection, PID: 42, Comm: "my server", ConnID: 3, Outcome: bpf.OutcomeClosed, Time: t0}
	close(src)
	var out bytes.Buffer
	hwRoot := t.TempDir()
	fakeCounters(t, hwRoot, "rxe0", 1, map[string]uint64{"out_of_sequence": 1})
	hw := newHWRates(hwRoot, t0)
	fakeCounters(t, hwRoot, "rxe0", 1, map[string]uint64{"out_of_sequence": 5})
	hw.at = time.Now().Add(-2 * time.Second)
	plainRun(context.Background(), &out, src, newStats(t0), hw, time.Hour, time.Time{}, nil)
	text := out.String()
	if strings.Contains(text, "\x1b") {
		t.Errorf("escape codes in plain output:\n%q", text)
	}
	lines := strings.Split(strings.TrimSpace(text), "\n")
	if len(lines) != 6 {
		t.Fatalf("%d lines, want header, open, enlarge, close, summary, port:\n%s", len(lines), text)
	}
	want := []struct{ kind, conn, has string }{
		{"open", "3", "provider=shm"},
		{"enlarge", "3", "from=1024 to=32768 took_ns=1000000 outcome=enlarged"},
		{"close", "3", ""},
		{"summary", "-", "regs=1 fails=0 deregs=0 registered=4096 live=4096"},
		{"port", "-", "port=rxe0/1 out_of_sequence=5 out_of_sequence_per_s="},
	}
	for i, w := range want {
		f := strings.Fields(lines[i+1])
		if len(f) < 5 || f[3] != w.kind || f[4] != w.conn || !strings.Contains(lines[i+1], w.has) {
			t.Errorf("line %d: %q, want kind %s conn %s with %q", i+1, lines[i+1], w.kind, w.conn, w.has)
		}
		if i < 4 && (f[1] != "42" || f[2] != "my_server") {
			t.Errorf("line %d: pid and comm fields %q", i+1, lines[i+1])
		}
	}
}

// fakeCounters writes a port's counters into a sysfs tree at root, half
// in counters/, half in hw_counters/, as drivers split them.
func fakeCounters(t *testing.T, root, dev string, port int, values map[string]uint64) {
	t.Helper()
	// Split by name, not by map order: a counter written again must land
	// in the file it was in.
	for name, v := range values {
		sub := "counters"
		if len(name)%2 == 1 {
			sub = "hw_counters"
		}
		p := filepath.Join(root, "class", "infiniband", dev, "ports", fmt.Sprint(port), sub, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(fmt.Sprintf("%d\n", v)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// The counters of every port are read from the injected sysfs root, and
// the rates are the change over the time between two samples.
func TestHWCountersAndRates(t *testing.T) {
	root := t.TempDir()
	fakeCounters(t, root, "mlx5_1", 1, map[string]uint64{"rnr_nak_retry_err": 10, "link_downed": 0, "port_xmit_data": 1000})
	fakeCounters(t, root, "mlx5_0", 2, map[string]uint64{"out_of_sequence": 0})
	lifespan := filepath.Join(root, "class", "infiniband", "mlx5_0", "ports", "2", "hw_counters", "lifespan")
	os.WriteFile(lifespan, []byte("10\n"), 0o644)
	ports, err := readHWCounters(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(ports) != 2 || ports[0].name() != "mlx5_0/2" || ports[1].name() != "mlx5_1/1" ||
		ports[1].Values["rnr_nak_retry_err"] != 10 || ports[1].Values["port_xmit_data"] != 1000 || len(ports[0].Values) != 1 {
		t.Fatalf("ports %+v", ports)
	}
	t0 := time.Unix(1000, 0)
	h := newHWRates(root, t0)
	fakeCounters(t, root, "mlx5_1", 1, map[string]uint64{"rnr_nak_retry_err": 30, "link_downed": 1})
	h.sample(t0.Add(4 * time.Second))
	if r := h.rates["mlx5_1/1"]; r["rnr_nak_retry_err"] != 5 || r["link_downed"] != 0.25 {
		t.Fatalf("rates %v", r)
	}
	got := strings.Join(h.lines(), "\n")
	for _, want := range []string{"mlx5_0/2: no errors (1 counters)", "mlx5_1/1: rnr_nak_retry_err 30 +5.0/s, link_downed 1 +0.2/s"} {
		if !strings.Contains(got, want) {
			t.Errorf("lines lack %q:\n%s", want, got)
		}
	}
	// doctor prints them, and each error counter not at zero is a problem.
	var out strings.Builder
	r := &report{w: &out}
	r.counters(root)
	if !strings.Contains(out.String(), "mlx5_1/1: 3 counters, not zero:") || !strings.Contains(out.String(), "rnr_nak_retry_err 30") {
		t.Errorf("doctor's counters:\n%s", out.String())
	}
	if len(r.problems) != 2 || !strings.Contains(r.problems[0], "rnr_nak_retry_err is 30") {
		t.Errorf("problems %q", r.problems)
	}
}

// No device: the view and doctor say so.
func TestHWCountersNoDevice(t *testing.T) {
	root := t.TempDir()
	h := newHWRates(root, time.Now())
	if l := h.lines(); len(l) != 1 || !strings.Contains(l[0], "no RDMA device on this host") {
		t.Errorf("lines %q", l)
	}
	var out strings.Builder
	r := &report{w: &out}
	r.counters(root)
	if !strings.Contains(out.String(), "none: no RDMA device on this host") {
		t.Errorf("doctor: %s", out.String())
	}
}

// --help lists every subcommand.
func TestHelpListsSubcommands(t *testing.T) {
	var b bytes.Buffer
	parseFlags([]string{"--help"}, &b)
	for _, want := range []string{"rdmatrace doctor", "rdmatrace conns", "-plain", "-sysfs"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("help lacks %q", want)
		}
	}
}

// The socket scan finds both ends of an shm connection of this process,
// with the listener's address, roles and peers; conns lists them.
func TestConnsFindsShmConnections(t *testing.T) {
	l, err := conn.Listen(context.Background(), "127.0.0.1:0", conn.WithProvider("shm"), conn.WithoutTCP())
	if err != nil {
		t.Skipf("no shm listener here: %v", err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	c, err := conn.Dial(context.Background(), l.Addr().String(), conn.WithProvider("shm"), conn.WithoutFallback())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := <-accepted
	defer s.Close()
	socks, err := listUnixSockets()
	if err != nil {
		t.Fatal(err)
	}
	me := os.Getpid()
	var rows []connRow
	for _, r := range connRows(shmEnds(socks, socketOwners("/proc")), nil, me, func(int) string { return "test" }) {
		if r.Listener == l.Addr().String() {
			rows = append(rows, r)
		}
	}
	if len(rows) != 2 || rows[0].Provider != provShm || rows[0].ID != "?" {
		t.Fatalf("rows %+v", rows)
	}
	roles := rows[0].Role + " " + rows[1].Role
	if roles != "server client" && roles != "client server" {
		t.Errorf("roles %q", roles)
	}
	for _, r := range rows {
		if r.PeerPID != fmt.Sprint(me) {
			t.Errorf("peer pid %q, want this process's", r.PeerPID)
		}
	}
	var out bytes.Buffer
	printConns(&out, rows, 0)
	for _, l := range strings.Split(out.String(), "\n") {
		if lipgloss.Width(l) > 80 {
			t.Errorf("conns line of %d columns: %s", lipgloss.Width(l), l)
		}
	}
	if !strings.Contains(out.String(), "What this cannot see:") {
		t.Errorf("conns output:\n%s", out.String())
	}
	// The view's discovery counts the ends open before it started.
	d := newDiscovery(0)
	if n := d.found()[uint32(me)][provShm]; n < 2 {
		t.Errorf("discovery found %d shm ends of this process, want 2 or more", n)
	}
	c.(*conn.Conn).ID() // the identity conns cannot see is the Conn's own
}

// The connection ID prints one way: "conn N", decimal, as the span
// attribute holds it.
func TestConnName(t *testing.T) {
	if got := conn.ConnName(3); got != "conn 3" {
		t.Errorf("ConnName(3) = %q", got)
	}
	if l := eventLine(bpf.Event{Kind: bpf.KindEnlargement, PID: 1, ConnID: 26}); !strings.Contains(l, " 26 ") || strings.Contains(l, "0x") {
		t.Errorf("event line %q", l)
	}
}

var _ tea.Model = (*model)(nil)
