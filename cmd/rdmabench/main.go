// Command rdmabench is `make bench`: grpc-go over TCP loopback, a unix
// socket and rdmagrpc, side by side in one run, printed as markdown.
//
//	rdmabench [-benchtime 300ms] [-rounds 5] [-idle 1000,10000] [-o file]
//
// Across two hosts (the rxe tier's two guests), the server children run
// on the other one: there `rdmabench -spawner :7470 -host B`, here
// `rdmabench -remote B:7470 -host A`.
//
// Beside the RDMA device's own reference tools (perftest over rdma_cm,
// rsockets' rstream) instead, raw net.Conn figures only:
//
//	rdmabench -ref -provider verbs -host ADDR [-raw 64,32768,1048576] [-rounds 3]
//
// with the server halves on another host: there `rdmabench -refcontrol
// :7480`, here `rdmabench -ref -refpeer B:7480 -host B`.
//
// Progress goes to stderr, the tables to stdout (and to -o).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/bench"
)

func main() {
	bench.ServeIdleIfChild()
	if len(os.Args) > 1 && os.Args[1] == "refchild" {
		os.Exit(refChild(os.Args[2:]))
	}
	cfg := bench.DefaultConfig()
	flag.DurationVar(&cfg.BenchTime, "benchtime", cfg.BenchTime, "measuring time per figure and transport, per round")
	flag.IntVar(&cfg.Rounds, "rounds", cfg.Rounds, "interleaved rounds (medians are reported)")
	idle := flag.String("idle", ints(cfg.Idle), "idle connection counts, comma-separated (empty: none)")
	provider := flag.String("provider", "", "rdmagrpc provider (default: conn's own choice)")
	flag.IntVar(&cfg.Fleet, "fleet", cfg.Fleet, "fleet connections (one 256 KiB message each, idle shrink on and off; 0: none)")
	flag.DurationVar(&cfg.FleetShrink, "fleetshrink", cfg.FleetShrink, "the fleet's idle shrink (time compressed)")
	flag.StringVar(&cfg.HeapProfile, "heapprofile", "", "write a heap profile of the dialing process while idle connections are held, to FILE.<raw|gRPC>.<count>.<transport>")
	flag.DurationVar(&cfg.IdleAfter, "idleafter", cfg.IdleAfter, "the idle connections' idle shrink (time compressed): they are measured again once idle that long; 0: only when set up")
	flag.IntVar(&cfg.Load, "load", cfg.Load, "CPU-bound processes to run beside client and server (a busy host)")
	sizes := flag.String("sizes", ints(cfg.Sizes), "unary sizes, comma-separated")
	conc := flag.String("conc", ints(cfg.Concurrency), "QPS concurrencies, comma-separated")
	raw := flag.String("raw", ints(cfg.RawSizes), "raw net.Conn write sizes, comma-separated")
	streams := flag.String("streams", ints(cfg.StreamSizes), "message sizes of the stream directions (server, client, duplex), comma-separated (empty: none)")
	flag.IntVar(&cfg.Enlarge, "enlarge", cfg.Enlarge, "fresh connections enlarged per round")
	out := flag.String("o", "", "also write the tables to this file")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run (and of each server child to FILE.server.<transport>, its last round)")
	flag.BoolVar(&cfg.OneProcess, "oneprocess", cfg.OneProcess, "also measure client and server in one process (a second table, for reference)")
	host := flag.String("host", "", "address rdmagrpc listens on (default 127.0.0.1; an RDMA device's address with verbs)")
	spawner := flag.String("spawner", "", "serve server children on this TCP address for a bench run on another host (-remote there), until that run ends; needs -host")
	remote := flag.String("remote", "", "run the server children on another host, through its -spawner at this host:port")
	ref := flag.Bool("ref", false, "instead of the figures above: rdmagrpc's raw net.Conn (-raw sizes, and a ping-pong) beside perftest and rstream on an RDMA device")
	refControlAddr := flag.String("refcontrol", "", "serve the server halves of a -ref run on another host (-refpeer there) on this TCP address, until it ends")
	refPeer := flag.String("refpeer", "", "with -ref: run the server halves through the -refcontrol at this host:port")
	refDev := flag.String("refdev", "rxe0", "with -ref: perftest's device")
	refGID := flag.Int("refgid", 1, "with -ref: perftest's GID index")
	refMB := flag.Int("refmb", 128, "with -ref: MiB per bandwidth figure, one way")
	refMsgs := flag.Int("refmsgs", 100000, "with -ref: at most this many messages per bandwidth figure")
	refLat := flag.Int("reflat", 20000, "with -ref: round trips per latency figure (64 B each way)")
	refConns := flag.Int("refconns", 0, "with -ref: above 1, the bandwidth sizes again over this many connections at once, against ib_write_bw -q")
	flag.Parse()
	if cfg.HeapProfile != "" {
		// Every allocation of a connection, not one per 512 KiB: the
		// profile is read per connection.
		runtime.MemProfileRate = 64
	}
	if *ref || *refControlAddr != "" {
		rs, err := parseInts(*raw)
		if err != nil {
			fatal(fmt.Errorf("-raw: %w", err))
		}
		var w io.Writer = os.Stdout
		if *out != "" {
			f, err := os.Create(*out)
			if err != nil {
				fatal(err)
			}
			defer f.Close()
			w = io.MultiWriter(os.Stdout, f)
		}
		refMain(refConfig{
			sizes: rs, latSize: 64, rounds: cfg.Rounds, server: *host, dev: *refDev, gid: *refGID,
			provider: *provider, bytes: int64(*refMB) << 20, maxMsgs: *refMsgs, latIters: *refLat, conns: *refConns,
			peer: *refPeer, basePort: 20000, log: os.Stderr, timeout: 3 * time.Minute, startWait: 300 * time.Millisecond,
		}, *refControlAddr, w)
		return
	}
	if *host != "" {
		os.Setenv(bench.HostEnv, *host)
	}
	if *spawner != "" {
		if *host == "" {
			fatal(fmt.Errorf("-spawner needs -host: the address the other host reaches this one at"))
		}
		raiseNoFile()
		l, err := net.Listen("tcp", *spawner)
		if err != nil {
			fatal(fmt.Errorf("-spawner: %w", err))
		}
		if err := bench.Spawn(context.Background(), l, *host); err != nil {
			fatal(err)
		}
		return
	}
	if *remote != "" {
		os.Setenv(bench.RemoteEnv, *remote)
	}

	var err error
	if cfg.Idle, err = parseInts(*idle); err != nil {
		fatal(fmt.Errorf("-idle: %w", err))
	}
	if cfg.Sizes, err = parseInts(*sizes); err != nil {
		fatal(fmt.Errorf("-sizes: %w", err))
	}
	if cfg.Concurrency, err = parseInts(*conc); err != nil {
		fatal(fmt.Errorf("-conc: %w", err))
	}
	if cfg.RawSizes, err = parseInts(*raw); err != nil {
		fatal(fmt.Errorf("-raw: %w", err))
	}
	if cfg.StreamSizes, err = parseInts(*streams); err != nil {
		fatal(fmt.Errorf("-streams: %w", err))
	}
	cfg.Provider = *provider
	cfg.Log = os.Stderr
	if lim, err := raiseNoFile(); err != nil {
		fmt.Fprintf(os.Stderr, "rdmabench: open files limit stays at %d: %v\n", lim, err)
	} else {
		fmt.Fprintf(os.Stderr, "rdmabench: open files limit %d\n", lim)
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fatal(err)
		}
		defer pprof.StopCPUProfile()
		// The servers in child processes profile themselves too.
		os.Setenv(bench.ServerProfileEnv, *cpuprofile+".server")
	}
	// The file is made before the run: a run of minutes should not end
	// in a path that cannot be written, with its tables lost.
	var w io.Writer = os.Stdout
	if *out != "" {
		f, err := os.Create(*out)
		if err != nil {
			fatal(err)
		}
		defer f.Close()
		w = io.MultiWriter(os.Stdout, f)
	}
	rep, err := bench.Run(context.Background(), cfg)
	if serr := bench.StopRemote(); serr != nil {
		fmt.Fprintln(os.Stderr, "rdmabench:", serr)
	}
	if err != nil {
		fatal(err)
	}
	rep.Markdown(w)
}

// raiseNoFile lifts the open files limit as far as the kernel allows
// (fs.nr_open; only root may raise the hard limit): idle connections
// hold descriptors on both ends, and the shm provider several per end.
func raiseNoFile() (uint64, error) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 0, err
	}
	want := lim.Max
	if b, err := os.ReadFile("/proc/sys/fs/nr_open"); err == nil {
		if n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil && n > want {
			want = n
		}
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: want, Max: want}); err != nil {
		// Not root: the soft limit up to the hard one is still allowed.
		lim.Cur = lim.Max
		if err2 := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err2 != nil {
			return lim.Cur, err2
		}
		return lim.Cur, fmt.Errorf("hard limit not raised: %w", err)
	}
	return want, nil
}

func ints(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

func parseInts(s string) ([]int, error) {
	var v []int
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("%q is not a count", f)
		}
		v = append(v, n)
	}
	return v, nil
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "rdmabench:", err)
	os.Exit(1)
}
