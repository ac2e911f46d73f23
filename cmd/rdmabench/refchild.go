package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// The halves of a -ref figure are processes: the reference tools' server
// and client, and for rdmagrpc this binary again, `rdmabench refchild
// -serve ADDR` and `rdmabench refchild -dial ADDR`. Each serves or makes
// one connection and exits, as perftest and rstream do, so that the CPU
// time of a half is its process's whole life.

// Operations of a rdmagrpc client half (its first byte on the connection).
const (
	refOpWrite    = 'w' // one-way writes; the server reads to EOF, answers the count
	refOpPingPong = 'p' // size-byte request, size-byte response, one at a time
)

// refChild runs a rdmagrpc half; it returns the exit status.
func refChild(args []string) int {
	fs := flag.NewFlagSet("refchild", flag.ContinueOnError)
	serve := fs.String("serve", "", "listen on this address, serve one connection, exit")
	dial := fs.String("dial", "", "dial this address, measure, print the figures, exit")
	op := fs.String("op", "write", "write (one-way writes) or pingpong")
	size := fs.Int("size", 32<<10, "write size, or request and response size")
	count := fs.Int("count", 1000, "writes, or round trips")
	provider := fs.String("provider", "", "rdmagrpc provider")
	rings := fs.Bool("rings", false, "rendezvous off: every write through the rings")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of this half to this file")
	stats := fs.Bool("stats", false, "print the connection's message counts on stderr at the end")
	spin := fs.Duration("spin", -1, "conn.WithPollSpin for this half (negative: conn's default)")
	large := fs.String("large", "", "conn.WithLargeBuffers for this half, as SIZExCOUNT (empty: conn's default)")
	spinBusy := fs.Bool("spinbusy", false, "conn.WithSpinOnBusyHost for this half: spin whatever the host's load")
	conns := fs.Int("conns", 1, "write: this many connections at once, the writes shared among them")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *conns < 1 || (*conns > 1 && *op != "write") {
		fmt.Fprintln(os.Stderr, "rdmabench refchild: -conns must be 1, or more with -op write")
		return 2
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "rdmabench refchild:", err)
			return 1
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "rdmabench refchild:", err)
			return 1
		}
		defer pprof.StopCPUProfile()
	}
	var opts []conn.Option
	if *provider != "" {
		opts = append(opts, conn.WithProvider(*provider))
	}
	if *rings {
		opts = append(opts, conn.WithRendezvousThreshold(-1))
	}
	if *spin >= 0 {
		opts = append(opts, conn.WithPollSpin(*spin))
	}
	if *spinBusy {
		opts = append(opts, conn.WithSpinOnBusyHost())
	}
	if *large != "" {
		var size, count int
		if _, err := fmt.Sscanf(*large, "%dx%d", &size, &count); err != nil {
			fmt.Fprintf(os.Stderr, "rdmabench refchild: -large %q: want SIZExCOUNT\n", *large)
			return 2
		}
		opts = append(opts, conn.WithLargeBuffers(size, count))
	}
	ctx := context.Background()
	var err error
	switch {
	case *serve != "":
		err = refServe(ctx, *serve, *conns, opts, *stats)
	case *dial != "":
		err = refDial(ctx, *dial, *op, *size, *count, *conns, *provider, opts, *stats)
	default:
		err = errors.New("refchild: -serve or -dial")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "rdmabench refchild:", err)
		return 1
	}
	return 0
}

// refServe accepts n connections and serves what each one's first byte
// asks, all at once.
func refServe(ctx context.Context, addr string, n int, opts []conn.Option, stats bool) error {
	l, err := conn.Listen(ctx, addr, opts...)
	if err != nil {
		return err
	}
	defer l.Close()
	errs := make(chan error, n)
	for i := range n {
		c, err := l.Accept()
		if err != nil {
			return fmt.Errorf("connection %d of %d: %w", i+1, n, err)
		}
		go func() {
			defer c.Close()
			if stats && i == 0 {
				defer printStats("server", c)
			}
			errs <- refServeConn(c)
		}()
	}
	var all []error
	for range n {
		all = append(all, <-errs)
	}
	return errors.Join(all...)
}

