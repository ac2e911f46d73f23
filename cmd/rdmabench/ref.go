package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// -ref: rdmagrpc's raw net.Conn beside the RDMA device's own reference
// tools, in the same run, rounds interleaved, medians: perftest over
// rdma_cm (ib_write_bw, the device's limit; ib_send_bw; ib_write_lat and
// ib_send_lat) and rsockets' rstream (a byte stream over RDMA, as
// rdmagrpc's connection is). Each figure is a server and a client
// process, the server here or on another host (-refpeer).

// Tool names, the columns of the tables.
const (
	refWriteBW  = "ib_write_bw"
	refSendBW   = "ib_send_bw"
	refWriteLat = "ib_write_lat"
	refSendLat  = "ib_send_lat"
	refRstream  = "rstream"
	refRDMA     = "rdmagrpc"
	refRings    = "rdmagrpc-rings" // rendezvous off
)

// refRingsAbove: rdmagrpc's writes above this size go by rendezvous by
// default (the large ring's whole size); at those sizes the rings-only
// figure is measured too.
const refRingsAbove = 512 << 10

type refConfig struct {
	sizes     []int  // bandwidth write sizes
	latSize   int    // the latency figures' request and response size
	rounds    int    // interleaved rounds
	server    string // the address the server halves listen on
	dev       string // the device and GID index perftest uses
	gid       int
	provider  string // rdmagrpc's provider
	bytes     int64  // bytes per bandwidth figure (one way)
	maxMsgs   int    // at most this many messages per bandwidth figure
	latIters  int    // round trips per latency figure
	conns     int    // above 1: the bandwidth sizes again, over this many connections (QPs) at once
	peer      string // host:port of a -refcontrol running the server halves; "": here
	basePort  int
	log       io.Writer
	timeout   time.Duration // per half
	startWait time.Duration // between starting a server half and its client
}

func (c *refConfig) logf(format string, args ...any) {
	if c.log != nil {
		fmt.Fprintf(c.log, format, args...)
	}
}

// count is the messages of a bandwidth figure at size.
func (c *refConfig) count(size int) int {
	n := int(c.bytes / int64(size))
	return max(min(n, c.maxMsgs), 5) // perftest wants at least 5
}

// perQP is perftest's -n for a bandwidth step over s.conns QPs: it
// counts per QP, so the step's messages are shared among them.
func (c *refConfig) perQP(s refStep) int {
	return max(c.count(s.size)/s.conns, 5)
}

// refStep is one figure of one tool.
type refStep struct {
	tool  string
	size  int
	lat   bool
	conns int // above 1: this many connections (perftest: QPs) at once
}

// refResults holds each round's values, keyed by row and tool.
type refResults struct {
	vals  map[[2]string][]float64
	fails []string
	notes []string
}

func (r *refResults) add(row, tool string, v float64) {
	k := [2]string{row, tool}
	r.vals[k] = append(r.vals[k], v)
}

func (r *refResults) median(row, tool string) (float64, bool) {
	v := slices.Clone(r.vals[[2]string{row, tool}])
	if len(v) == 0 {
		return 0, false
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2], true
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2, true
}

func refRowBW(size int) string  { return "bw " + strconv.Itoa(size) }
func refRowCPU(size int) string { return "cpu " + strconv.Itoa(size) }

// The rows of a figure over many connections at once.
func refRowBWConns(size int) string  { return "bw conns " + strconv.Itoa(size) }
func refRowCPUConns(size int) string { return "cpu conns " + strconv.Itoa(size) }

const (
	refRowP50    = "lat p50"
	refRowMean   = "lat mean"
	refRowLatCPU = "lat cpu"
)

