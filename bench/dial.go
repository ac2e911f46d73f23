package bench

import (
	"context"
	"fmt"
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
// rdmagrpc client to a server that has not adopted it (issue 18: ≤ 1.5× a
// TCP dial).
const (
	dialSamples = 200
	rpcSamples  = 50
)

func rowDial() string            { return row2("dial p50") }
func rowDialRPC() string         { return row2("dial to first RPC p50") }
func rowFirstDial() string       { return row2("first dial p50") }
func rowFirstDialRPC() string    { return row2("first dial to first RPC p50") }
func rowFallbackDial() string    { return row2("rdmagrpc fall-back dial p50") }
func rowFallbackVerdict() string { return row2("rdmagrpc fall-back dial to the verdict p50") }
func rowFallbackDialRPC() string { return row2("rdmagrpc fall-back dial to first RPC p50") }

func (rep *Report) dialCosts(ctx context.Context, t network, addr string) error {
	type dialer = func(context.Context, string) (net.Conn, error)
	add := func(row string, measure func(context.Context, dialer, string) (time.Duration, error), dial dialer) error {
		d, err := measure(ctx, dial, addr)
		if err != nil {
			return fmt.Errorf("%s: %s: %w", t.name, row, err)
		}
		rep.add(row, t.name, d.Seconds())
		return nil
	}
	dial := t.dial
	if t.name == RDMA {
		// To a connection over RDMA, not a dial whose negotiation still
		// runs (the first, which finds the listener).
		dial = handshake(dial)
	}
	if err := add(rowDial(), medianDial, dial); err != nil {
		return err
	}
	if err := add(rowDialRPC(), medianFirstRPC, t.dial); err != nil {
		return err
	}
	// A dial that has not seen the server: what the first dial of a
	// process to each server costs.
	d := conn.Dialer(rep.Config.ConnOptions...)
	first := func(ctx context.Context, addr string) (net.Conn, error) {
		conn.ForgetServers()
		return d(ctx, addr)
	}
	switch t.name {
	case TCP:
		// A server that stays TCP is not remembered: every dial to it is
		// a first one.
		if err := add(rowFallbackDial(), medianDial, d); err != nil {
			return err
		}
		if err := add(rowFallbackVerdict(), medianDial, handshake(d)); err != nil {
			return err
		}
		return add(rowFallbackDialRPC(), medianFirstRPC, d)
	case RDMA:
		if err := add(rowFirstDial(), medianDial, handshake(first)); err != nil {
			return err
		}
		return add(rowFirstDialRPC(), medianFirstRPC, first)
	}
	return nil
}

// handshake is dial followed by the wait for the negotiation's verdict.
func handshake(dial func(context.Context, string) (net.Conn, error)) func(context.Context, string) (net.Conn, error) {
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

func medianDial(ctx context.Context, dial func(context.Context, string) (net.Conn, error), addr string) (time.Duration, error) {
	ds := make([]time.Duration, 0, dialSamples)
	for range dialSamples {
		start := time.Now()
		c, err := dial(ctx, addr)
		if err != nil {
			return 0, err
		}
		ds = append(ds, time.Since(start))
		c.Close()
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}

// firstRPC opens a gRPC client connection with dial (passthrough: one
// connection, no retries behind our back) and makes one 64 B unary call
// on it. The connection comes back even when the call failed, for the
// caller to close.
func firstRPC(ctx context.Context, addr string, dial func(context.Context, string) (net.Conn, error)) (*grpc.ClientConn, error) {
	cc, err := grpc.NewClient("passthrough:///"+addr, grpc.WithContextDialer(dial),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	_, err = testgrpc.NewBenchmarkServiceClient(cc).UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: 64, Payload: &testgrpc.Payload{Body: body(64)}})
	return cc, err
}

func medianFirstRPC(ctx context.Context, dial func(context.Context, string) (net.Conn, error), addr string) (time.Duration, error) {
	ds := make([]time.Duration, 0, rpcSamples)
	for range rpcSamples {
		start := time.Now()
		cc, err := firstRPC(ctx, addr, dial)
		ds = append(ds, time.Since(start))
		if cc != nil {
			cc.Close()
		}
		if err != nil {
			return 0, err
		}
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}
