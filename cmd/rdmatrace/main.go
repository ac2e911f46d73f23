// Command rdmatrace shows, live, what memory registration costs the
// processes of this machine: libibverbs' ibv_reg_mr family in any program,
// and rdmagrpc's shm provider and buffer enlargements in Go binaries. It
// uses eBPF uprobes (package bpf), so the traced programs need no change
// and no restart.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

const usage = `rdmatrace — watch RDMA memory registration live, with eBPF.

Registering memory (ibv_reg_mr and friends) pins pages and programs the NIC;
it is slow, and rdmagrpc's buffer-enlargement protocol exists to do less of
it. rdmatrace shows, per process: registrations per second, bytes
registered, registered memory still held (LIVE), the latency of each
registration call (histogram, p50, p99), and rdmagrpc's buffer enlargements
as they happen. The traced programs are not changed or restarted.

What is traced:
  libibverbs.so.1   ibv_reg_mr (through ibv_reg_mr_iova2), ibv_reg_dmabuf_mr,
                    ibv_rereg_mr, ibv_dereg_mr, in every program using it.
                    Found automatically (the copy a --pid process has loaded,
                    else the one the dynamic linker uses); --lib overrides.
  Go binaries       rdmagrpc's shm provider registrations and connection
                    enlargements. Give the program file with --binary, or
                    --pid (its executable is used), or neither: then every
                    process is watched, those running now and those started
                    later (/proc is scanned every 250 ms; each executable is
                    probed once, so a new file's first 250 ms may be missed).
                    Stripped binaries (-ldflags=-s -w), -trimpath and PIE
                    builds work (.gopclntab); so do programs in containers
                    when rdmatrace sees the host's PID namespace.

Usage:
  sudo rdmatrace [flags]          the live view (plain lines when stdout is not a terminal)
  rdmatrace doctor [flags]        check this machine and the RDMAGRPC_* settings for rdmagrpc;
                                  exit 0 when a service would work here, --json (rdmatrace doctor --help)
  rdmatrace conns [flags]         list open rdmagrpc connections, as ss lists sockets (rdmatrace conns --help)

Flags:
%s
Keys in the live view:
  s / S    next / previous sort column (reg/s, regs, registered, live, p99, pid)
  r        reverse the sort order
  /        filter: type part of a command name or pid, Enter to apply, Esc to cancel
  c, Esc   clear the filter
  x        hide / show processes that exited
  ↑ ↓      select the process whose connections and latency histogram are shown
  q        quit

Columns: REG/s registrations per second over the last interval; REGS and
FAIL successful and failed registrations; REGD bytes registered in total;
LIVE bytes registered and not yet released, counted from when rdmatrace
started (a * means the process released memory registered before that);
p50/p99 over its last 4096 registrations; ENL enlargements, SHR shrinks
(either direction back to small). Below the table, for the selected
process: its open connections by provider (shm, verbs, tcp; "≥" when the
process ran before rdmatrace, whose earlier connections send no marker
and are counted only where their sockets show them), by phase, and its
parks (an idle small ring's pages given back). The RDMA ports' error
counters (sysfs hw_counters and counters) are shown with their rates.
Connections are named "conn N" as in rdmagrpc's spans
(rdmagrpc.connection.id N) and conn.ConnName: N is unique in its process.

Plain output (stdout not a terminal, or --plain): one line per
connection open/close, enlargement, shrink and park, and every interval
one summary line per process with events and one per RDMA port whose
error counters moved; fields TIME PID COMM KIND CONN, then key=value.

Examples:
  sudo rdmatrace                               # everything on this machine
  sudo rdmatrace --pid 4242                    # one process
  sudo rdmatrace --binary ./server --binary ./client
  sudo rdmatrace --json --duration 10s > regs.jsonl   # for scripts
  sudo rdmatrace --duration 60s | grep ' enlarge '      # plain lines
  sudo rdmatrace conns                          # open connections

Needs root (CAP_BPF and CAP_PERFMON) and a kernel with BPF uprobes and ring
buffers (5.15 or later). Probing costs each traced call a few microseconds
to tens of microseconds (two traps into the kernel per call).
`

type config struct {
	pid       int
	binaries  []string
	lib       string
	noVerbs   bool
	noScan    bool
	jsonOut   bool
	duration  time.Duration
	interval  time.Duration
	goPackage string
	plain     bool
	sysfs     string
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("rdmatrace", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&c.pid, "pid", 0, "trace only this process (default: every process)")
	fs.Var((*multiFlag)(&c.binaries), "binary", "Go `program` file using rdmagrpc to probe (repeatable)")
	fs.StringVar(&c.lib, "lib", "", "libibverbs.so.1 `path` (default: found automatically)")
	fs.BoolVar(&c.noVerbs, "no-verbs", false, "do not probe libibverbs")
	fs.BoolVar(&c.noScan, "no-scan", false, "do not scan running processes for rdmagrpc binaries")
	fs.BoolVar(&c.jsonOut, "json", false, "print one JSON object per event instead of the live view, then one summary per process")
	fs.DurationVar(&c.duration, "duration", 0, "stop after this long, e.g. 30s (default: until q or Ctrl-C)")
	fs.DurationVar(&c.interval, "interval", time.Second, "refresh interval of the live view and its rates")
	fs.BoolVar(&c.plain, "plain", false, "print plain lines even when stdout is a terminal (the default when it is not)")
	fs.StringVar(&c.sysfs, "sysfs", "/sys", "sysfs `root` to read the RDMA ports' counters from")
	fs.StringVar(&c.goPackage, "go-package", "", "import `path` to look for rdmagrpc's probe functions under, for binaries that vendor or rename it (e.g. main)")
	setUsage(fs, stderr, usage)
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q (see --help)", fs.Arg(0))
	}
	if c.interval <= 0 {
		return c, errors.New("--interval must be positive")
	}
	if c.pid < 0 || c.duration < 0 {
		return c, errors.New("--pid and --duration must not be negative")
	}
	return c, nil
}

// setUsage makes fs's usage text the format usage with the flag defaults
// in place of its %s.
func setUsage(fs *flag.FlagSet, stderr io.Writer, usage string) {
	fs.Usage = func() {
		var b strings.Builder
		fs.SetOutput(&b)
		fs.PrintDefaults()
		fs.SetOutput(stderr)
		fmt.Fprintf(stderr, usage, b.String())
	}
}

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "doctor":
			os.Exit(runDoctor(os.Args[2:], os.Stdout, os.Stderr))
		case "conns":
			os.Exit(runConns(os.Args[2:], os.Stdout, os.Stderr))
		}
	}
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "rdmatrace:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "rdmatrace:", err)
		os.Exit(1)
	}
}
