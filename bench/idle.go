package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// IdleResult is what n idle connections of one transport cost. The
// server ends live in a child process, as they would in a service, so
// each process holds one end of every connection (and has its own open
// files limit).
type IdleResult struct {
	Transport string
	// GRPC: each connection is a grpc.ClientConn that made one 64 B RPC
	// to a grpc-go server in the child; else a raw net.Conn.
	GRPC  bool
	Want  int
	Held  int           // connections established, both ends
	Err   error         // why fewer than Want were held
	Setup time.Duration // to establish Held connections
	// SetupMore are the set-up times of the further loops of raw
	// connections the bench ran, interleaved with the other transport's
	// (Run): with Setup, the median is what is judged.
	SetupMore []time.Duration
	// RSS growth per connection of the client and of the server process
	// (after a GC that returns freed memory).
	RSSClient, RSSServer float64
	// Goroutine growth per connection of each process: what an idle
	// connection keeps running (0 for TCP: the netpoller serves it).
	GoroutinesClient, GoroutinesServer float64
	// Registered memory per end (rdmagrpc only): the mean of
	// Stats().RegisteredBytes over both ends of every connection.
	RegPerSide float64
	// After: how long the connections then sat idle before RSSClientIdle
	// and RSSServerIdle were measured (0: not measured), with rdmagrpc's
	// WithIdleShrink set to it in both processes; Parked: the share of
	// rdmagrpc's directions that had parked by then (conn's Stats.Parks).
	After                        time.Duration
	RSSClientIdle, RSSServerIdle float64
	Parked                       float64
	// DialP50 is the median of the dials (raw: the transport's dial;
	// gRPC: the dials grpc-go made through it), and Steps the median of
	// each step the provider timed in them (conn's SetupSteps: verbs
	// times rdma_cm's), nil where it times none.
	DialP50 time.Duration
	Steps   []transport.SetupStep
}

// The child process: ServeIdleIfChild, called first thing in main (and
// TestMain), turns a process started by idle into the server.
const (
	idleEnv  = "RDMABENCH_IDLE_SERVER" // the transport to listen on
	grpcEnv  = "RDMABENCH_IDLE_GRPC"   // set: serve gRPC on it
	afterEnv = "RDMABENCH_IDLE_AFTER"  // rdmagrpc's WithIdleShrink there
	provEnv  = "RDMAGRPC_PROVIDER"     // conn's own variable
	reportOp = "report"
	heldOp   = "held" // how many are held, at once: no GC first, as report does
)

