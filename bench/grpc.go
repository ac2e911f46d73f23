package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
)

// maxMsg bounds grpc-go's message sizes on both ends: the largest unary
// size plus protobuf framing.
const maxMsg = 16 << 20

// zeros backs every payload: read-only, shared, as large as the largest.
var zeros = make([]byte, maxMsg)

func body(n int) []byte { return zeros[:n:n] }

// service is grpc-go's BenchmarkService (interop/grpc_testing) with the
// methods measured: UnaryCall answers ResponseSize bytes;
// StreamingFromServer sends ResponseSize-byte messages until the client
// goes away; StreamingFromClient reads to the client's end and answers
// once, empty; StreamingCall echoes each message.
type service struct {
	testgrpc.UnimplementedBenchmarkServiceServer
}

func (service) UnaryCall(_ context.Context, in *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	return &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: body(int(in.ResponseSize))}}, nil
}

func (service) StreamingFromServer(in *testgrpc.SimpleRequest, s grpc.ServerStreamingServer[testgrpc.SimpleResponse]) error {
	resp := &testgrpc.SimpleResponse{Payload: &testgrpc.Payload{Body: body(int(in.ResponseSize))}}
	for {
		if err := s.Send(resp); err != nil {
			return err
		}
	}
}

func (service) StreamingFromClient(s grpc.ClientStreamingServer[testgrpc.SimpleRequest, testgrpc.SimpleResponse]) error {
	for {
		if _, err := s.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return s.SendAndClose(&testgrpc.SimpleResponse{})
			}
			return err
		}
	}
}

func (service) StreamingCall(s grpc.BidiStreamingServer[testgrpc.SimpleRequest, testgrpc.SimpleResponse]) error {
	for {
		in, err := s.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := s.Send(&testgrpc.SimpleResponse{Payload: in.GetPayload()}); err != nil {
			return err
		}
	}
}

// rig is a grpc-go server and client over one transport.
type rig struct {
	t   network
	lis net.Listener
	srv *grpc.Server
	cc  *grpc.ClientConn
	tc  testgrpc.BenchmarkServiceClient
}

func newRig(ctx context.Context, t network) (*rig, error) {
	lis, err := t.listen(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: listen: %w", t.name, err)
	}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(maxMsg), grpc.MaxSendMsgSize(maxMsg))
	testgrpc.RegisterBenchmarkServiceServer(srv, service{})
	go srv.Serve(lis)
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
		grpc.WithContextDialer(t.dial),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsg), grpc.MaxCallSendMsgSize(maxMsg)))
	if err != nil {
		srv.Stop()
		return nil, fmt.Errorf("%s: client: %w", t.name, err)
	}
	return &rig{t: t, lis: lis, srv: srv, cc: cc, tc: testgrpc.NewBenchmarkServiceClient(cc)}, nil
}

func (r *rig) close() {
	r.cc.Close()
	if r.srv != nil {
		r.srv.Stop()
	}
}

func (r *rig) unary(ctx context.Context, size int) error {
	_, err := r.tc.UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: int32(size), Payload: &testgrpc.Payload{Body: body(size)}})
	if err != nil {
		return fmt.Errorf("%s: unary %d B: %w", r.t.name, size, err)
	}
	return nil
}

// latency runs unary calls of size bytes each way, one at a time, for d
// (at least minSamples calls), and returns their p50 and p99.
func (r *rig) latency(ctx context.Context, size int, d time.Duration) (p50, p99 time.Duration, err error) {
	p50, p99, _, err = r.latencyCalls(ctx, size, d)
	return p50, p99, err
}

// latencyCalls is latency, with the number of calls made.
func (r *rig) latencyCalls(ctx context.Context, size int, d time.Duration) (p50, p99 time.Duration, calls int, err error) {
	const minSamples = 5
	var samples []time.Duration
	start := time.Now()
	for len(samples) < minSamples || time.Since(start) < d {
		t0 := time.Now()
		if err := r.unary(ctx, size); err != nil {
			return 0, 0, 0, err
		}
		samples = append(samples, time.Since(t0))
	}
	slices.Sort(samples)
	return percentile(samples, 50), percentile(samples, 99), len(samples), nil
}

// percentile by nearest rank of sorted samples.
func percentile(sorted []time.Duration, p int) time.Duration {
	i := (len(sorted)*p + 99) / 100
	return sorted[max(i, 1)-1]
}

// qps runs conc goroutines of back-to-back 64-byte unary calls on the one
// client connection for d, and returns calls per second and the process's
// CPU time (user+sys, client and server together) per call.
func (r *rig) qps(ctx context.Context, conc, size int, d time.Duration) (perSec float64, cpuPerRPC time.Duration, err error) {
	var (
		n    atomic.Int64
		wg   sync.WaitGroup
		emu  sync.Mutex
		ferr error
	)
	cpu0 := cpuTime()
	start := time.Now()
	deadline := start.Add(d)
	for range conc {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				if err := r.unary(ctx, size); err != nil {
					emu.Lock()
					ferr = err
					emu.Unlock()
					return
				}
				n.Add(1)
			}
		})
	}
	wg.Wait()
	el := time.Since(start)
	cpu := cpuTime() - cpu0
	if ferr != nil {
		return 0, 0, ferr
	}
	calls := n.Load()
	return float64(calls) / el.Seconds(), cpu / time.Duration(max(calls, 1)), nil
}

