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
// the transport's own dial (TCP: net.Dial; rdmagrpc: TCP, negotiation and
// the RDMA set-up), and dial to the first answered RPC on a new
// grpc.ClientConn. Against the TCP server, a plain grpc-go one, the same
// for conn.Dial: the fall-back of an rdmagrpc client to a server that has
// not adopted it (issue 18: ≤ 1.5× a TCP dial): a first dial, which
// negotiates, and the dials after it, which know the server stays TCP.
const (
	dialSamples = 200
	rpcSamples  = 50
)

func rowDial() string            { return row2("dial p50") }
func rowDialRPC() string         { return row2("dial to first RPC p50") }
func rowFallbackDial() string    { return row2("rdmagrpc fall-back dial p50") }
func rowFallbackFirst() string   { return row2("rdmagrpc fall-back first dial p50") }
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
	if err := add(rowDial(), medianDial, t.dial); err != nil {
		return err
	}
	if err := add(rowDialRPC(), medianFirstRPC, t.dial); err != nil {
		return err
	}
	if t.name != TCP {
		return nil
	}
	fallback := conn.Dialer(rep.Config.ConnOptions...)
	first := func(ctx context.Context, addr string) (net.Conn, error) {
		conn.ForgetServers()
		return fallback(ctx, addr)
	}
	if err := add(rowFallbackFirst(), medianDial, first); err != nil {
		return err
	}
	if err := add(rowFallbackDial(), medianDial, fallback); err != nil {
		return err
	}
	return add(rowFallbackDialRPC(), medianFirstRPC, fallback)
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

func medianFirstRPC(ctx context.Context, dial func(context.Context, string) (net.Conn, error), addr string) (time.Duration, error) {
	ds := make([]time.Duration, 0, rpcSamples)
	for range rpcSamples {
		start := time.Now()
		cc, err := grpc.NewClient("passthrough:///"+addr, grpc.WithContextDialer(dial),
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return 0, err
		}
		_, err = testgrpc.NewBenchmarkServiceClient(cc).UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: 64, Payload: &testgrpc.Payload{Body: body(64)}})
		ds = append(ds, time.Since(start))
		cc.Close()
		if err != nil {
			return 0, err
		}
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}