// ServeIdleIfChild serves, and exits, when the process was started as one
// of the bench's children (the idle server, or the two-process server of
// twoproc.go); otherwise it returns at once.
func ServeIdleIfChild() {
	for _, ch := range []struct {
		env, what string
		serve     func(string, io.Reader, io.Writer) error
	}{
		{serveEnv, "rdmabench server", serveTwoProc},
		{idleEnv, "rdmabench idle server", serveIdle},
		{fleetEnv, "rdmabench fleet server", serveFleet},
	} {
		v := os.Getenv(ch.env)
		if v == "" {
			continue
		}
		if err := ch.serve(v, os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, ch.what+":", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
}

// serveIdle listens, prints its address, accepts connections and holds
// them, answers each "report" line on in with "held rss registered
// goroutines parks lasterror" and each "held" line with the count alone,
// and returns when in is closed.
func serveIdle(name string, in io.Reader, out io.Writer) error {
	var t network
	var opts []conn.Option
	if v := os.Getenv(afterEnv); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return fmt.Errorf("%s: %w", afterEnv, err)
		}
		opts = append(opts, conn.WithIdleShrink(d))
	}
	for _, c := range transports(os.TempDir(), opts...) {
		if c.name == name {
			t = c
		}
	}
	if t.listen == nil {
		return fmt.Errorf("unknown transport %q", name)
	}
	kind := "idle."
	if os.Getenv(grpcEnv) != "" {
		kind = "idle-grpc."
	}
	stop, err := profileChild(kind + name)
	if err != nil {
		return err
	}
	defer stop()
	l, err := t.listen(context.Background())
	if err != nil {
		return err
	}
	defer l.Close()
	var (
		mu      sync.Mutex
		held    []net.Conn
		lastErr error
	)
	rec := &recorder{Listener: l, onAccept: func(c net.Conn, err error) {
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			lastErr = err
			return
		}
		held = append(held, c)
	}}
	if os.Getenv(grpcEnv) != "" {
		srv := grpc.NewServer()
		testgrpc.RegisterBenchmarkServiceServer(srv, service{})
		go srv.Serve(rec)
		defer srv.Stop()
	} else {
		go func() {
			for {
				if _, err := rec.Accept(); err != nil {
					if errors.Is(err, net.ErrClosed) {
						return
					}
					time.Sleep(time.Millisecond) // EMFILE and the like: keep serving
				}
			}
		}()
	}
	fmt.Fprintln(out, l.Addr().String())
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		if sc.Text() == heldOp {
			mu.Lock()
			n := len(held)
			mu.Unlock()
			fmt.Fprintln(out, n)
			continue
		}
		if sc.Text() != reportOp {
			continue
		}
		r := settledRSS()
		mu.Lock()
		conns := held
		e := "-"
		if lastErr != nil {
			e = strings.ReplaceAll(lastErr.Error(), "\n", " ")
		}
		mu.Unlock()
		fmt.Fprintf(out, "%d %d %d %d %d %s\n", len(conns), r, registered(conns), settledGoroutines(), parks(conns), e)
	}
	return nil
}

// recorder tells onAccept of every accepted connection or error.
type recorder struct {
	net.Listener
	onAccept func(net.Conn, error)
}

func (r *recorder) Accept() (net.Conn, error) {
	c, err := r.Listener.Accept()
	if err == nil || !errors.Is(err, net.ErrClosed) {
		r.onAccept(c, err)
	}
	return c, err
}

// parks counts the parks of the connections' sending directions.
func parks(conns []net.Conn) int64 {
	var n int64
	for _, c := range conns {
		if rc, ok := c.(*conn.Conn); ok {
			n += int64(rc.Stats().Parks)
		}
	}
	return n
}

func registered(conns []net.Conn) int64 {
	var n int64
	for _, c := range conns {
		if rc, ok := c.(*conn.Conn); ok {
			n += rc.Stats().RegisteredBytes
		}
	}
	return n
}

// child is a running idle server.
type child struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
	addr string
}

type childReport struct {
	held       int
	rss, reg   int64
	goroutines int
	parks      int64
	err        string
}

func startChild(name, provider string, gRPC bool, after time.Duration) (*child, error) {
	more := []string{afterEnv + "=" + after.String()}
	if gRPC {
		more = append(more, grpcEnv+"=1")
	}
	return spawn(idleEnv+"="+name, provider, more...)
}

// spawn starts this executable as one of the bench's children, env
// saying which, with the rdmagrpc provider of the run, and reads the
// address line it prints once it listens.
func spawn(env, provider string, more ...string) (*child, error) {
	vars := append([]string{env}, more...)
	if provider != "" {
		vars = append(vars, provEnv+"="+provider)
	}
	if remote := os.Getenv(RemoteEnv); remote != "" {
		rc, err := dialSpawner(remote, vars)
		if err != nil {
			return nil, err
		}
		return started(&child{in: remoteChild{rc}, out: bufio.NewReader(rc)}, env)
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), vars...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return started(&child{cmd: cmd, in: in, out: bufio.NewReader(out)}, env)
}

// started reads the address line c prints once it listens.
func started(c *child, env string) (*child, error) {
	line, err := c.out.ReadString('\n')
	if err != nil {
		c.stop()
		return nil, fmt.Errorf("bench child (%s) did not start: %w", env, err)
	}
	c.addr = strings.TrimSpace(line)
	return c, nil
}

