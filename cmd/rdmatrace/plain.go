package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/bpf"
	"github.com/rdmagrpc/rdmagrpc/conn"
)

// Plain output: when standard output is not a terminal (a pipe, a file,
// a log collector) or with --plain, rdmatrace prints lines instead of
// the full-screen view: one per connection, enlargement, shrink or park
// as it happens, and every interval one summary per process that had
// events in it and one per RDMA port whose error counters moved. Every
// line has the same first five fields, TIME PID COMM KIND CONN, then
// key=value pairs, so grep and awk can take them apart; no escape codes.

// isTerminal reports whether f is a terminal.
func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

const plainHeader = "TIME         PID     COMM            KIND      CONN DETAILS"

// plainField makes s one field: no spaces, never empty.
func plainField(s string) string {
	if s == "" {
		return "-"
	}
	return strings.ReplaceAll(s, " ", "_")
}

func plainLine(t time.Time, pid uint32, comm, kind, connID, details string) string {
	l := fmt.Sprintf("%s %-7d %-15s %-9s %4s", t.Format("15:04:05.000"), pid, plainField(comm), kind, connID)
	if details != "" {
		l += " " + details
	}
	return l
}

// plainEvent is the line of an event worth a line of its own, or "" for
// the registrations, which only the summaries count.
func plainEvent(ev bpf.Event, provider string) string {
	id := fmt.Sprint(ev.ConnID)
	outcome := plainField(conn.EnlargeOutcome(ev.Outcome))
	switch ev.Kind {
	case bpf.KindConnection:
		switch ev.Outcome {
		case bpf.OutcomeClosed:
			return plainLine(ev.Time, ev.PID, ev.Comm, "close", id, "")
		default:
			return plainLine(ev.Time, ev.PID, ev.Comm, "open", id, "provider="+provider)
		}
	case bpf.KindEnlargement, bpf.KindShrink, bpf.KindPark:
		return plainLine(ev.Time, ev.PID, ev.Comm, ev.Kind.String(), id, fmt.Sprintf("from=%d to=%d took_ns=%d outcome=%s",
			ev.FromSize, ev.ToSize, ev.EnlargeDuration.Nanoseconds(), outcome))
	}
	return ""
}

// plainSummary is a process's summary line.
func plainSummary(now time.Time, p *proc) string {
	n := p.providers()
	d := fmt.Sprintf("reg_per_s=%.1f regs=%d fails=%d deregs=%d registered=%d live=%d p50_ns=%d p99_ns=%d enl=%d shr=%d prk=%d shm=%d verbs=%d tcp=%d",
		p.Rate, p.Regs, p.RegFails, p.Deregs, p.Registered, p.Live(), p.Percentile(0.5).Nanoseconds(), p.Percentile(0.99).Nanoseconds(),
		p.Enlargements, p.Shrinks, p.Parks, n[provShm]+p.Found[provShm], n[provVerbs]+p.Found[provVerbs], n[provTCP]+p.Found[provTCP])
	if n[provRDMA] > 0 {
		d += fmt.Sprintf(" rdma_unknown=%d", n[provRDMA])
	}
	if p.Partial {
		d += " partial=1" // the connection counts are lower bounds
	}
	if p.releasedUnseen {
		d += " released_unseen=1"
	}
	if p.Exited {
		d += " exited=1"
	}
	return plainLine(now, p.PID, p.Comm, "summary", "-", d)
}

// plainPorts is a line per port whose error counters moved in the last
// interval.
func plainPorts(now time.Time, h *hwRates) []string {
	if h == nil {
		return nil
	}
	var out []string
	for _, p := range h.ports {
		var kv []string
		for _, c := range errorCounters {
			if r := h.rates[p.name()][c.name]; r > 0 {
				kv = append(kv, fmt.Sprintf("%s=%d %s_per_s=%.1f", c.name, p.Values[c.name], c.name, r))
			}
		}
		if len(kv) > 0 {
			out = append(out, plainLine(now, 0, "-", "port", "-", "port="+p.name()+" "+strings.Join(kv, " ")))
		}
	}
	return out
}

// plainRun prints events from src and, each interval, the summaries,
// until ctx ends, until passes (zero: never) or src closes. At the end
// it prints every process's summary.
func plainRun(ctx context.Context, w io.Writer, src <-chan bpf.Event, st *stats, hw *hwRates, interval time.Duration, until time.Time, tick func(now time.Time)) {
	out := bufio.NewWriter(w)
	defer out.Flush()
	fmt.Fprintln(out, plainHeader)
	t := time.NewTicker(interval)
	defer t.Stop()
	var deadline <-chan time.Time
	if !until.IsZero() {
		tm := time.NewTimer(time.Until(until))
		defer tm.Stop()
		deadline = tm.C
	}
	seen := map[uint32]uint64{} // pid → events counted at the last summary
	summaries := func(now time.Time, all bool) {
		st.tick(now)
		if tick != nil {
			tick(now)
		}
		for _, p := range st.rows(byPID, true, "", false) {
			if all || p.events != seen[p.PID] {
				fmt.Fprintln(out, plainSummary(now, p))
				seen[p.PID] = p.events
			}
		}
		hw.sample(now)
		for _, l := range plainPorts(now, hw) {
			fmt.Fprintln(out, l)
		}
		out.Flush()
	}
	for {
		select {
		case ev, ok := <-src:
			if !ok {
				summaries(time.Now(), true)
				return
			}
			st.add(ev)
			if l := plainEvent(ev, st.procs[ev.PID].open[ev.ConnID]); l != "" {
				fmt.Fprintln(out, l)
			}
		case now := <-t.C:
			summaries(now, false)
		case <-deadline:
			summaries(time.Now(), true)
			return
		case <-ctx.Done():
			summaries(time.Now(), true)
			return
		}
	}
}