// runRef measures every step of every round and writes the tables.
func runRef(cfg refConfig, w io.Writer) error {
	var halves refServerHalves = &localHalves{}
	if cfg.peer != "" {
		h, err := dialControl(cfg.peer)
		if err != nil {
			return err
		}
		halves = h
	}
	defer halves.close()
	var steps []refStep
	for _, size := range cfg.sizes {
		tools := []string{refWriteBW, refSendBW, refRstream, refRDMA}
		if size > refRingsAbove {
			tools = append(tools, refRings)
		}
		for _, t := range tools {
			steps = append(steps, refStep{tool: t, size: size})
		}
	}
	if cfg.conns > 1 {
		// rstream has one connection; ib_write_bw's -q opens QPs of one
		// process, as rdmagrpc's connections are of one process.
		for _, size := range cfg.sizes {
			for _, t := range []string{refWriteBW, refRDMA} {
				steps = append(steps, refStep{tool: t, size: size, conns: cfg.conns})
			}
		}
	}
	for _, t := range []string{refWriteLat, refSendLat, refRstream, refRDMA} {
		steps = append(steps, refStep{tool: t, size: cfg.latSize, lat: true})
	}
	res := &refResults{vals: map[[2]string][]float64{}}
	start := time.Now()
	port := cfg.basePort
	for round := range cfg.rounds {
		// Each round starts elsewhere in the list: no tool is always
		// first, or always right after another.
		off := round * len(steps) / max(cfg.rounds, 1)
		for i := range steps {
			s := steps[(off+i)%len(steps)]
			port++
			cfg.logf("ref round %d/%d: %s\n", round+1, cfg.rounds, s)
			if err := cfg.step(halves, s, port, res); err != nil {
				msg := fmt.Sprintf("round %d, %s: %v", round+1, s, err)
				cfg.logf("ref: %s\n", msg)
				res.fails = append(res.fails, msg)
			}
		}
	}
	cfg.refMarkdown(w, res, time.Since(start))
	return nil
}

func (s refStep) String() string {
	str := s.tool + " " + kindName(s.lat) + " " + sizeName(s.size)
	if s.conns > 1 {
		str += fmt.Sprintf(", %d connections", s.conns)
	}
	return str
}

func kindName(lat bool) string {
	if lat {
		return "latency"
	}
	return "bandwidth"
}

// commands are the server and client argv of step s on port.
func (cfg *refConfig) commands(s refStep, port int) (srv, cli []string) {
	p := strconv.Itoa(port)
	n := cfg.count(s.size)
	if s.lat {
		n = cfg.latIters
	}
	switch s.tool {
	case refWriteBW, refSendBW, refWriteLat, refSendLat:
		if s.conns > 1 {
			n = cfg.perQP(s)
		}
		srv = []string{s.tool, "-d", cfg.dev, "-x", strconv.Itoa(cfg.gid), "-R", "-F",
			"-s", strconv.Itoa(s.size), "-n", strconv.Itoa(n), "-p", p}
		if s.conns > 1 {
			srv = append(srv, "-q", strconv.Itoa(s.conns))
		}
		return srv, append(slices.Clone(srv), cfg.server)
	case refRstream:
		// Bandwidth: n transfers one way, then n back (rstream counts
		// both); latency: n round trips of one transfer each way.
		shape := []string{"-S", strconv.Itoa(s.size), "-C", strconv.Itoa(n)}
		if s.lat {
			shape = []string{"-S", strconv.Itoa(s.size), "-C", "1", "-I", strconv.Itoa(n)}
		}
		srv = append([]string{refRstream, "-p", p}, shape...)
		return srv, append([]string{refRstream, "-s", cfg.server, "-p", p}, shape...)
	}
	addr := net.JoinHostPort(cfg.server, p)
	common := []string{"-size", strconv.Itoa(s.size), "-count", strconv.Itoa(n)}
	if cfg.provider != "" {
		common = append(common, "-provider", cfg.provider)
	}
	if s.tool == refRings {
		common = append(common, "-rings")
	}
	if s.conns > 1 {
		common = append(common, "-conns", strconv.Itoa(s.conns))
	}
	op := "write"
	if s.lat {
		op = "pingpong"
	}
	srv = append([]string{"rdmabench", "refchild", "-serve", addr}, common...)
	cli = append([]string{"rdmabench", "refchild", "-dial", addr, "-op", op}, common...)
	return srv, cli
}