// ask sends op to the child and returns its answer line.
func (c *child) ask(op string) (string, error) {
	if _, err := fmt.Fprintln(c.in, op); err != nil {
		return "", err
	}
	line, err := c.out.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("idle server: %w", err)
	}
	return line, nil
}

func (c *child) report() (childReport, error) {
	var r childReport
	line, err := c.ask(reportOp)
	if err != nil {
		return r, err
	}
	f := strings.SplitN(strings.TrimSpace(line), " ", 6)
	if len(f) != 6 {
		return r, fmt.Errorf("idle server said %q", line)
	}
	r.held, _ = strconv.Atoi(f[0])
	r.rss, _ = strconv.ParseInt(f[1], 10, 64)
	r.reg, _ = strconv.ParseInt(f[2], 10, 64)
	r.goroutines, _ = strconv.Atoi(f[3])
	r.parks, _ = strconv.ParseInt(f[4], 10, 64)
	if f[5] != "-" {
		r.err = f[5]
	}
	return r, nil
}

// held asks how many connections the child holds, without the GC that a
// report runs first: the set-up's wait for the child's accepts polls it.
func (c *child) held() (int, error) {
	line, err := c.ask(heldOp)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		return 0, fmt.Errorf("idle server said %q", line)
	}
	return n, nil
}

func (c *child) stop() {
	c.in.Close()
	if c.cmd != nil { // a remote one has exited once Close returns
		c.cmd.Wait()
	}
}

// idle opens n connections of t to a child process, one at a time (raw
// net.Conns, or gRPC client connections that made one RPC each), and
// measures them idle in both processes: once all are set up, and again
// once they sat idle for after (rdmagrpc's WithIdleShrink in both
// processes, which t's dial must have too).
func idle(ctx context.Context, t network, provider string, n int, gRPC bool, after time.Duration, heapProfile string) IdleResult {
	res := IdleResult{Transport: t.name, GRPC: gRPC, Want: n}
	ch, err := startChild(t.name, provider, gRPC, after)
	if err != nil {
		res.Err = err
		return res
	}
	defer ch.stop()
	before, err := ch.report()
	if err != nil {
		res.Err = err
		return res
	}
	rss0, g0 := settledRSS(), settledGoroutines()
	var dialed []net.Conn
	var ccs []*grpc.ClientConn
	defer func() {
		for _, cc := range ccs {
			cc.Close()
		}
		closeAll(dialed)
	}()
	var took []time.Duration
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		start := time.Now()
		c, err := t.dial(ctx, addr)
		if err == nil {
			took = append(took, time.Since(start))
			dialed = append(dialed, c)
		}
		return c, err
	}
	start := time.Now()
	for i := range n {
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if gRPC {
			var cc *grpc.ClientConn
			if cc, err = firstRPC(dctx, ch.addr, dial); cc != nil {
				ccs = append(ccs, cc)
			}
		} else {
			_, err = dial(dctx, ch.addr)
		}
		cancel()
		if err != nil {
			res.Err = fmt.Errorf("connection %d: %w", i+1, err)
			break
		}
	}
	// Every dialed connection's other end must be accepted.
	for wait := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		n, err := ch.held()
		if err != nil {
			res.Err = err
			return res
		}
		if n >= len(dialed) || time.Now().After(wait) {
			break
		}
	}
	res.Setup = time.Since(start)
	set, err := ch.report()
	if err != nil {
		res.Err = err
		return res
	}
	res.DialP50, res.Steps = dialSteps(took, dialed)
	rss1, g1 := settledRSS(), settledGoroutines()
	if heapProfile != "" {
		kind := "raw"
		if gRPC {
			kind = "gRPC"
		}
		if err := writeHeapProfile(fmt.Sprintf("%s.%s.%d.%s", heapProfile, kind, n, t.name)); err != nil {
			res.Err = err
			return res
		}
	}
	res.Held = min(len(dialed), set.held)
	if gRPC {
		res.Held = min(res.Held, len(ccs))
	}
	if res.Err == nil && res.Held < n {
		res.Err = fmt.Errorf("%d dialed, %d accepted", len(dialed), set.held)
	}
	if res.Err != nil && set.err != "" {
		res.Err = fmt.Errorf("%w; server: %s", res.Err, set.err)
	}
	if res.Held > 0 {
		h := float64(res.Held)
		res.RSSClient = float64(rss1-rss0) / h
		res.RSSServer = float64(set.rss-before.rss) / h
		res.GoroutinesClient = float64(g1-g0) / h
		res.GoroutinesServer = float64(set.goroutines-before.goroutines) / h
		res.RegPerSide = float64(registered(dialed)+set.reg) / (2 * h)
	}
	if after > 0 && res.Held > 0 {
		// The last connection's last write was just before: every
		// direction is idle for after a moment after it.
		time.Sleep(after + time.Second)
		rss2 := settledRSS()
		later, err := ch.report()
		if err != nil {
			res.Err = err
			return res
		}
		h := float64(res.Held)
		res.After = after
		res.RSSClientIdle = float64(rss2-rss0) / h
		res.RSSServerIdle = float64(later.rss-before.rss) / h
		res.Parked = float64(parks(dialed)+later.parks-before.parks) / (2 * h)
	}
	return res
}

