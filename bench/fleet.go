package bench

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// The fleet figure (issue "Buffers follow traffic"): n rdmagrpc
// connections across two processes, each receiving one 256 KiB message
// at a random time of the traffic period and idling otherwise, with idle
// shrink on (time compressed: a short WithIdleShrink) and off. Registered
// memory per connection, each side, is sampled over time.
const (
	fleetEnv     = "RDMABENCH_FLEET_SERVER" // the child's WithIdleShrink
	fleetMsg     = 256 << 10
	fleetTraffic = 1500 * time.Millisecond
	fleetSample  = 100 * time.Millisecond
)

// FleetResult is one fleet run.
type FleetResult struct {
	Conns  int
	Shrink time.Duration // WithIdleShrink; negative: off
	Err    error
	// Samples of registered bytes per connection, client and server
	// side, from the start of the traffic.
	Samples []FleetSample
	// Peak and the last sample, per connection and side.
	PeakClient, PeakServer float64
	EndClient, EndServer   float64
	// BackToSmall: from the end of the traffic to the first sample with
	// both sides at the small phase's 8 KiB (0: not reached).
	BackToSmall time.Duration
}

// FleetSample is registered memory per connection at At.
type FleetSample struct {
	At             time.Duration
	Client, Server float64
}

// serveFleet is the child: it listens with WithIdleShrink from its
// environment, reads and drops what every connection sends, and answers
// "report" with "held registered".
func serveFleet(shrink string, in io.Reader, out io.Writer) error {
	d, err := time.ParseDuration(shrink)
	if err != nil {
		return err
	}
	l, err := rdma(conn.WithIdleShrink(d)).listen(context.Background())
	if err != nil {
		return err
	}
	defer l.Close()
	var (
		mu   sync.Mutex
		held []net.Conn
		wg   sync.WaitGroup
	)
	defer func() {
		mu.Lock()
		closeAll(held)
		mu.Unlock()
		wg.Wait()
	}()
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				time.Sleep(time.Millisecond)
				continue
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
			wg.Go(func() { io.Copy(io.Discard, c) })
		}
	})
	fmt.Fprintln(out, l.Addr().String())
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		if sc.Text() != reportOp {
			continue
		}
		mu.Lock()
		conns := held
		mu.Unlock()
		fmt.Fprintf(out, "%d %d\n", len(conns), registered(conns))
	}
	l.Close()
	return nil
}

func (c *child) fleetReport() (held int, reg int64, err error) {
	if _, err := fmt.Fprintln(c.in, reportOp); err != nil {
		return 0, 0, err
	}
	line, err := c.out.ReadString('\n')
	if err != nil {
		return 0, 0, fmt.Errorf("fleet server: %w", err)
	}
	f := strings.Fields(line)
	if len(f) != 2 {
		return 0, 0, fmt.Errorf("fleet server said %q", line)
	}
	held, _ = strconv.Atoi(f[0])
	reg, _ = strconv.ParseInt(f[1], 10, 64)
	return held, reg, nil
}