// stream receives size-byte server-streamed messages for d and returns
// the bytes per second received.
func (r *rig) stream(ctx context.Context, size int, d time.Duration) (float64, error) {
	bps, _, err := r.streamBytes(ctx, size, d)
	return bps, err
}

// streamBytes is stream, with the bytes counted.
func (r *rig) streamBytes(ctx context.Context, size int, d time.Duration) (float64, int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := r.tc.StreamingFromServer(ctx, &testgrpc.SimpleRequest{ResponseSize: int32(size)})
	if err != nil {
		return 0, 0, fmt.Errorf("%s: stream: %w", r.t.name, err)
	}
	// The first message includes the stream's start: not counted.
	if _, err := s.Recv(); err != nil {
		return 0, 0, fmt.Errorf("%s: stream: %w", r.t.name, err)
	}
	var bytes int
	start := time.Now()
	for bytes < 2*size || time.Since(start) < d {
		m, err := s.Recv()
		if err != nil {
			return 0, 0, fmt.Errorf("%s: stream: %w", r.t.name, err)
		}
		bytes += len(m.GetPayload().GetBody())
	}
	return float64(bytes) / time.Since(start).Seconds(), bytes, nil
}

// Stream directions measured: the server streams to the client, the
// client to the server, or the server echoes what the client streams.
const (
	fromServer = "server"
	fromClient = "client"
	duplex     = "duplex"
)

var directions = []string{fromServer, fromClient, duplex}

// streamDir moves size-byte messages in direction dir for d (at least two
// messages) and returns the bytes per second and the bytes delivered: to
// the client for fromServer and duplex (echoed, so each byte crossed
// twice), to the server for fromClient, counted once the server said it
// read them all.
func (r *rig) streamDir(ctx context.Context, dir string, size int, d time.Duration) (float64, int, error) {
	switch dir {
	case fromServer:
		return r.streamBytes(ctx, size, d)
	case fromClient:
		return r.clientStream(ctx, size, d)
	default:
		return r.echoStream(ctx, size, d)
	}
}

func (r *rig) clientStream(ctx context.Context, size int, d time.Duration) (float64, int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := r.tc.StreamingFromClient(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("%s: client stream: %w", r.t.name, err)
	}
	req := &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: body(size)}}
	var bytes int
	start := time.Now()
	for bytes < 2*size || time.Since(start) < d {
		if err := s.Send(req); err != nil {
			return 0, 0, fmt.Errorf("%s: client stream: %w", r.t.name, err)
		}
		bytes += size
	}
	if _, err := s.CloseAndRecv(); err != nil {
		return 0, 0, fmt.Errorf("%s: client stream: %w", r.t.name, err)
	}
	return float64(bytes) / time.Since(start).Seconds(), bytes, nil
}

// echoStream sends from one goroutine and receives the echoes on this
// one, with at most echoWindow messages in flight: pipelined, as a duplex
// stream runs, without letting grpc-go's buffers grow without bound.
func (r *rig) echoStream(ctx context.Context, size int, d time.Duration) (float64, int, error) {
	const echoWindow = 4
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := r.tc.StreamingCall(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("%s: duplex stream: %w", r.t.name, err)
	}
	req := &testgrpc.SimpleRequest{Payload: &testgrpc.Payload{Body: body(size)}}
	credit := make(chan struct{}, echoWindow)
	for range echoWindow {
		credit <- struct{}{}
	}
	stop := make(chan struct{})
	sendErr := make(chan error, 1)
	go func() {
		defer close(sendErr)
		for {
			select {
			case <-stop:
				sendErr <- s.CloseSend()
				return
			case <-ctx.Done():
				return
			case <-credit:
			}
			if err := s.Send(req); err != nil {
				sendErr <- err
				return
			}
		}
	}()
	var bytes int
	start := time.Now()
	for bytes < 2*size || time.Since(start) < d {
		m, err := s.Recv()
		if err != nil {
			cancel()
			return 0, 0, fmt.Errorf("%s: duplex stream: %w", r.t.name, err)
		}
		bytes += len(m.GetPayload().GetBody())
		credit <- struct{}{}
	}
	el := time.Since(start)
	close(stop)
	for {
		if _, err := s.Recv(); err != nil {
			if !errors.Is(err, io.EOF) {
				return 0, 0, fmt.Errorf("%s: duplex stream's end: %w", r.t.name, err)
			}
			break
		}
		select {
		case credit <- struct{}{}:
		default:
		}
	}
	if err := <-sendErr; err != nil {
		return 0, 0, fmt.Errorf("%s: duplex stream: %w", r.t.name, err)
	}
	return float64(bytes) / el.Seconds(), bytes, nil
}

// cpuTime is the user+sys CPU time of the process so far.
func cpuTime() time.Duration {
	u, _ := usage()
	return u
}

// usage is the user+sys CPU time of the process so far, and its context
// switches (voluntary and not): on a busy host each switch is a thread
// woken or preempted, and the count says where a transport's time goes
// better than its CPU alone.
func usage() (time.Duration, int64) {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0, 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), ru.Nvcsw + ru.Nivcsw
}
