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
	if t.name == TCP {
		// A plain gRPC server, and rdmagrpc's fall-back to it. The two
		// dials alternate, sample by sample, so that their ratio does not
		// depend on what the machine did in one block and not the other
		// (the rdmagrpc dial's negotiation goroutine, the server
		// process's work for the dials before: on 2 cores, medians of
		// back-to-back blocks moved by a third from run to run).
		pair := func(rowA, rowB string, samples int, measure measureFunc, a, b dialFunc) error {
			da, db, err := alternate(ctx, samples, measure, a, b, addr)
			if err != nil {
				return fmt.Errorf("%s: %s, %s: %w", t.name, rowA, rowB, err)
			}
			rep.add(rowA, t.name, da.Seconds())
			rep.add(rowB, t.name, db.Seconds())
			return nil
		}
		// A server that stays TCP is not remembered: every dial to it is
		// a first one.
		if err := pair(rowDial(), rowFallbackDial(), dialSamples, once, t.dial, d); err != nil {
			return err
		}
		if err := add(rowFallbackVerdict(), medianDial, handshake(d)); err != nil {
			return err
		}
		return pair(rowDialRPC(), rowFallbackDialRPC(), rpcSamples, onceRPC, t.dial, d)
	}
	dial := t.dial
	if t.name == RDMA {
		// To a connection over RDMA, not a dial whose negotiation still
		// runs: the first, which finds the listener, is made here.
		c, err := handshake(dial)(ctx, addr)
		if err != nil {
			return fmt.Errorf("%s: first dial: %w", t.name, err)
		}
		c.Close()
		// A dial to the listener returns once its request is queued, as
		// TCP's once the kernel queued the connection; the listener's
		// answer, which TCP's dial does not wait for, is timed apart.
		if err := add(rowDialAnswer(), medianDial, handshake(dial)); err != nil {
			return err
		}
	}
	if err := add(rowDial(), medianDial, dial); err != nil {
		return err
	}
	if err := add(rowDialRPC(), medianFirstRPC, t.dial); err != nil {
		return err
	}
	if t.name != RDMA {
		return nil
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

// alternate is the medians of samples of measure with a and with b,
// taken in turns (a b, then b a: neither always follows the other).
func alternate(ctx context.Context, samples int, measure measureFunc, a, b dialFunc, addr string) (time.Duration, time.Duration, error) {
	da := make([]time.Duration, 0, samples)
	db := make([]time.Duration, 0, samples)
	for i := range samples {
		first, second, fs, ss := a, b, &da, &db
		if i%2 == 1 {
			first, second, fs, ss = b, a, &db, &da
		}
		d, err := measure(ctx, first, addr)
		if err != nil {
			return 0, 0, err
		}
		*fs = append(*fs, d)
		if d, err = measure(ctx, second, addr); err != nil {
			return 0, 0, err
		}
		*ss = append(*ss, d)
	}
	slices.Sort(da)
	slices.Sort(db)
	return da[len(da)/2], db[len(db)/2], nil
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
