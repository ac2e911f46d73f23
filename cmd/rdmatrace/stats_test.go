package main

import (
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bpf"
)

func reg(pid uint32, comm string, n uint64, d time.Duration) bpf.Event {
	return bpf.Event{Kind: bpf.KindRegister, PID: pid, Comm: comm, OK: true, Length: n, Duration: d}
}

func TestStatsAccounting(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s := newStats(t0)
	for i := range 100 {
		s.add(reg(10, "server", 4096, time.Duration(i+1)*time.Microsecond))
	}
	s.add(bpf.Event{Kind: bpf.KindRegister, PID: 10, Comm: "server", OK: false, Duration: time.Microsecond})
	for range 40 {
		s.add(bpf.Event{Kind: bpf.KindDeregister, PID: 10, Comm: "server", OK: true, Length: 4096})
	}
	s.add(bpf.Event{Kind: bpf.KindReregister, PID: 10, Comm: "server", OK: true, PrevLength: 4096, Length: 8192, Duration: time.Microsecond})
	s.add(bpf.Event{Kind: bpf.KindEnlargement, PID: 10, Comm: "server", ConnID: 7, FromSize: 1024, ToSize: 32768})
	s.add(reg(20, "client", 1<<20, time.Millisecond))
	s.add(bpf.Event{Kind: bpf.KindDeregister, PID: 30, Comm: "old", OK: true, Length: 4096})
	s.tick(t0.Add(2 * time.Second))

	p := s.procs[10]
	if p.Regs != 100 || p.RegFails != 1 || p.Deregs != 40 || p.Reregs != 1 || p.Enlargements != 1 {
		t.Fatalf("counts %+v", p)
	}
	if p.Registered != 100*4096 || p.Live() != 60*4096+4096 {
		t.Fatalf("registered %d live %d", p.Registered, p.Live())
	}
	if p.Rate != 50.5 { // 101 calls in 2 s
		t.Fatalf("rate %v", p.Rate)
	}
	// 102 latencies: 1..100 µs, 1 µs (failure), 1 µs (rereg).
	if got := p.Percentile(0.5); got != 49*time.Microsecond {
		t.Fatalf("p50 %v", got)
	}
	if got := p.Percentile(0.99); got != 99*time.Microsecond {
		t.Fatalf("p99 %v", got)
	}
	if old := s.procs[30]; old.Live() != 0 || !old.releasedUnseen {
		t.Fatalf("release of unseen registration: %+v", old)
	}
	if len(s.enl) != 1 || s.enl[0].ConnID != 7 {
		t.Fatalf("enlargements %+v", s.enl)
	}

	rows := s.rows(byLive, false, "", false)
	if len(rows) != 3 || rows[0].PID != 20 || rows[1].PID != 10 || rows[2].PID != 30 {
		t.Fatalf("by live: %v", pids(rows))
	}
	rows = s.rows(byRegs, true, "", false)
	if rows[0].PID != 30 || rows[2].PID != 10 {
		t.Fatalf("by regs ascending: %v", pids(rows))
	}
	if rows = s.rows(byPID, false, "serv", false); len(rows) != 1 || rows[0].PID != 10 {
		t.Fatalf("filter serv: %v", pids(rows))
	}
	if rows = s.rows(byPID, false, "20", false); len(rows) != 1 || rows[0].PID != 20 {
		t.Fatalf("filter 20: %v", pids(rows))
	}
}

func TestLatencyWindowBounded(t *testing.T) {
	s := newStats(time.Now())
	for i := range 3 * latencyWindow {
		s.add(reg(1, "x", 1, time.Duration(i)))
	}
	p := s.procs[1]
	if len(p.window) != latencyWindow {
		t.Fatalf("window %d", len(p.window))
	}
	// Only the last latencyWindow calls count: the smallest is 2*latencyWindow.
	if got := p.Percentile(0); got != time.Duration(2*latencyWindow) {
		t.Fatalf("min of window %v", got)
	}
}

func TestHumanUnits(t *testing.T) {
	for _, c := range []struct {
		n    uint64
		want string
	}{{0, "0B"}, {1023, "1023B"}, {1024, "1.0KiB"}, {65536, "64.0KiB"}, {3 << 30, "3.0GiB"}} {
		if got := humanBytes(c.n); got != c.want {
			t.Errorf("humanBytes(%d) = %q, want %q", c.n, got, c.want)
		}
	}
	if got := humanDuration(1500 * time.Nanosecond); got != "1.5µs" {
		t.Errorf("humanDuration = %q", got)
	}
}

func pids(ps []*proc) []uint32 {
	var out []uint32
	for _, p := range ps {
		out = append(out, p.PID)
	}
	return out
}