// SetupMedian is the median of Setup and SetupMore.
func (r *IdleResult) SetupMedian() time.Duration {
	all := append([]time.Duration{r.Setup}, r.SetupMore...)
	slices.Sort(all)
	return all[len(all)/2]
}

// dialSteps is the median of took, and of each set-up step the
// provider timed in the dials of conns.
func dialSteps(took []time.Duration, conns []net.Conn) (time.Duration, []transport.SetupStep) {
	if len(took) == 0 {
		return 0, nil
	}
	slices.Sort(took)
	p50 := percentile(took, 50)
	var names []string
	per := map[string][]time.Duration{}
	for _, c := range conns {
		rc, ok := c.(*conn.Conn)
		if !ok {
			continue
		}
		for _, st := range rc.SetupSteps() {
			if _, seen := per[st.Name]; !seen {
				names = append(names, st.Name)
			}
			per[st.Name] = append(per[st.Name], st.Took)
		}
	}
	var steps []transport.SetupStep
	for _, n := range names {
		d := per[n]
		slices.Sort(d)
		steps = append(steps, transport.SetupStep{Name: n, Took: percentile(d, 50)})
	}
	return p50, steps
}

// closeAll closes conns, a few at a time.
func closeAll(conns []net.Conn) {
	var wg sync.WaitGroup
	ch := make(chan net.Conn)
	for range 8 {
		wg.Go(func() {
			for c := range ch {
				c.Close()
			}
		})
	}
	for _, c := range conns {
		ch <- c
	}
	close(ch)
	wg.Wait()
}

// settledGoroutines counts this process's goroutines once the ones that
// were ending have ended (a dial's helpers, a completion loop going idle).
func settledGoroutines() int {
	time.Sleep(50 * time.Millisecond)
	return runtime.NumGoroutine()
}

// writeHeapProfile writes the live heap (the last GC's) to path.
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("heap profile: %w", err)
	}
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		f.Close()
		return fmt.Errorf("heap profile %s: %w", path, err)
	}
	return f.Close()
}

// settledRSS is the resident set after a GC that returns freed memory.
func settledRSS() int64 {
	runtime.GC()
	debug.FreeOSMemory()
	return rss()
}

// rss is VmRSS of this process in bytes (anonymous, file and shared
// memory: the shm provider's registered memory is memfd-backed and is
// counted once touched).
func rss() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}