// refServeConn serves one connection.
func refServeConn(c net.Conn) error {
	var op [1]byte
	if _, err := io.ReadFull(c, op[:]); err != nil {
		return err
	}
	switch op[0] {
	case refOpWrite:
		buf := make([]byte, 1<<20)
		var n uint64
		for {
			k, err := c.Read(buf)
			n += uint64(k)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return err
			}
		}
		if _, err := c.Write(binary.BigEndian.AppendUint64(nil, n)); err != nil {
			return err
		}
	case refOpPingPong:
		var hdr [4]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return err
		}
		buf := make([]byte, binary.BigEndian.Uint32(hdr[:]))
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
			if _, err := c.Write(buf); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("unknown operation %q", op[0])
	}
	// The client closes once it has the count: wait for that, so that
	// the answer is not torn down with this process.
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	io.Copy(io.Discard, c)
	return nil
}

// refDialOne connects (retrying while the server half starts).
func refDialOne(ctx context.Context, addr string, opts []conn.Option) (net.Conn, error) {
	deadline := time.Now().Add(60 * time.Second)
	for {
		c, err := conn.Dial(ctx, addr, opts...)
		if err == nil {
			if err = c.(*conn.Conn).Handshake(ctx); err == nil {
				return c, nil
			}
			c.Close()
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// refWrites writes count messages on c, half-closes it and checks the
// server's count of what arrived.
func refWrites(c net.Conn, msg []byte, count int) (uint64, error) {
	var sent uint64
	for range count {
		k, err := c.Write(msg)
		sent += uint64(k)
		if err != nil {
			return sent, err
		}
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		return sent, err
	}
	var ack [8]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		return sent, fmt.Errorf("the server's count: %w", err)
	}
	if got := binary.BigEndian.Uint64(ack[:]); got != sent {
		return sent, fmt.Errorf("the server read %d bytes of %d", got, sent)
	}
	return sent, nil
}

// refDial connects n times, measures and prints key=value figures on one
// line. With n connections the count of writes is shared among them,
// and the figure runs from the first write to the last count's arrival.
func refDial(ctx context.Context, addr, op string, size, count, n int, provider string, opts []conn.Option, stats bool) error {
	cs := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	for i := range n {
		c, err := refDialOne(ctx, addr, opts)
		if err != nil {
			return fmt.Errorf("connection %d of %d: %w", i+1, n, err)
		}
		cs = append(cs, c)
		if st := c.(*conn.Conn).Stats(); provider != "" && st.Provider != provider {
			return fmt.Errorf("connection runs on %s, not %s (%s)", st.Provider, provider, st.ProviderReason)
		}
	}
	c := cs[0]
	if stats {
		defer printStats("client", c)
	}
	st := c.(*conn.Conn).Stats()
	msg := make([]byte, size)
	for i := range msg {
		msg[i] = byte(i)
	}
	switch op {
	case "write":
		for _, c := range cs {
			if _, err := c.Write([]byte{refOpWrite}); err != nil {
				return err
			}
		}
		type result struct {
			sent uint64
			err  error
		}
		results := make(chan result, n)
		start := time.Now()
		for i, c := range cs {
			k := count / n
			if i < count%n {
				k++
			}
			go func() {
				sent, err := refWrites(c, msg, k)
				results <- result{sent, err}
			}()
		}
		var sent uint64
		var errs []error
		for range n {
			r := <-results
			sent += r.sent
			errs = append(errs, r.err)
		}
		el := time.Since(start)
		if err := errors.Join(errs...); err != nil {
			return err
		}
		fmt.Printf("provider=%s bytes=%d seconds=%.6f conns=%d\n", st.Provider, sent, el.Seconds(), n)
	case "pingpong":
		hdr := append([]byte{refOpPingPong}, binary.BigEndian.AppendUint32(nil, uint32(size))...)
		if _, err := c.Write(hdr); err != nil {
			return err
		}
		buf := make([]byte, size)
		rtt := make([]time.Duration, 0, count)
		for i := range count + count/10 { // the first tenth warms up
			t0 := time.Now()
			if _, err := c.Write(msg); err != nil {
				return err
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				return err
			}
			if i >= count/10 {
				rtt = append(rtt, time.Since(t0))
			}
		}
		slices.Sort(rtt)
		var sum time.Duration
		for _, d := range rtt {
			sum += d
		}
		// Half a round trip, as perftest's latency tests and rstream
		// report theirs.
		half := func(d time.Duration) float64 { return d.Seconds() / 2 * 1e6 }
		fmt.Printf("provider=%s p50_us=%.3f mean_us=%.3f\n", st.Provider, half(rtt[len(rtt)/2]), half(sum/time.Duration(len(rtt))))
	default:
		return fmt.Errorf("unknown -op %q", op)
	}
	return nil
}

// refTools are the programs a half may be: the reference tools, and
// this binary (named rdmabench whatever its path).
var refTools = []string{"ib_write_bw", "ib_send_bw", "ib_write_lat", "ib_send_lat", "rstream", "rdmabench"}

// refProc is a running half.
type refProc struct {
	cmd  *exec.Cmd
	out  syncBuffer
	done chan error
}

// refOutcome is what a half did: its CPU time (user + system, its whole
// life), its output, and why it failed, if it did.
type refOutcome struct {
	CPU time.Duration
	Out string
	Err string
	Ran time.Duration
}

func startRefProc(argv []string) (*refProc, error) {
	if len(argv) == 0 || !slices.Contains(refTools, argv[0]) {
		return nil, fmt.Errorf("not a reference tool: %q", argv)
	}
	path := argv[0]
	if path == "rdmabench" {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		path = self
	}
	p := &refProc{cmd: exec.Command(path, argv[1:]...), done: make(chan error, 1)}
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	if err := p.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { p.done <- p.cmd.Wait() }()
	return p, nil
}

// wait waits at most d for the half to exit, then kills it.
func (p *refProc) wait(d time.Duration, started time.Time) refOutcome {
	var err error
	select {
	case err = <-p.done:
	case <-time.After(d):
		p.cmd.Process.Kill()
		<-p.done
		err = fmt.Errorf("killed after %v", d)
	}
	o := refOutcome{Out: p.out.String(), Ran: time.Since(started)}
	if ps := p.cmd.ProcessState; ps != nil {
		o.CPU = ps.UserTime() + ps.SystemTime()
	}
	if err != nil {
		o.Err = err.Error()
	}
	return o
}

// runRefProc runs a half to its end (at most d).
func runRefProc(argv []string, d time.Duration) refOutcome {
	t0 := time.Now()
	p, err := startRefProc(argv)
	if err != nil {
		return refOutcome{Err: err.Error()}
	}
	return p.wait(d, t0)
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Server halves on another host: `rdmabench -refcontrol :7480` there
// starts and waits for them at the request of the -ref run here, one
// JSON request a line on one TCP connection: {"Start": argv}, answered
// {"Err": ...}; {"Wait": nanoseconds}, answered with the refOutcome;
// {"Bye": true} ends it.
type refRequest struct {
	Start []string      `json:",omitempty"`
	Wait  time.Duration `json:",omitempty"`
	Bye   bool          `json:",omitempty"`
}

// refControl serves one -ref run's server halves, then returns.
func refControl(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	defer l.Close()
	fmt.Fprintf(os.Stderr, "rdmabench: serving the reference figures' server halves on %s\n", l.Addr())
	// The other host boots beside this one; one that never comes does
	// not hold this one up for good.
	l.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Minute))
	c, err := l.Accept()
	if err != nil {
		return err
	}
	defer c.Close()
	dec, enc := json.NewDecoder(bufio.NewReader(c)), json.NewEncoder(c)
	var p *refProc
	var started time.Time
	for {
		var req refRequest
		if err := dec.Decode(&req); err != nil {
			return fmt.Errorf("control: %w", err)
		}
		switch {
		case req.Bye:
			return nil
		case req.Start != nil:
			var o refOutcome
			started = time.Now()
			if p, err = startRefProc(req.Start); err != nil {
				o.Err = err.Error()
			}
			if err := enc.Encode(o); err != nil {
				return err
			}
		case req.Wait > 0:
			o := refOutcome{Err: "nothing started"}
			if p != nil {
				o = p.wait(req.Wait, started)
				p = nil
			}
			if err := enc.Encode(o); err != nil {
				return err
			}
		}
	}
}

// refServerHalves starts server halves here or, through a -refcontrol,
// on another host.
type refServerHalves interface {
	start(argv []string) error
	wait(d time.Duration) refOutcome
	close()
}

type localHalves struct {
	p       *refProc
	started time.Time
}

func (h *localHalves) start(argv []string) (err error) {
	h.started = time.Now()
	h.p, err = startRefProc(argv)
	return err
}

func (h *localHalves) wait(d time.Duration) refOutcome {
	if h.p == nil {
		return refOutcome{Err: "nothing started"}
	}
	o := h.p.wait(d, h.started)
	h.p = nil
	return o
}

func (h *localHalves) close() {}

type remoteHalves struct {
	c   net.Conn
	dec *json.Decoder
	enc *json.Encoder
}

// dialControl reaches the other host's -refcontrol, waiting while that
// host boots.
func dialControl(addr string) (*remoteHalves, error) {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err == nil {
			return &remoteHalves{c: c, dec: json.NewDecoder(bufio.NewReader(c)), enc: json.NewEncoder(c)}, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("-refpeer %s: %w", addr, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func (h *remoteHalves) call(req refRequest) refOutcome {
	var o refOutcome
	if err := h.enc.Encode(req); err != nil {
		return refOutcome{Err: "control: " + err.Error()}
	}
	if err := h.dec.Decode(&o); err != nil {
		return refOutcome{Err: "control: " + err.Error()}
	}
	return o
}

func (h *remoteHalves) start(argv []string) error {
	if o := h.call(refRequest{Start: argv}); o.Err != "" {
		return errors.New(o.Err)
	}
	return nil
}

func (h *remoteHalves) wait(d time.Duration) refOutcome { return h.call(refRequest{Wait: d}) }

func (h *remoteHalves) close() {
	h.enc.Encode(refRequest{Bye: true})
	h.c.Close()
}

// refFigures parses a rdmagrpc client half's key=value line.
func refFigures(out string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if !strings.HasPrefix(line, "provider=") {
			continue
		}
		for _, f := range strings.Fields(line) {
			if k, v, ok := strings.Cut(f, "="); ok {
				m[k] = v
			}
		}
	}
	return m
}

func refFloat(m map[string]string, k string) (float64, error) {
	v, ok := m[k]
	if !ok {
		return 0, fmt.Errorf("no %s in the output", k)
	}
	return strconv.ParseFloat(v, 64)
}

// printStats writes a connection's message counts: what a write cost in
// messages, credit stalls and ring phases.
func printStats(side string, c net.Conn) {
	st := c.(*conn.Conn).Stats()
	fmt.Fprintf(os.Stderr, "%s stats: messages out %d, in %d (large-ring data in %d, small %d); credit stalls %d; rendezvous out %d, in %d; bytes out %d, in %d; enlargements %d; send phase %s, receive phase %s; path MTU %d; rendezvous prefetches %d\n",
		side, st.MessagesOut, st.MessagesIn, st.LargeDataIn, st.SmallDataIn, st.CreditStalls, st.Rendezvous, st.RendezvousIn,
		st.BytesOut, st.BytesIn, st.Enlargements, st.SendPhase, st.RecvPhase, st.Path.MTU, st.RendezvousPrefetches)
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) == nil {
		fmt.Fprintf(os.Stderr, "%s rusage: user %v, system %v, voluntary context switches %d, involuntary %d\n",
			side, time.Duration(ru.Utime.Nano()), time.Duration(ru.Stime.Nano()), ru.Nvcsw, ru.Nivcsw)
	}
}