func TestPhasesAndExited(t *testing.T) {
	s := newStats(time.Now())
	enl := func(pid uint32, conn uint64, outcome uint32) {
		s.add(bpf.Event{Kind: bpf.KindEnlargement, PID: pid, Comm: "svc", ConnID: conn, Outcome: outcome})
	}
	enl(10, 1, 1) // conn 1 sends into large buffers
	enl(10, 2, 3) // conn 2's ack timed out: small
	enl(10, 3, 5) // conn 3 receives into large buffers
	enl(10, 1, 5) // conn 1 receives into large buffers too
	enl(20, 9, 6) // pid 20 refused one
	if sl, rl, sm := s.procs[10].phases(); sl != 1 || rl != 2 || sm != 1 {
		t.Fatalf("pid 10 phases: %d large send, %d large receive, %d small; want 1, 2, 1", sl, rl, sm)
	}
	s.markExited(func(pid uint32) bool { return pid != 10 })
	if !s.procs[10].Exited || s.procs[20].Exited {
		t.Fatal("exited marks wrong")
	}
	if rows := s.rows(byPID, true, "", true); len(rows) != 1 || rows[0].PID != 20 {
		t.Fatalf("hiding exited: %v", pids(rows))
	}
	if rows := s.rows(byPID, true, "", false); len(rows) != 2 {
		t.Fatalf("showing exited: %v", pids(rows))
	}
}

// Connection markers count open connections by provider, and are not
// enlargements.
func TestStatsConnectionsByProvider(t *testing.T) {
	s := newStats(time.Unix(1000, 0))
	ev := func(id uint64, outcome uint32) bpf.Event {
		return bpf.Event{Kind: bpf.KindConnection, PID: 10, Comm: "server", ConnID: id, Outcome: outcome}
	}
	s.add(ev(1, bpf.OutcomeOpenedRDMA))
	s.add(ev(2, bpf.OutcomeOpenedRDMA))
	s.add(ev(3, bpf.OutcomeOpenedTCP))
	s.add(ev(2, bpf.OutcomeClosed))
	s.add(ev(4, bpf.OutcomeClosed)) // opened before we started
	p := s.procs[10]
	if n := p.providers(); n[provRDMA] != 1 || n[provTCP] != 1 || len(n) != 2 {
		t.Fatalf("providers: %v; want one RDMA of unknown provider and one TCP", n)
	}
	if p.Enlargements != 0 || len(s.enl) != 0 {
		t.Fatalf("connection markers counted as enlargements: %d, %v", p.Enlargements, s.enl)
	}
}

// Shrink markers count as shrinks, put their direction back in the small
// phase, and show in the recent list beside the enlargements.
func TestStatsShrinks(t *testing.T) {
	s := newStats(time.Unix(1000, 0))
	ev := func(kind bpf.Kind, outcome uint32) bpf.Event {
		return bpf.Event{Kind: kind, PID: 10, Comm: "svc", ConnID: 3, Outcome: outcome}
	}
	s.add(ev(bpf.KindEnlargement, 1)) // enlarged
	s.add(ev(bpf.KindEnlargement, 5)) // served
	if sl, rl, _ := s.procs[10].phases(); sl != 1 || rl != 1 {
		t.Fatalf("after the enlargements: %d large send, %d large receive; want 1, 1", sl, rl)
	}
	s.add(ev(bpf.KindShrink, bpf.OutcomeShrunk))
	s.add(ev(bpf.KindShrink, bpf.OutcomeShrinkServed))
	p := s.procs[10]
	if sl, rl, small := p.phases(); sl != 0 || rl != 0 || small != 2 || p.Shrinks != 2 || p.Enlargements != 2 || len(s.enl) != 4 {
		t.Fatalf("after the shrinks: %d/%d large, %d small, %d shrinks, %d enlargements, %d listed; want 0/0, 2, 2, 2, 4",
			sl, rl, small, p.Shrinks, p.Enlargements, len(s.enl))
	}
	// Parks count on their own, leave the phases as they are, and are
	// listed too.
	s.add(ev(bpf.KindPark, bpf.OutcomeParked))
	s.add(ev(bpf.KindPark, bpf.OutcomeParkServed))
	if sl, rl, small := p.phases(); sl != 0 || rl != 0 || small != 2 || p.Parks != 2 || p.Shrinks != 2 || len(s.enl) != 6 {
		t.Fatalf("after the parks: %d/%d large, %d small, %d parks, %d shrinks, %d listed; want 0/0, 2, 2, 2, 6",
			sl, rl, small, p.Parks, p.Shrinks, len(s.enl))
	}
}
