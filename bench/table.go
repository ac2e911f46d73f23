package bench

import (
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// unit formats a value in base units.
type unit int

const (
	seconds unit = iota
	bytesPerSec
	perSec
	count // a number of events, to one decimal
)

func (u unit) format(v float64) string {
	switch u {
	case seconds:
		d := time.Duration(v * float64(time.Second))
		switch {
		case d < time.Millisecond:
			return fmt.Sprintf("%.1f µs", v*1e6)
		case d < time.Second:
			return fmt.Sprintf("%.2f ms", v*1e3)
		}
		return fmt.Sprintf("%.2f s", v)
	case bytesPerSec:
		return thousands(v/1e6) + " MB/s"
	case perSec:
		return thousands(v)
	case count:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprint(v)
}

// thousands rounds v and groups its digits.
func thousands(v float64) string {
	s := fmt.Sprintf("%d", int64(math.Round(v)))
	var b strings.Builder
	for i, r := range s {
		if i > 0 && (len(s)-i)%3 == 0 && s[i-1] != '-' {
			b.WriteByte(',')
		}
		b.WriteRune(r)
	}
	return b.String()
}

func ratio(v, ref float64) string {
	if ref == 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f×", v/ref)
}

func kib(b float64) string {
	if b >= 1<<10 {
		return fmt.Sprintf("%.1f KiB", b/(1<<10))
	}
	return fmt.Sprintf("%.0f B", b)
}

type tableRow struct {
	name string
	unit unit
	note string
}

// Rows of the grpc-go table, in order.
func (r *Report) grpcRows() []tableRow {
	c := &r.Config
	var rows []tableRow
	for _, s := range c.Sizes {
		rows = append(rows, tableRow{rowP50(s), seconds, ""}, tableRow{rowP99(s), seconds, ""})
	}
	for _, n := range c.Concurrency {
		rows = append(rows, tableRow{rowQPS(n), perSec, sizeName(c.QPSSize) + " unary, calls/s"})
	}
	for _, n := range c.Concurrency {
		rows = append(rows, tableRow{rowCPU(n), seconds, "user+sys, client and server"})
	}
	rows = append(rows, tableRow{rowStream(c.StreamSize), bytesPerSec, "server streaming"})
	return rows
}

// Markdown writes the tables, ready to paste into the README.
func (r *Report) Markdown(w io.Writer) {
	c := &r.Config
	rd := fmt.Sprintf("rdmagrpc (%s)", r.Provider)
	fmt.Fprintf(w, "Machine: %s; rdmagrpc provider %s; %s.\n", r.Machine, r.Provider, r.Machine.Date.Format("2006-01-02"))
	fmt.Fprintf(w, "Medians of %d interleaved rounds, %v per figure and transport per round; run took %v.\n\n",
		c.Rounds, c.BenchTime, r.Elapsed.Round(time.Second))
	if c.Load > 0 {
		fmt.Fprintf(w, "A busy host: %d CPU-bound process(es) (`while :; do :; done`) ran beside client and server for the whole run.\n\n", c.Load)
	}
	if Remote() {
		fmt.Fprintf(w, "The server children ran on another host (%s=%s): \"TCP loopback\" below is TCP between the two hosts, \"child process\" a process there, and there is no unix socket column's figure; the bufconn ceiling and memcpy are this host's.\n\n",
			RemoteEnv, os.Getenv(RemoteEnv))
	}

	if c.Rounds > 0 {
		r.twoProcMarkdown(w, rd)
	}
	if c.Rounds > 0 && c.OneProcess { // -rounds 0: the idle and steady-state figures alone
		fmt.Fprintf(w, "For reference only (a one-process figure hides the cost of a cross-process wake-up): grpc-go, client and server in one process (unary: request and response of the size each way):\n\n")
		fmt.Fprintf(w, "| figure | TCP loopback | unix socket | %s | unix / TCP | rdmagrpc / TCP |\n", rd)
		fmt.Fprintf(w, "|---|---:|---:|---:|---:|---:|\n")
		for _, row := range r.grpcRows() {
			tcp, _ := r.Median(row.name, TCP)
			ux, _ := r.Median(row.name, Unix)
			rm, _ := r.Median(row.name, RDMA)
			name := row.name
			if row.note != "" {
				name += " (" + row.note + ")"
			}
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", name,
				row.unit.format(tcp), row.unit.format(ux), row.unit.format(rm), ratio(ux, tcp), ratio(rm, tcp))
		}

		fmt.Fprintf(w, "\nRaw net.Conn throughput, one writer and one reader (reads of the write size), against memcpy in the same run:\n\n")
		fmt.Fprintf(w, "| write size | memcpy | TCP loopback | unix socket | %s, rendezvous | %s, rings only | rendezvous / TCP | rings / TCP | rendezvous / memcpy |\n", rd, rd)
		fmt.Fprintf(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, s := range c.RawSizes {
			row := rowRaw(s)
			m, _ := r.Median(row2(row), Memcpy)
			tcp, _ := r.Median(row, TCP)
			ux, _ := r.Median(row, Unix)
			rv, _ := r.Median(row, RDMA)
			rg, _ := r.Median(row, RDMARings)
			f := bytesPerSec.format
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", sizeName(s), f(m), f(tcp), f(ux), f(rv), f(rg),
				ratio(rv, tcp), ratio(rg, tcp), ratio(rv, m))
		}
	}

	if len(r.Idle) > 0 {
		fmt.Fprintf(w, "\nIdle connections, opened one at a time to a server in a child process (raw: net.Conns; gRPC: a grpc.ClientConn each, which made one 64 B RPC, to a grpc-go server); RSS growth per connection of each process, after a GC: once all are set up, and again once idle for the idle shrink time (rdmagrpc's WithIdleShrink set to it in both processes, time compressed; its default is %v), when rdmagrpc's directions have parked their small rings:\n\n", conn.DefaultIdleShrink)
		fmt.Fprintf(w, "| connections | kind | transport | held | set-up | RSS per connection, client / server: set up | idle | parked | goroutines per connection, client / server | registered per side |\n")
		fmt.Fprintf(w, "|---:|---|---|---|---:|---:|---:|---:|---:|---:|\n")
		for _, i := range r.Idle {
			held := thousands(float64(i.Held))
			if i.Err != nil {
				held += " (failed: " + oneLine(i.Err.Error()) + ")"
			}
			reg := "—"
			if i.Transport == RDMA && i.Held > 0 {
				reg = thousands(i.RegPerSide) + " B"
			}
			name := i.Transport
			if name == RDMA {
				name = rd
			}
			kind := "raw"
			if i.GRPC {
				kind = "gRPC"
			}
			idleRSS, parked := "—", "—"
			if i.After > 0 {
				idleRSS = fmt.Sprintf("%s / %s after %v", kib(i.RSSClientIdle), kib(i.RSSServerIdle), i.After)
				if i.Transport == RDMA {
					parked = fmt.Sprintf("%.0f%%", 100*i.Parked)
				}
			}
			fmt.Fprintf(w, "| %s | %s | %s | %s | %v | %s / %s | %s | %s | %.2f / %.2f | %s |\n", thousands(float64(i.Want)), kind, name, held,
				i.Setup.Round(time.Millisecond), kib(i.RSSClient), kib(i.RSSServer), idleRSS, parked, i.GoroutinesClient, i.GoroutinesServer, reg)
		}
	}

	r.stepsMarkdown(w)
	r.fleetMarkdown(w)

	fmt.Fprintf(w, "\nrdmagrpc:\n\n| figure | value |\n|---|---:|\n")
	if v, ok := r.Median(rowEnlarge(), RDMA); ok {
		mx, _ := r.Median(rowEnlargeMax(), RDMA)
		fmt.Fprintf(w, "| enlargement, first 32 KiB write to usable large buffers: p50 (median of rounds) | %s |\n", seconds.format(v))
		fmt.Fprintf(w, "| enlargement: slowest of a round (median of rounds) | %s |\n", seconds.format(mx))
		fmt.Fprintf(w, "| enlargements measured | %d |\n", len(r.Enlarge))
	}
	st := r.Steady
	if st.Err != nil {
		fmt.Fprintf(w, "| registrations in steady state | failed: %s |\n", oneLine(st.Err.Error()))
	} else {
		fmt.Fprintf(w, "| registrations in steady state (%s unary RPCs, %d of each size; %d streams of %s; %.1f MiB of raw writes by rendezvous) | %d |\n",
			thousands(float64(st.RPCs)), st.RPCs/max(len(c.Sizes), 1), st.Streams, sizeName(c.StreamSize), float64(st.RawBytes)/(1<<20), st.Registrations)
		if len(st.Sizes) > 0 {
			names := make([]string, len(st.Sizes))
			for i, n := range st.Sizes {
				names[i] = sizeName(n)
			}
			fmt.Fprintf(w, "| their sizes, in order | %s |\n", strings.Join(names, ", "))
		}
		fmt.Fprintf(w, "| registrations while warming up (connections, enlargements, first rendezvous) | %d |\n", st.Warmup)
	}

	fmt.Fprintf(w, "\nGoals (two processes; idle and steady state), %s on this machine, as ratios in this run:\n\n| goal | measured | met |\n|---|---|---|\n", r.Provider)
	for _, g := range r.Goals() {
		met := "no"
		if g.Met {
			met = "yes"
		}
		fmt.Fprintf(w, "| %s | %s | %s |\n", g.Name, g.Got, met)
	}
}

func oneLine(s string) string { return strings.ReplaceAll(s, "|", "/") }

// Goal is one of the issues' goals, judged on this run's figures.
type Goal struct {
	Name string
	Got  string
	Met  bool
}

// Goals judges the two-process figures against their goals, and the idle
// and steady-state ones.
func (r *Report) Goals() []Goal {
	gs := r.twoProcGoals()
	var reg float64
	var most, held int
	var failed []string
	for _, i := range r.Idle {
		if i.Transport != RDMA {
			continue
		}
		reg = max(reg, i.RegPerSide)
		if i.Want > most {
			most, held = i.Want, i.Held
		}
		if i.Err != nil {
			failed = append(failed, thousands(float64(i.Held))+" of "+thousands(float64(i.Want)))
		}
	}
	if most > 0 {
		gs = append(gs, Goal{"≤ 8 KiB registered per idle connection per side", thousands(reg) + " B", reg > 0 && reg <= 8<<10})
		got := thousands(float64(held)) + " held"
		if len(failed) > 0 {
			got = strings.Join(failed, "; ") + " held"
		}
		gs = append(gs, Goal{fmt.Sprintf("%s idle connections held", thousands(float64(most))), got, held == most && len(failed) == 0})
	}
	gs = append(gs, r.idleGoals()...)
	if r.Steady.Err == nil {
		gs = append(gs, Goal{"0 registrations in steady state", fmt.Sprint(r.Steady.Registrations), r.Steady.Registrations == 0})
	} else {
		gs = append(gs, Goal{"0 registrations in steady state", "not measured: " + oneLine(r.Steady.Err.Error()), false})
	}
	return gs
}

// idleGoals judges the idle figures against their goals, at the largest
// count measured of each kind: rdmagrpc against TCP in the same run.
func (r *Report) idleGoals() []Goal {
	var gs []Goal
	for _, gRPC := range []bool{false, true} {
		var tcp, rdma *IdleResult
		for i := range r.Idle {
			x := &r.Idle[i]
			if x.GRPC != gRPC || x.Err != nil {
				continue
			}
			switch {
			case x.Transport == TCP && (tcp == nil || x.Want > tcp.Want):
				tcp = x
			case x.Transport == RDMA && (rdma == nil || x.Want > rdma.Want):
				rdma = x
			}
		}
		if tcp == nil || rdma == nil || tcp.Want != rdma.Want {
			continue
		}
		at := fmt.Sprintf(" (%s held)", thousands(float64(rdma.Want)))
		// Idle: once the connections sat idle (parked), where measured.
		rc, rs, tc, ts := rdma.RSSClient, rdma.RSSServer, tcp.RSSClient, tcp.RSSServer
		if rdma.After > 0 && tcp.After > 0 {
			rc, rs, tc, ts = rdma.RSSClientIdle, rdma.RSSServerIdle, tcp.RSSClientIdle, tcp.RSSServerIdle
			at = fmt.Sprintf(" (%s held, idle %v)", thousands(float64(rdma.Want)), rdma.After)
		}
		// One dial's median is judged with the dials (twoproc.go); a loop
		// of set-ups also meets what each leaves behind (fresh pages,
		// the heap of those held, the listener behind).
		kind := "raw"
		if gRPC {
			kind = "gRPC"
		}
		if tcp.Setup > 0 && rdma.Setup > 0 {
			rm, tm := rdma.SetupMedian(), tcp.SetupMedian()
			x := float64(rm) / float64(tm)
			got := fmt.Sprintf("%.2f× (%v against %v)", x, rm.Round(time.Millisecond), tm.Round(time.Millisecond))
			if k := len(rdma.SetupMore) + 1; k > 1 && len(tcp.SetupMore)+1 == k {
				got = fmt.Sprintf("%.2f× (medians of %d loops, interleaved: %v against %v; the first %v against %v)", x, k,
					rm.Round(time.Millisecond), tm.Round(time.Millisecond), rdma.Setup.Round(time.Millisecond), tcp.Setup.Round(time.Millisecond))
			}
			gs = append(gs, Goal{fmt.Sprintf("%s set-up of %s connections in a loop ≤ 2× TCP's", kind, thousands(float64(rdma.Want))), got, x <= 2})
		}
		if !gRPC {
			gs = append(gs, Goal{"RSS per idle raw connection end ≤ 8 KiB registered + 4 KiB" + at,
				kib(rc) + " / " + kib(rs), max(rc, rs) <= 12<<10})
			gs = append(gs, Goal{"≤ 0.1 goroutines per idle raw connection end" + at,
				fmt.Sprintf("%.2f / %.2f", rdma.GoroutinesClient, rdma.GoroutinesServer), max(rdma.GoroutinesClient, rdma.GoroutinesServer) <= 0.1})
			continue
		}
		gs = append(gs, Goal{"RSS per idle gRPC connection ≤ TCP's + 16 KiB on each side" + at,
			fmt.Sprintf("%s / %s (TCP %s / %s)", kib(rc), kib(rs), kib(tc), kib(ts)),
			rc <= tc+16<<10 && rs <= ts+16<<10})
		gs = append(gs, Goal{"goroutines per idle gRPC connection: none beyond grpc-go's own" + at,
			fmt.Sprintf("%.2f / %.2f (TCP %.2f / %.2f)", rdma.GoroutinesClient, rdma.GoroutinesServer, tcp.GoroutinesClient, tcp.GoroutinesServer),
			rdma.GoroutinesClient <= tcp.GoroutinesClient+0.1 && rdma.GoroutinesServer <= tcp.GoroutinesServer+0.1})
	}
	return gs
}

// stepsMarkdown breaks a dial down into the steps its provider timed
// (verbs: rdma_cm's), beside TCP's whole dial, for each idle run whose
// provider timed any.
func (r *Report) stepsMarkdown(w io.Writer) {
	for _, i := range r.Idle {
		if len(i.Steps) == 0 {
			continue
		}
		kind := "raw"
		if i.GRPC {
			kind = "gRPC"
		}
		var tcp time.Duration
		for _, j := range r.Idle {
			if j.Transport == TCP && j.GRPC == i.GRPC && j.Want == i.Want {
				tcp = j.DialP50
			}
		}
		fmt.Fprintf(w, "\nOne dial of the %s idle run (%s connections), step by step as the provider timed it on the dialing side (medians over the dials):\n\n| step | median |\n|---|---:|\n",
			kind, thousands(float64(i.Want)))
		var sum time.Duration
		for _, st := range i.Steps {
			fmt.Fprintf(w, "| %s | %v |\n", st.Name, st.Took.Round(time.Microsecond))
			sum += st.Took
		}
		fmt.Fprintf(w, "| the provider's steps together | %v |\n", sum.Round(time.Microsecond))
		fmt.Fprintf(w, "| the whole dial (conn.Dial: these, and the connection's PD, CQ, rings and their registration) | %v |\n", i.DialP50.Round(time.Microsecond))
		if tcp > 0 {
			fmt.Fprintf(w, "| a TCP dial, the same run | %v |\n", tcp.Round(time.Microsecond))
		}
	}
}