// step runs one figure: the server half, then the client half (again
// while it fails fast: the server may not listen yet), and records it.
func (cfg *refConfig) step(halves refServerHalves, s refStep, port int, res *refResults) error {
	srvArgv, cliArgv := cfg.commands(s, port)
	if err := halves.start(srvArgv); err != nil {
		return fmt.Errorf("server: %w", err)
	}
	time.Sleep(cfg.startWait)
	var cli refOutcome
	for attempt := 0; ; attempt++ {
		cli = runRefProc(cliArgv, cfg.timeout)
		if cli.Err == "" || attempt >= 20 || cli.Ran > 10*time.Second {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	wait := cfg.timeout
	if cli.Err != "" {
		wait = 5 * time.Second
	}
	srv := halves.wait(wait)
	if cli.Err != "" {
		return fmt.Errorf("client: %s: %s", cli.Err, lastLines(cli.Out, 3))
	}
	if srv.Err != "" {
		// The client has its figure (for rdmagrpc: the server's count of
		// what arrived, checked): the sample stands, the failure is told.
		res.notes = append(res.notes, fmt.Sprintf("%s: the server half failed after the client had its figure: %s: %s",
			s, srv.Err, lastLines(srv.Out, 1)))
	}
	cpu := (cli.CPU + srv.CPU).Seconds()
	n := cfg.count(s.size)
	rowBW, rowCPU := refRowBW(s.size), refRowCPU(s.size)
	if s.conns > 1 {
		rowBW, rowCPU = refRowBWConns(s.size), refRowCPUConns(s.size)
		if s.tool == refWriteBW {
			n = cfg.perQP(s) * s.conns
		}
	}
	switch {
	case s.lat:
		var p50, mean float64 // seconds, half a round trip
		var err error
		switch s.tool {
		case refRstream:
			_, mean, err = parseRstream(cli.Out)
			p50 = -1
		case refRDMA:
			p50, mean, err = parseRefPingPong(cli.Out)
		default:
			p50, mean, err = parsePerftestLat(cli.Out)
		}
		if err != nil {
			return err
		}
		if p50 >= 0 {
			res.add(refRowP50, s.tool, p50)
		}
		res.add(refRowMean, s.tool, mean)
		res.add(refRowLatCPU, s.tool, cpu/float64(cfg.latIters))
	default:
		var bps float64
		moved := float64(s.size) * float64(n)
		switch s.tool {
		case refRstream:
			secs, _, err := parseRstream(cli.Out)
			if err != nil {
				return err
			}
			moved *= 2 // n transfers there, n back
			bps = moved / secs
		case refRDMA, refRings:
			m := refFigures(cli.Out)
			secs, err := refFloat(m, "seconds")
			if err != nil {
				return err
			}
			bps = moved / secs
		default:
			var err error
			if bps, err = parsePerftestBW(cli.Out); err != nil {
				return err
			}
		}
		res.add(rowBW, s.tool, bps)
		res.add(rowCPU, s.tool, cpu/(moved/1e6))
	}
	return nil
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, " / ")
}

// perftest reports MiB/s (2^20 bytes).
const mib = 1 << 20

// resultLine is the first line after the header line that contains all
// of header's words, split into fields.
func resultLine(out string, header ...string) ([]string, error) {
	lines := strings.Split(out, "\n")
	for i, l := range lines {
		ok := true
		for _, h := range header {
			ok = ok && strings.Contains(l, h)
		}
		if !ok {
			continue
		}
		for _, next := range lines[i+1:] {
			if f := strings.Fields(next); len(f) > 0 {
				return f, nil
			}
		}
	}
	return nil, fmt.Errorf("no %q line in the output: %s", strings.Join(header, " "), lastLines(out, 3))
}

// parsePerftestBW is ib_*_bw's average bandwidth, in bytes per second.
func parsePerftestBW(out string) (float64, error) {
	f, err := resultLine(out, "#bytes", "BW average")
	if err != nil {
		return 0, err
	}
	if len(f) < 4 {
		return 0, fmt.Errorf("perftest result %q", f)
	}
	v, err := strconv.ParseFloat(f[3], 64)
	return v * mib, err
}

// parsePerftestLat is ib_*_lat's typical (median) and average latency,
// in seconds: half a round trip, as perftest reports them.
func parsePerftestLat(out string) (p50, mean float64, err error) {
	f, err := resultLine(out, "#bytes", "t_typical", "t_avg")
	if err != nil {
		return 0, 0, err
	}
	if len(f) < 6 {
		return 0, 0, fmt.Errorf("perftest result %q", f)
	}
	if p50, err = strconv.ParseFloat(f[4], 64); err != nil {
		return 0, 0, err
	}
	mean, err = strconv.ParseFloat(f[5], 64)
	return p50 / 1e6, mean / 1e6, err
}

// parseRstream is rstream's elapsed time and its microseconds per
// transfer (in seconds; half a round trip in a latency run).
func parseRstream(out string) (secs, perXfer float64, err error) {
	f, err := resultLine(out, "name", "usec/xfer")
	if err != nil {
		return 0, 0, err
	}
	if len(f) < 8 || !strings.HasSuffix(f[5], "s") {
		return 0, 0, fmt.Errorf("rstream result %q", f)
	}
	if secs, err = strconv.ParseFloat(strings.TrimSuffix(f[5], "s"), 64); err != nil {
		return 0, 0, err
	}
	if secs <= 0 {
		return 0, 0, errors.New("rstream ran for 0.00 s: too few transfers to time")
	}
	perXfer, err = strconv.ParseFloat(f[7], 64)
	return secs, perXfer / 1e6, err
}

// parseRefPingPong is a rdmagrpc ping-pong half's p50 and mean, in
// seconds, half a round trip.
func parseRefPingPong(out string) (p50, mean float64, err error) {
	m := refFigures(out)
	if p50, err = refFloat(m, "p50_us"); err != nil {
		return 0, 0, err
	}
	mean, err = refFloat(m, "mean_us")
	return p50 / 1e6, mean / 1e6, err
}

// refMarkdown writes the tables.
func (cfg *refConfig) refMarkdown(w io.Writer, r *refResults, took time.Duration) {
	where := "server and client processes in one host, the server on " + cfg.server
	if cfg.peer != "" {
		where = "the server processes on " + cfg.server + ", the clients on another host"
	}
	fmt.Fprintf(w, "Reference tools beside rdmagrpc (provider %s) on %s, GID index %d: %s. "+
		"Medians of %d interleaved rounds (run took %v); perftest over rdma_cm (-R), rstream in its default non-blocking mode; "+
		"a bandwidth figure moves %s one way (at most %d messages), a latency figure is %d round trips.\n\n",
		orDefault(cfg.provider), cfg.dev, cfg.gid, where, cfg.rounds, took.Round(time.Second), sizeName(int(cfg.bytes)), cfg.maxMsgs, cfg.latIters)

	bwTools := []string{refWriteBW, refSendBW, refRstream, refRDMA, refRings}
	head := "| size | ib_write_bw | ib_send_bw | rstream | rdmagrpc raw | rdmagrpc raw, rings only | rdmagrpc / ib_write_bw | rdmagrpc / rstream |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
	fmt.Fprintf(w, "One-way throughput (perftest: its average; rstream: n transfers there and n back, over both; rdmagrpc: net.Conn writes of the size to a reader in another process, to its count of what arrived):\n\n")
	io.WriteString(w, head)
	for _, size := range cfg.sizes {
		cells, v := r.cells(refRowBW(size), bwTools, refMBps)
		rd := v[refRDMA]
		fmt.Fprintf(w, "| %s | %s | %s | %s |\n", sizeName(size), strings.Join(cells, " | "),
			refRatio(rd, v[refWriteBW]), refRatio(rd, v[refRstream]))
	}
	fmt.Fprintf(w, "\nCPU per MB moved, client and server processes together (user + system time over each process's whole life, set-up included; rxe's work runs in the kernel, partly in these processes' system calls; perftest and rstream poll their completions without sleeping):\n\n")
	io.WriteString(w, head)
	for _, size := range cfg.sizes {
		cells, v := r.cells(refRowCPU(size), bwTools, func(x float64) string { return fmt.Sprintf("%.2f ms", x*1e3) })
		rd := v[refRDMA]
		fmt.Fprintf(w, "| %s | %s | %s | %s |\n", sizeName(size), strings.Join(cells, " | "),
			refRatio(rd, v[refWriteBW]), refRatio(rd, v[refRstream]))
	}
	if cfg.conns > 1 {
		fmt.Fprintf(w, "\nThe same bytes over %d connections at once (ib_write_bw: -q %d, its QPs in one process pair; rdmagrpc: %d connections of one process pair, the writes shared among them, on the device's shared CQs and receive pool; CPU per MB as above):\n\n", cfg.conns, cfg.conns, cfg.conns)
		fmt.Fprintf(w, "| size | ib_write_bw | rdmagrpc raw | rdmagrpc / ib_write_bw | CPU/MB ib_write_bw | CPU/MB rdmagrpc | CPU rdmagrpc / ib_write_bw |\n|---|---:|---:|---:|---:|---:|---:|\n")
		tools := []string{refWriteBW, refRDMA}
		for _, size := range cfg.sizes {
			bw, v := r.cells(refRowBWConns(size), tools, refMBps)
			cpu, c := r.cells(refRowCPUConns(size), tools, func(x float64) string { return fmt.Sprintf("%.2f ms", x*1e3) })
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s |\n", sizeName(size), bw[0], bw[1], refRatio(v[refRDMA], v[refWriteBW]),
				cpu[0], cpu[1], refRatio(c[refRDMA], c[refWriteBW]))
		}
	}
	latTools := []string{refWriteLat, refSendLat, refRstream, refRDMA}
	fmt.Fprintf(w, "\n%s request and response, one at a time; half the round trip, as perftest and rstream report it (rstream gives its mean only):\n\n", sizeName(cfg.latSize))
	fmt.Fprintf(w, "| figure | ib_write_lat | ib_send_lat | rstream | rdmagrpc ping-pong | rdmagrpc / ib_send_lat | rdmagrpc / rstream |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for _, row := range []struct{ row, label string }{
		{refRowP50, "p50 (perftest: t_typical)"},
		{refRowMean, "mean"},
		{refRowLatCPU, "CPU per round trip, client + server"},
	} {
		cells, v := r.cells(row.row, latTools, func(x float64) string { return fmt.Sprintf("%.1f µs", x*1e6) })
		fmt.Fprintf(w, "| %s | %s | %s | %s |\n", row.label, strings.Join(cells, " | "), refRatio(v[refRDMA], v[refSendLat]), refRatio(v[refRDMA], v[refRstream]))
	}
	if len(r.notes) > 0 {
		fmt.Fprintf(w, "\nSamples kept, with a server half that failed after its client had the figure:\n\n")
		for _, n := range r.notes {
			fmt.Fprintf(w, "- %s\n", n)
		}
	}
	if len(r.fails) > 0 {
		fmt.Fprintf(w, "\nFailed samples (left out of the medians):\n\n")
		for _, f := range r.fails {
			fmt.Fprintf(w, "- %s\n", f)
		}
	}
	fmt.Fprintln(w)
}

