package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// Config says what to measure and for how long.
type Config struct {
	BenchTime   time.Duration // per measurement and transport, per round
	Rounds      int           // interleaved rounds; medians are reported
	Sizes       []int         // unary request and response sizes (each way)
	Concurrency []int         // concurrent callers for QPS
	QPSSize     int           // unary size of the QPS runs
	StreamSize  int           // server-streamed message size (one-process table, steady state)
	StreamSizes []int         // message sizes of every stream direction, two processes
	RawSizes    []int         // raw net.Conn write sizes
	Idle        []int         // idle connection counts
	Fleet       int           // fleet connections (0: no fleet figure)
	FleetShrink time.Duration // the fleet's WithIdleShrink, time compressed
	// IdleAfter: the idle connections' WithIdleShrink, time compressed;
	// they are measured when set up and again once idle that long (their
	// small rings parked). 0: only when set up.
	IdleAfter  time.Duration
	Enlarge    int    // fresh connections enlarged per round
	Provider   string // rdmagrpc's provider; "": conn's own choice
	OneProcess bool   // also the one-process figures (a second table)
	// Load is how many CPU-bound processes run beside client and server
	// for the whole run: a busy host, as services share theirs.
	Load        int
	ConnOptions []conn.Option // for every rdmagrpc connection (not the idle server's)
	// HeapProfile: where to write a heap profile of this process (the
	// dialing ends) while idle connections are held, as
	// HeapProfile.<raw|gRPC>.<count>.<transport>; empty: none.
	HeapProfile string
	Log         io.Writer // progress; nil: none
}

// DefaultConfig is what `make bench` runs.
func DefaultConfig() Config {
	return Config{
		BenchTime:   300 * time.Millisecond,
		Rounds:      5,
		Sizes:       []int{64, 1 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20},
		Concurrency: []int{1, 8, 64},
		QPSSize:     64,
		StreamSize:  1 << 20,
		StreamSizes: []int{64 << 10, 1 << 20, 4 << 20},
		RawSizes:    []int{32 << 10, 1 << 20, 16 << 20},
		Idle:        []int{1000, 10000},
		Fleet:       1000,
		FleetShrink: 200 * time.Millisecond,
		IdleAfter:   time.Second,
		Enlarge:     10,
		OneProcess:  true,
	}
}

// key names one measured figure: a row of a table and a column.
type key struct{ row, col string }

// Report holds every figure of one run.
type Report struct {
	Config   Config
	Machine  Machine
	Provider string // rdmagrpc's provider, as Stats reports it
	// vals holds one value per round, in base units (seconds, bytes,
	// bytes or calls per second).
	vals    map[key][]float64
	Enlarge []time.Duration // every sample, sorted
	Steady  SteadyResult
	Idle    []IdleResult
	Fleet   []FleetResult // shrink on, then off
	Elapsed time.Duration
}

func (r *Report) add(row, col string, v float64) {
	k := key{row, col}
	r.vals[k] = append(r.vals[k], v)
}

// Median of the rounds' values, and whether there are any.
func (r *Report) Median(row, col string) (float64, bool) {
	v := slices.Clone(r.vals[key{row, col}])
	if len(v) == 0 {
		return 0, false
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2], true
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2, true
}

// Row names.
func rowP50(size int) string { return "unary " + sizeName(size) + " p50" }
func rowP99(size int) string { return "unary " + sizeName(size) + " p99" }
func rowQPS(c int) string    { return fmt.Sprintf("QPS c=%d", c) }
func rowCPU(c int) string    { return fmt.Sprintf("CPU/RPC c=%d", c) }
func rowStream(n int) string { return "stream " + sizeName(n) }

