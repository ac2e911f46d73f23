package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bpf"
	"github.com/rdmagrpc/rdmagrpc/conn"
)

// rdmatrace conns: the open rdmagrpc connections of this machine, one
// line each, as ss lists sockets. Two sources, and each row says which:
// the sockets (shm connections open now, found without probes: process,
// role and peer, but not the connection's id, phase or memory), and,
// with --trace, the probes' markers over a window (id, provider and
// phase of the connections that open or change in it).

const connsUsage = `rdmatrace conns: list the open rdmagrpc connections, as ss lists sockets.

Usage: rdmatrace conns [--trace 5s] [--pid PID]

Without --trace (no root needed for your own processes; root sees all),
lists the shm connections open now from the machine's unix sockets: the
process, its role (server: the accepting end; client), the listener's
address and the peer process. With --trace (root), also watches the probes
for that long and lists the connections that opened meanwhile with their
id, provider (shm, verbs, tcp), phase and why each has its provider (the
peer on this host, on another host, pinned, or the process's provider). What neither source can see is
printed as "?" and explained under the table.

Flags:
%s`

// connRow is one line of the listing.
type connRow struct {
	PID      int
	Comm     string
	ID       string // "?" when not seen
	Provider string
	Role     string
	Phase    string
	Listener string // the listener's host:port (the server end's own)
	PeerPID  string // "?" when not seen
	Why      string // why it has its provider, under the table; "": not seen
}

// connsHeader lays a row out in 79 columns; a listener address longer
// than 21 (IPv6) is cut at its start, keeping the port.
const connsHeader = "%7s %-10s %5s %-5s %-6s %-11s %-21s %7s"

func (r connRow) String() string {
	l := r.Listener
	if len(l) > 21 {
		l = "…" + l[len(l)-20:]
	}
	return fmt.Sprintf(connsHeader, fmt.Sprint(r.PID), truncate(r.Comm, 10), r.ID, r.Provider, r.Role,
		truncate(r.Phase, 11), l, r.PeerPID)
}

func runConns(args []string, out, stderr io.Writer) int {
	fs := flag.NewFlagSet("rdmatrace conns", flag.ContinueOnError)
	fs.SetOutput(stderr)
	trace := fs.Duration("trace", 0, "also watch the probes for this long, e.g. 5s (needs root)")
	pid := fs.Int("pid", 0, "list only this process's connections")
	setUsage(fs, stderr, connsUsage)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "rdmatrace conns: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	socks, err := listUnixSockets()
	if err != nil {
		fmt.Fprintln(stderr, "rdmatrace conns: list sockets:", err)
		return 1
	}
	owners := socketOwners("/proc")
	atStart := shmEnds(socks, owners)
	var st *stats
	if *trace > 0 {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		if st, err = traceConns(ctx, *trace, *pid); err != nil {
			fmt.Fprintln(stderr, "rdmatrace conns:", err)
			return 1
		}
		// The ends open at the start that are still open.
		socks, _ = listUnixSockets()
		owners = socketOwners("/proc")
		now := map[uint32]bool{}
		for _, e := range shmEnds(socks, owners) {
			now[e.Inode] = true
		}
		atStart = slices.DeleteFunc(atStart, func(e shmEnd) bool { return !now[e.Inode] })
	}
	rows := connRows(atStart, st, *pid, func(p int) string { return comm("/proc", p) })
	printConns(out, rows, *trace)
	return 0
}

