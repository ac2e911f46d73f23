package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// What a connection costs to open, against a server in a child process:
// the transport's own dial (TCP: net.Dial; rdmagrpc: to a listener it
// negotiated with before, RDMA directly), and dial to the first answered
// RPC on a new grpc.ClientConn; for rdmagrpc also a first dial, which
// negotiates over TCP behind the dial and upgrades. Against the TCP
// server, a plain grpc-go one, the same for conn.Dial: the fall-back of an
// rdmagrpc client to a server that has not adopted it (goal: ≤ 1.5× a
// TCP dial).
const (
	dialSamples = 200
	rpcSamples  = 50
)

func rowDial() string            { return row2("dial p50") }
func rowDialBlock() string       { return row2("dial back to back p50") }
func rowDialRPC() string         { return row2("dial to first RPC p50") }
func rowDialAnswer() string      { return row2("dial to the listener's answer p50") }
func rowFirstDial() string       { return row2("first dial p50") }
func rowFirstDialRPC() string    { return row2("first dial to first RPC p50") }
func rowFallbackDial() string    { return row2("rdmagrpc fall-back dial p50") }
func rowFallbackVerdict() string { return row2("rdmagrpc fall-back dial to the verdict p50") }
func rowFallbackDialRPC() string { return row2("rdmagrpc fall-back dial to first RPC p50") }

// dialFunc is a transport's dial, as grpc.WithContextDialer takes it.
type dialFunc = func(context.Context, string) (net.Conn, error)

// measureFunc times one sample of what a dial costs.
type measureFunc = func(context.Context, dialFunc, string) (time.Duration, error)

// dials measures the dial rows of every transport, and rdmagrpc's
// fall-back to the TCP server, with every server up at once: the samples
// take turns, one of each per turn in a random order, so that a ratio
// does not depend on what the machine did while one transport's block ran
// and not another's (measured in blocks, on 2 cores, the rdmagrpc median
// moved from 22 to 35 µs from run to run while TCP's stayed at 14-15 µs).
// Each dial still goes to its own server process, as in the rest of the
// table; dialCosts measures the dial back to back too.
func (rep *Report) dials(ctx context.Context, ts []network) error {
	type subject struct {
		name, row string // row: a fall-back row, else the transport's own
		dial      dialFunc
		addr      string
	}
	var subjects []subject
	for _, t := range ts {
		if t.name == Unix && Remote() {
			continue // no unix socket reaches another host
		}
		s, err := startServer(t.name, rep.Config.Provider)
		if err != nil {
			return err
		}
		defer s.stop()
		subjects = append(subjects, subject{name: t.name, dial: t.dial, addr: s.grpc})
		switch t.name {
		case TCP:
			// A server that stays TCP is not remembered: every dial to
			// it is a first one.
			subjects = append(subjects, subject{name: TCP, row: "fallback", dial: conn.Dialer(rep.Config.ConnOptions...), addr: s.grpc})
		case RDMA:
			// To a connection over RDMA, not a dial whose negotiation
			// still runs: the first, which finds the listener, is made
			// here.
			c, err := handshake(t.dial)(ctx, s.grpc)
			if err != nil {
				return fmt.Errorf("%s: first dial: %w", t.name, err)
			}
			c.Close()
		}
	}
	for _, m := range []struct {
		row, fallback string
		samples       int
		measure       measureFunc
	}{
		{rowDial(), rowFallbackDial(), dialSamples, once},
		{rowDialRPC(), rowFallbackDialRPC(), rpcSamples, onceRPC},
	} {
		ds := make([][]time.Duration, len(subjects))
		for range m.samples {
			// In a new order each turn: what a close leaves to do in the
			// background (the server child's teardown) lands on the next
			// sample, and a fixed order would put one transport's on the
			// same other each time.
			for _, k := range rand.Perm(len(subjects)) {
				d, err := m.measure(ctx, subjects[k].dial, subjects[k].addr)
				if err != nil {
					return fmt.Errorf("%s: %s: %w", subjects[k].name, m.row, err)
				}
				ds[k] = append(ds[k], d)
			}
		}
		for k, s := range subjects {
			row := m.row
			if s.row != "" {
				row = m.fallback
			}
			slices.Sort(ds[k])
			rep.add(row, s.name, ds[k][len(ds[k])/2].Seconds())
		}
	}
	return nil
}