// rowStreamDir names a stream direction's figure; the server's keeps
// rowStream's name.
func rowStreamDir(dir string, n int) string {
	switch dir {
	case fromClient:
		return "client stream " + sizeName(n)
	case duplex:
		return "duplex echo " + sizeName(n)
	}
	return rowStream(n)
}
func rowRaw(size int) string { return "raw " + sizeName(size) }
func rowEnlarge() string     { return "enlargement p50" }
func rowEnlargeMax() string  { return "enlargement max" }
func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// Raw connection variants beside the grpc transports.
const (
	RDMARings = "rdmagrpc-rings" // rendezvous off: WithRendezvousThreshold(-1)
	Bufconn   = "bufconn"        // grpc-go's in-memory transport, one process: the ceiling
	Memcpy    = "memcpy"
)

func (c *Config) logf(format string, args ...any) {
	if c.Log != nil {
		fmt.Fprintf(c.Log, format, args...)
	}
}

// Run measures everything cfg asks for.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	start := time.Now()
	rep := &Report{Config: cfg, Machine: describeMachine(), vals: map[key][]float64{}}
	dir, err := os.MkdirTemp("", "rdmabench")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if cfg.Provider != "" {
		cfg.ConnOptions = append(slices.Clip(cfg.ConnOptions), conn.WithProvider(cfg.Provider))
	}
	stopLoad, err := startLoad(cfg.Load)
	if err != nil {
		return nil, err
	}
	defer stopLoad()
	ts := transports(dir, cfg.ConnOptions...)
	rawTs := append(slices.Clone(ts), rdma(append(slices.Clip(cfg.ConnOptions), conn.WithRendezvousThreshold(-1))...))
	rawTs[len(rawTs)-1].name = RDMARings

	// Which provider conn picked: ask a connection.
	c, s, err := pipe(ctx, ts[2])
	if err != nil {
		return nil, fmt.Errorf("rdmagrpc: %w", err)
	}
	if err := c.(*conn.Conn).Handshake(ctx); err != nil {
		return nil, fmt.Errorf("rdmagrpc: %w", err)
	}
	rep.Provider = c.(*conn.Conn).Stats().Provider
	c.Close()
	s.Close()

	for round := range cfg.Rounds {
		cfg.logf("round %d/%d: two processes\n", round+1, cfg.Rounds)
		for _, size := range cfg.RawSizes {
			rep.add(row2(rowRaw(size)), Memcpy, memcpyBandwidth(size, cfg.BenchTime))
		}
		if err := rep.dials(ctx, rotate(ts, round)); err != nil {
			return nil, fmt.Errorf("round %d, two processes: dials: %w", round+1, err)
		}
		for _, t := range rotate(append(rawTs, bufconnNetwork()), round) {
			if t.name == Unix && Remote() {
				continue // no unix socket reaches another host
			}
			if err := rep.twoProcess(ctx, t); err != nil {
				return nil, fmt.Errorf("round %d, two processes: %w", round+1, err)
			}
		}
		if !cfg.OneProcess {
			continue
		}
		cfg.logf("round %d/%d: one process\n", round+1, cfg.Rounds)
		if err := rep.round(ctx, rotate(ts, round), rotate(rawTs, round)); err != nil {
			return nil, fmt.Errorf("round %d: %w", round+1, err)
		}
	}
	cfg.logf("steady state: registrations\n")
	rep.Steady = steady(ctx, rep.Provider, &cfg, cfg.BenchTime)
	for _, gRPC := range []bool{false, true} {
		for _, n := range cfg.Idle {
			for _, t := range []network{ts[0], ts[2]} {
				kind := "raw"
				if gRPC {
					kind = "gRPC"
				}
				cfg.logf("idle: %d %s %s connections\n", n, kind, t.name)
				rep.Idle = append(rep.Idle, idle(ctx, cfg.idleNetwork(t), cfg.Provider, n, gRPC, cfg.IdleAfter, cfg.HeapProfile))
			}
		}
	}
	// The raw loops again, transports interleaved, so that their ratio is
	// of medians as the other figures are: one loop of 10,000 over TCP
	// took 0.24 s in one run and 0.43 s in another. (The gRPC loops, ten
	// seconds each, are run once.)
	for round := 1; round < cfg.Rounds; round++ {
		for _, n := range cfg.Idle {
			for _, t := range rotate([]network{ts[0], ts[2]}, round) {
				cfg.logf("set-up loop %d/%d: %d raw %s connections\n", round+1, cfg.Rounds, n, t.name)
				r := idle(ctx, cfg.idleNetwork(t), cfg.Provider, n, false, 0, "")
				if r.Err != nil {
					continue
				}
				for i := range rep.Idle {
					if e := &rep.Idle[i]; !e.GRPC && e.Want == n && e.Transport == t.name && e.Err == nil {
						e.SetupMore = append(e.SetupMore, r.Setup)
					}
				}
			}
		}
	}
	if cfg.Fleet > 0 {
		for _, d := range []time.Duration{cfg.FleetShrink, -1} {
			cfg.logf("fleet: %d connections, idle shrink %v\n", cfg.Fleet, d)
			rep.Fleet = append(rep.Fleet, fleet(ctx, cfg.Provider, cfg.Fleet, d))
		}
	}
	slices.Sort(rep.Enlarge)
	rep.Elapsed = time.Since(start)
	return rep, nil
}