// connRows merges the socket scan's shm ends and the connections the
// probes saw open (st, nil without --trace), filtered to pid unless 0.
func connRows(ends []shmEnd, st *stats, pid int, commOf func(int) string) []connRow {
	var rows []connRow
	for _, e := range ends {
		if pid != 0 && e.PID != pid {
			continue
		}
		role := "client"
		if e.Server {
			role = "server"
		}
		peer := "?"
		if e.PeerPID != 0 {
			peer = fmt.Sprint(e.PeerPID)
		}
		rows = append(rows, connRow{PID: e.PID, Comm: commOf(e.PID), ID: "?", Provider: provShm, Role: role, Phase: "?", Listener: e.Addr, PeerPID: peer})
	}
	if st != nil {
		for _, p := range st.rows(byPID, true, "", false) {
			if pid != 0 && int(p.PID) != pid {
				continue
			}
			ids := make([]uint64, 0, len(p.open))
			for id := range p.open {
				ids = append(ids, id)
			}
			slices.Sort(ids)
			for _, id := range ids {
				rows = append(rows, connRow{PID: int(p.PID), Comm: p.Comm, ID: strings.TrimPrefix(conn.ConnName(id), "conn "),
					Provider: p.open[id], Role: "?", Phase: p.phaseOf(id), Listener: "?", PeerPID: "?", Why: p.why[id]})
			}
		}
	}
	slices.SortStableFunc(rows, func(a, b connRow) int { return a.PID - b.PID })
	return rows
}

// phaseOf is a connection's phase as its markers left it: "tx/rx" of
// small or large, e.g. "large/small".
func (p *proc) phaseOf(id uint64) string {
	ph := func(m map[uint64]bool) string {
		if m[id] {
			return "large"
		}
		return "small"
	}
	return ph(p.sendPhase) + "/" + ph(p.recvPhase)
}

func printConns(out io.Writer, rows []connRow, trace time.Duration) {
	fmt.Fprintf(out, connsHeader+"\n", "PID", "COMM", "CONN", "PROV", "ROLE", "PHASE tx/rx", "LISTENER", "PEERPID")
	for _, r := range rows {
		fmt.Fprintln(out, r)
	}
	if len(rows) == 0 {
		fmt.Fprintln(out, "  (none found)")
	}
	var whys []string
	for _, r := range rows {
		if r.Why != "" && r.ID != "?" {
			whys = append(whys, fmt.Sprintf("  %d conn %s, %s: %s", r.PID, r.ID, r.Provider, r.Why))
		}
	}
	if len(whys) > 0 {
		fmt.Fprintln(out, "\nWhy each traced connection has its provider:")
		for _, w := range whys {
			fmt.Fprintln(out, w)
		}
	}
	fmt.Fprintln(out, "\nWhat this cannot see:")
	notes := []string{
		"rows with CONN ? come from the sockets: shm only, with no connection id or",
		"  phase (only the probes carry them); PEERPID where sock_diag works",
		"verbs and tcp connections opened before tracing: their rdma_cm and TCP",
		"  sockets do not tell an rdmagrpc connection from another",
		"registered bytes per connection: registrations carry no connection id",
		"  (per process: the live view's LIVE)",
		"rows with an id come from the probes: role, listener and peer of such a",
		"  connection are not in its markers",
	}
	if trace == 0 {
		notes = append(notes, "ids, providers and phases: run with --trace 5s (root)")
	} else {
		notes = append(notes, fmt.Sprintf("probe rows: connections opened in the %v traced and still open", trace))
	}
	for _, n := range notes {
		fmt.Fprintln(out, "  "+n)
	}
}

// traceConns runs the probes for d over every rdmagrpc process (or pid)
// and returns what they saw.
func traceConns(ctx context.Context, d time.Duration, pid int) (*stats, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("--trace needs root: eBPF uprobes require CAP_BPF and CAP_PERFMON")
	}
	tr, err := bpf.Open(bpf.Options{PID: pid})
	if err != nil {
		return nil, err
	}
	defer tr.Close()
	_, w := attach(tr, config{pid: pid})
	if w != nil {
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		defer func() { cancel(); <-done }()
		go func() { defer close(done); w.run(wctx) }()
	}
	st := newStats(time.Now())
	end := time.Now().Add(d)
	tr.SetDeadline(end)
	stopped := context.AfterFunc(ctx, func() { tr.Close() })
	defer stopped()
	for time.Now().Before(end) { // a steady stream never lets Read reach its deadline
		ev, err := tr.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, bpf.ErrClosed) {
			return st, nil
		}
		if err != nil {
			return nil, err
		}
		st.add(ev)
	}
	return st, nil
}