// dialCosts measures the dial rows that have no counterpart in the other
// transports: rdmagrpc's wait for the listener's answer and its first
// dial to a server, and the fall-back's wait for the verdict.
func (rep *Report) dialCosts(ctx context.Context, t network, addr string) error {
	add := func(row string, measure measureFunc, dial dialFunc) error {
		d, err := measure(ctx, dial, addr)
		if err != nil {
			return fmt.Errorf("%s: %s: %w", t.name, row, err)
		}
		rep.add(row, t.name, d.Seconds())
		return nil
	}
	d := conn.Dialer(rep.Config.ConnOptions...)
	if t.name == RDMA {
		// To a connection over RDMA, not a dial whose negotiation
		// still runs.
		c, err := handshake(t.dial)(ctx, addr)
		if err != nil {
			return fmt.Errorf("%s: first dial: %w", t.name, err)
		}
		c.Close()
	}
	// The dial again, dialSamples of this transport in a row: each dial
	// then meets what the close of the one before it left to do.
	if err := add(rowDialBlock(), medianDial, t.dial); err != nil {
		return err
	}
	switch t.name {
	case TCP:
		return add(rowFallbackVerdict(), medianDial, handshake(d))
	case RDMA:
	default:
		return nil
	}
	// A dial to the listener returns once its request is queued, as TCP's
	// once the kernel queued the connection; the listener's answer, which
	// TCP's dial does not wait for, is timed apart.
	if err := add(rowDialAnswer(), medianDial, handshake(t.dial)); err != nil {
		return err
	}
	// A dial that has not seen the server: what the first dial of a
	// process to each server costs.
	first := func(ctx context.Context, addr string) (net.Conn, error) {
		conn.ForgetServers()
		return d(ctx, addr)
	}
	if err := add(rowFirstDial(), medianDial, handshake(first)); err != nil {
		return err
	}
	return add(rowFirstDialRPC(), medianFirstRPC, first)
}

// handshake is dial followed by the wait for the negotiation's verdict.
func handshake(dial dialFunc) dialFunc {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		c, err := dial(ctx, addr)
		if err != nil {
			return nil, err
		}
		if err := c.(*conn.Conn).Handshake(ctx); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}
}

// once times one dial; the connection is closed after.
func once(ctx context.Context, dial dialFunc, addr string) (time.Duration, error) {
	start := time.Now()
	c, err := dial(ctx, addr)
	if err != nil {
		return 0, err
	}
	d := time.Since(start)
	c.Close()
	return d, nil
}

// onceRPC times one dial to a first answered RPC.
func onceRPC(ctx context.Context, dial dialFunc, addr string) (time.Duration, error) {
	start := time.Now()
	cc, err := firstRPC(ctx, addr, dial)
	d := time.Since(start)
	if cc != nil {
		cc.Close()
	}
	return d, err
}

// median is the median of samples of measure.
func median(ctx context.Context, samples int, measure measureFunc, dial dialFunc, addr string) (time.Duration, error) {
	ds := make([]time.Duration, 0, samples)
	for range samples {
		d, err := measure(ctx, dial, addr)
		if err != nil {
			return 0, err
		}
		ds = append(ds, d)
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}

func medianDial(ctx context.Context, dial dialFunc, addr string) (time.Duration, error) {
	return median(ctx, dialSamples, once, dial, addr)
}

// firstRPC opens a gRPC client connection with dial (passthrough: one
// connection, no retries behind our back) and makes one 64 B unary call
// on it. The connection comes back even when the call failed, for the
// caller to close.
func firstRPC(ctx context.Context, addr string, dial dialFunc) (*grpc.ClientConn, error) {
	cc, err := grpc.NewClient("passthrough:///"+addr, grpc.WithContextDialer(dial),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	_, err = testgrpc.NewBenchmarkServiceClient(cc).UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: 64, Payload: &testgrpc.Payload{Body: body(64)}})
	return cc, err
}

func medianFirstRPC(ctx context.Context, dial dialFunc, addr string) (time.Duration, error) {
	return median(ctx, rpcSamples, onceRPC, dial, addr)
}