// cells formats row's medians for tools ("—" where none), and returns
// them by tool.
func (r *refResults) cells(row string, tools []string, f func(float64) string) ([]string, map[string]float64) {
	var cells []string
	v := map[string]float64{}
	for _, t := range tools {
		m, ok := r.median(row, t)
		if !ok {
			cells = append(cells, "—")
			continue
		}
		v[t] = m
		cells = append(cells, f(m))
	}
	return cells, v
}

// refMBps keeps three digits where one decimal would round to zero.
func refMBps(x float64) string {
	if x < 1e6 {
		return fmt.Sprintf("%.3f MB/s", x/1e6)
	}
	return fmt.Sprintf("%.1f MB/s", x/1e6)
}

func refRatio(v, ref float64) string {
	if v == 0 || ref == 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f×", v/ref)
}

func orDefault(p string) string {
	if p == "" {
		return "conn's choice"
	}
	return p
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// refMain is `rdmabench -ref`, or the server halves' end of one
// (-refcontrol).
func refMain(cfg refConfig, control string, w io.Writer) {
	if control != "" {
		if err := refControl(control); err != nil {
			fatal(err)
		}
		return
	}
	if cfg.server == "" {
		fatal(errors.New("-ref needs -host: the address the server halves listen on"))
	}
	if err := runRef(cfg, w); err != nil {
		fatal(err)
	}
	_ = os.Stdout.Sync()
}