// fleet runs n connections with idle shrink d (negative: off).
func fleet(ctx context.Context, provider string, n int, d time.Duration) FleetResult {
	res := FleetResult{Conns: n, Shrink: d}
	ch, err := spawn(fleetEnv+"="+d.String(), provider)
	if err != nil {
		res.Err = err
		return res
	}
	defer ch.stop()
	dial := conn.Dialer(conn.WithIdleShrink(d))
	conns := make([]net.Conn, 0, n)
	defer func() { closeAll(conns) }()
	for range n {
		c, err := dial(ctx, ch.addr)
		if err != nil {
			res.Err = fmt.Errorf("dial %d: %w", len(conns)+1, err)
			return res
		}
		conns = append(conns, c)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		held, _, err := ch.fleetReport()
		if err != nil {
			res.Err = err
			return res
		}
		if held >= n {
			break
		}
		if time.Now().After(deadline) {
			res.Err = fmt.Errorf("%d dialed, %d accepted", n, held)
			return res
		}
	}
	// Each connection's message at a random time of the traffic period,
	// written by a few workers in time order.
	at := make([]time.Duration, n)
	for i := range at {
		at[i] = time.Duration(rand.Int64N(int64(fleetTraffic)))
	}
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(at[a], at[b]) })
	msg := make([]byte, fleetMsg)
	start := time.Now()
	next := make(chan int)
	var wg sync.WaitGroup
	var werr error
	var emu sync.Mutex
	for range 8 {
		wg.Go(func() {
			for i := range next {
				if _, err := conns[i].Write(msg); err != nil {
					emu.Lock()
					werr = err
					emu.Unlock()
				}
			}
		})
	}
	sampled := make(chan error, 1)
	total := fleetTraffic + max(3*d, time.Second)
	go func() {
		for t := time.Duration(0); t <= total; t += fleetSample {
			time.Sleep(time.Until(start.Add(t)))
			_, sreg, err := ch.fleetReport()
			if err != nil {
				sampled <- err
				return
			}
			res.Samples = append(res.Samples, FleetSample{At: time.Since(start),
				Client: float64(registered(conns)) / float64(n), Server: float64(sreg) / float64(n)})
		}
		sampled <- nil
	}()
	for _, i := range order {
		time.Sleep(time.Until(start.Add(at[i])))
		next <- i
	}
	close(next)
	wg.Wait()
	trafficEnd := time.Since(start)
	if err := <-sampled; err != nil {
		res.Err = err
		return res
	}
	if werr != nil {
		res.Err = werr
		return res
	}
	const small = 2 * conn.DefaultSlotSize * conn.DefaultSlotCount
	for _, s := range res.Samples {
		res.PeakClient, res.PeakServer = max(res.PeakClient, s.Client), max(res.PeakServer, s.Server)
		if res.BackToSmall == 0 && s.At > trafficEnd && s.Client <= small && s.Server <= small {
			res.BackToSmall = s.At - trafficEnd
		}
	}
	last := res.Samples[len(res.Samples)-1]
	res.EndClient, res.EndServer = last.Client, last.Server
	return res
}

// fleetMarkdown prints the fleet runs: peak and end per connection and
// side, the time back to the small phase, and the samples side by side.
func (r *Report) fleetMarkdown(w io.Writer) {
	if len(r.Fleet) == 0 {
		return
	}
	name := func(f FleetResult) string {
		if f.Shrink < 0 {
			return "idle shrink off"
		}
		return fmt.Sprintf("idle shrink %v", f.Shrink)
	}
	fmt.Fprintf(w, "\nA fleet: %s rdmagrpc connections across two processes, each sent one %s message at a random time of the first %v and idle otherwise; registered memory per connection on each side (the small phase: %s):\n\n",
		thousands(float64(r.Fleet[0].Conns)), sizeName(fleetMsg), fleetTraffic, kib(float64(2*conn.DefaultSlotSize*conn.DefaultSlotCount)))
	fmt.Fprintf(w, "| run | peak, client | peak, server | at the end, client | at the end, server | back to small after the traffic |\n|---|---:|---:|---:|---:|---:|\n")
	for _, f := range r.Fleet {
		if f.Err != nil {
			fmt.Fprintf(w, "| %s | failed: %s | | | | |\n", name(f), oneLine(f.Err.Error()))
			continue
		}
		back := "not reached"
		if f.BackToSmall > 0 {
			back = f.BackToSmall.Round(fleetSample).String()
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", name(f), kib(f.PeakClient), kib(f.PeakServer), kib(f.EndClient), kib(f.EndServer), back)
	}
	if len(r.Fleet) != 2 || r.Fleet[0].Err != nil || r.Fleet[1].Err != nil {
		return
	}
	on, off := r.Fleet[0].Samples, r.Fleet[1].Samples
	fmt.Fprintf(w, "\nOver time (client / server, per connection):\n\n| time | %s | %s |\n|---:|---:|---:|\n", name(r.Fleet[0]), name(r.Fleet[1]))
	for i := 0; i < min(len(on), len(off)); i += 3 {
		fmt.Fprintf(w, "| %v | %s / %s | %s / %s |\n", on[i].At.Round(fleetSample), kib(on[i].Client), kib(on[i].Server), kib(off[i].Client), kib(off[i].Server))
	}
}