// rotate starts round r at a different network, so that none is always
// measured first (or right after another).
// idleNetwork is t as the idle connections use it: rdmagrpc's with
// WithIdleShrink set to the idle time, where there is one.
func (cfg *Config) idleNetwork(t network) network {
	if t.name == RDMA && cfg.IdleAfter > 0 {
		return rdma(append(slices.Clone(cfg.ConnOptions), conn.WithIdleShrink(cfg.IdleAfter))...)
	}
	return t
}

func rotate[T any](s []T, r int) []T {
	r %= len(s)
	return append(slices.Clone(s[r:]), s[:r]...)
}

// round measures every grpc-go figure on every transport, then the raw
// connections, then enlargements: transports interleaved within each
// figure.
func (rep *Report) round(ctx context.Context, ts, rawTs []network) error {
	cfg := &rep.Config
	d := cfg.BenchTime
	rigs := make([]*rig, 0, len(ts))
	defer func() {
		for _, r := range rigs {
			r.close()
		}
	}()
	for _, t := range ts {
		r, err := newRig(ctx, t)
		if err != nil {
			return err
		}
		rigs = append(rigs, r)
		// Warm up: connection, enlargement, grpc-go's buffers and
		// flow-control windows.
		for _, size := range cfg.Sizes {
			if err := r.unary(ctx, size); err != nil {
				return err
			}
		}
		if _, err := r.stream(ctx, cfg.StreamSize, 0); err != nil {
			return err
		}
	}
	for _, size := range cfg.Sizes {
		for _, r := range rigs {
			p50, p99, err := r.latency(ctx, size, d)
			if err != nil {
				return err
			}
			rep.add(rowP50(size), r.t.name, p50.Seconds())
			rep.add(rowP99(size), r.t.name, p99.Seconds())
		}
	}
	for _, c := range cfg.Concurrency {
		for _, r := range rigs {
			q, cpu, err := r.qps(ctx, c, cfg.QPSSize, d)
			if err != nil {
				return err
			}
			rep.add(rowQPS(c), r.t.name, q)
			rep.add(rowCPU(c), r.t.name, cpu.Seconds())
		}
	}
	for _, r := range rigs {
		bps, err := r.stream(ctx, cfg.StreamSize, d)
		if err != nil {
			return err
		}
		rep.add(rowStream(cfg.StreamSize), r.t.name, bps)
	}
	for _, size := range cfg.RawSizes {
		for _, t := range rawTs {
			bps, err := rawThroughput(ctx, t, size, d)
			if err != nil {
				return err
			}
			rep.add(rowRaw(size), t.name, bps)
		}
	}
	if cfg.Enlarge > 0 {
		for _, t := range ts {
			if t.name != RDMA {
				continue
			}
			e, err := enlargements(ctx, t, cfg.Enlarge)
			if err != nil {
				return err
			}
			rep.Enlarge = append(rep.Enlarge, e...)
			rep.add(rowEnlarge(), RDMA, e[len(e)/2].Seconds())
			rep.add(rowEnlargeMax(), RDMA, e[len(e)-1].Seconds())
		}
	}
	return nil
}
