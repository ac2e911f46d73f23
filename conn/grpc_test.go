package conn_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	rinterop "github.com/rdmagrpc/rdmagrpc/interop"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

const (
	envServer = "RDMAGRPC_CONN_TEST_SERVER"
	envWriter = "RDMAGRPC_CONN_TEST_WRITER"
	// envServerAddr: the server process listens there.
	envServerAddr = "RDMAGRPC_CONN_TEST_SERVER_ADDR"
	// envClient: the process is a client of that address (netns_test.go).
	envClient = "RDMAGRPC_CONN_TEST_CLIENT"
	bigMsg    = 4 << 20
)

func TestMain(m *testing.M) {
	if os.Getenv(envServer) != "" {
		os.Exit(serveUntilStdinCloses())
	}
	if a := os.Getenv(envClient); a != "" {
		os.Exit(clientOnce(a))
	}
	if a := os.Getenv(envWriter); a != "" {
		os.Exit(writeForever(a))
	}
	if a := os.Getenv(envKillPeer); a != "" {
		os.Exit(killPeer(a))
	}
	os.Exit(m.Run())
}

func testAddr() string {
	if a := os.Getenv("RXE_ADDR"); a != "" {
		return net.JoinHostPort(a, "0")
	}
	return "127.0.0.1:0"
}

func newServer() *grpc.Server {
	s := grpc.NewServer(grpc.MaxRecvMsgSize(2*bigMsg), grpc.MaxSendMsgSize(2*bigMsg))
	testgrpc.RegisterTestServiceServer(s, interop.NewTestServer())
	return s
}

// serveUntilStdinCloses is the server process of the two-process test: it
// prints its address, serves, and stops gracefully when stdin closes.
func serveUntilStdinCloses() int {
	addr := testAddr()
	if a := os.Getenv(envServerAddr); a != "" {
		addr = a
	}
	l, err := conn.Listen(context.Background(), addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	s := newServer()
	go s.Serve(l)
	fmt.Println(l.Addr().String())
	io.Copy(io.Discard, os.Stdin)
	s.GracefulStop()
	return 0
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithContextDialer(conn.Dialer()),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(2*bigMsg), grpc.MaxCallSendMsgSize(2*bigMsg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// rpcs is the list every setup runs: grpc-go's interop cases for a
// plaintext transport, then large messages, many concurrent streams and
// deadlines.
func rpcs(t *testing.T, cc *grpc.ClientConn) {
	tc := testgrpc.NewTestServiceClient(cc)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, c := range []struct {
		name string
		f    func()
	}{
		{"EmptyUnary", func() { interop.DoEmptyUnaryCall(ctx, tc) }},
		{"LargeUnary", func() { interop.DoLargeUnaryCall(ctx, tc) }},
		{"ClientStreaming", func() { interop.DoClientStreaming(ctx, tc) }},
		{"ServerStreaming", func() { interop.DoServerStreaming(ctx, tc) }},
		{"PingPong", func() { interop.DoPingPong(ctx, tc) }},
		{"EmptyStream", func() { interop.DoEmptyStream(ctx, tc) }},
		{"TimeoutOnSleepingServer", func() { interop.DoTimeoutOnSleepingServer(ctx, tc) }},
		{"CancelAfterBegin", func() {
			if err := rinterop.CancelAfterBegin(ctx, tc); err != nil {
				t.Error(err)
			}
		}},
		{"CancelAfterFirstResponse", func() { interop.DoCancelAfterFirstResponse(ctx, tc) }},
		{"CustomMetadata", func() { interop.DoCustomMetadata(ctx, tc) }},
		{"StatusCodeAndMessage", func() { interop.DoStatusCodeAndMessage(ctx, tc) }},
		{"SpecialStatusMessage", func() { interop.DoSpecialStatusMessage(ctx, tc) }},
		{"UnimplementedMethod", func() { interop.DoUnimplementedMethod(ctx, cc) }},
		{"UnimplementedService", func() { interop.DoUnimplementedService(ctx, testgrpc.NewUnimplementedServiceClient(cc)) }},
		{"Unary4MiB", func() { unaryBig(t, ctx, tc) }},
		{"ConcurrentStreams100", func() { concurrentStreams(t, ctx, tc, 100) }},
		{"Deadline", func() { deadline(t, tc) }},
	} {
		t.Run(c.name, func(t *testing.T) { c.f() })
	}
}

func unaryBig(t *testing.T, ctx context.Context, tc testgrpc.TestServiceClient) {
	body := bytes.Repeat([]byte("rdmagrpc"), bigMsg/8)
	resp, err := tc.UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: bigMsg, Payload: &testgrpc.Payload{Body: body}})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(resp.GetPayload().GetBody()); n != bigMsg {
		t.Fatalf("response of %d bytes, want %d", n, bigMsg)
	}
}

func concurrentStreams(t *testing.T, ctx context.Context, tc testgrpc.TestServiceClient, n int) {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			st, err := tc.FullDuplexCall(ctx)
			if err != nil {
				errs <- err
				return
			}
			for j := range 5 {
				size := int32(1 + (i*131+j*977)%40000) // below and above a slot
				if err := st.Send(&testgrpc.StreamingOutputCallRequest{ResponseParameters: []*testgrpc.ResponseParameters{{Size: size}}}); err != nil {
					errs <- err
					return
				}
				r, err := st.Recv()
				if err != nil {
					errs <- err
					return
				}
				if len(r.GetPayload().GetBody()) != int(size) {
					errs <- fmt.Errorf("stream %d: %d bytes, want %d", i, len(r.GetPayload().GetBody()), size)
					return
				}
			}
			st.CloseSend()
			if _, err := st.Recv(); err != io.EOF {
				errs <- fmt.Errorf("stream %d end: %v", i, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func deadline(t *testing.T, tc testgrpc.TestServiceClient) {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	st, err := tc.FullDuplexCall(ctx) // the server waits for us: only the deadline ends it
	if err == nil {
		_, err = st.Recv()
	}
	if err == nil || !strings.Contains(err.Error(), "DeadlineExceeded") {
		t.Fatalf("stream past its deadline: %v, want DeadlineExceeded", err)
	}
}

func TestGRPCOneProcess(t *testing.T) {
	l, err := conn.Listen(context.Background(), testAddr())
	if err != nil {
		t.Fatal(err)
	}
	s := newServer()
	done := make(chan error, 1)
	go func() { done <- s.Serve(l) }()
	rpcs(t, dial(t, l.Addr().String()))
	// GracefulStop waits for an open stream to finish.
	cc := dial(t, l.Addr().String())
	st, err := testgrpc.NewTestServiceClient(cc).FullDuplexCall(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&testgrpc.StreamingOutputCallRequest{ResponseParameters: []*testgrpc.ResponseParameters{{Size: 10}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	stopped := make(chan struct{})
	go func() { s.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
		t.Fatal("GracefulStop returned with a stream open")
	case <-time.After(100 * time.Millisecond):
	}
	st.CloseSend()
	st.Recv()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("GracefulStop did not return once the stream ended")
	}
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// serverChild starts cmd, a server process (envServer set: it prints
// its address, serves, and stops gracefully when its stdin closes), and
// returns its address and a stop that waits for that graceful end.
func serverChild(t *testing.T, cmd *exec.Cmd) (addr string, stop func()) {
	t.Helper()
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	addr, err = bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("server process address: %v", err)
	}
	addr = strings.TrimSpace(addr)
	if _, _, err := net.SplitHostPort(addr); err != nil {
		t.Fatalf("server process printed %q", addr)
	}
	return addr, func() {
		t.Helper()
		stdin.Close() // the server stops gracefully
		errc := make(chan error, 1)
		go func() { errc <- cmd.Wait() }()
		select {
		case err := <-errc:
			if err != nil {
				t.Fatalf("server process: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("server process did not stop")
		}
	}
}

func TestGRPCTwoProcesses(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envServer+"=1")
	addr, stop := serverChild(t, cmd)
	cc := dial(t, addr)
	rpcs(t, cc)
	cc.Close()
	stop()
}

// grpc-go with 1 MiB write and read buffers writes up to 1 MiB at a time:
// above the rendezvous threshold, so 16 MiB messages travel by rendezvous. The flow
// control windows are set, not estimated: with grpc-go's BDP estimator a
// window can stay at 64 KiB for a whole exchange when its pings happen to
// measure a short round trip, and then no write ever reaches 1 MiB (CI saw
// the server answer 83 MB in 64 KiB records).
func TestGRPCRendezvous(t *testing.T) {
	const msg = 16 << 20
	l, err := conn.Listen(context.Background(), testAddr())
	if err != nil {
		t.Fatal(err)
	}
	const window = 4 << 20
	s := grpc.NewServer(grpc.MaxRecvMsgSize(2*msg), grpc.MaxSendMsgSize(2*msg),
		grpc.WriteBufferSize(1<<20), grpc.ReadBufferSize(1<<20),
		grpc.InitialWindowSize(window), grpc.InitialConnWindowSize(window))
	testgrpc.RegisterTestServiceServer(s, interop.NewTestServer())
	go s.Serve(l)
	defer s.Stop()
	dialer, dialed := recordingDialer()
	cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(),
		grpc.WithContextDialer(dialer),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithWriteBufferSize(1<<20), grpc.WithReadBufferSize(1<<20),
		grpc.WithInitialWindowSize(window), grpc.WithInitialConnWindowSize(window),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(2*msg), grpc.MaxCallSendMsgSize(2*msg)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	tc := testgrpc.NewTestServiceClient(cc)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	body := make([]byte, msg)
	for i := range body {
		body[i] = byte(i * 7)
	}
	for range 3 {
		resp, err := tc.UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: msg, Payload: &testgrpc.Payload{Body: body}})
		if err != nil {
			t.Fatal(err)
		}
		if n := len(resp.GetPayload().GetBody()); n != msg {
			t.Fatalf("response of %d bytes, want %d", n, msg)
		}
	}
	st, err := tc.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := st.Send(&testgrpc.StreamingOutputCallRequest{Payload: &testgrpc.Payload{Body: body},
			ResponseParameters: []*testgrpc.ResponseParameters{{Size: msg}}}); err != nil {
			t.Fatal(err)
		}
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(r.GetPayload().GetBody()) != msg {
			t.Fatalf("stream response of %d bytes", len(r.GetPayload().GetBody()))
		}
	}
	st.CloseSend()
	if _, err := st.Recv(); err != io.EOF {
		t.Fatalf("stream end: %v", err)
	}
	conns := dialed()
	if len(conns) != 1 {
		t.Fatalf("%d connections, want 1", len(conns))
	}
	s0 := conns[0].Stats()
	if s0.Rendezvous == 0 || s0.RendezvousIn == 0 {
		t.Fatalf("no rendezvous in a 16 MiB exchange with 1 MiB buffers: %+v", s0)
	}
	t.Logf("client: %d messages out by rendezvous, %d in (%d bytes); %d bytes out in all", s0.Rendezvous, s0.RendezvousIn, s0.RendezvousBytesIn, s0.BytesOut)
}

// verbsHere skips a test that needs a working verbs device and the
// provider chosen, not pinned (the rxe guests).
func verbsHere(t *testing.T) {
	t.Helper()
	t.Setenv("RDMAGRPC_PROVIDER", "")
	if name, why, err := conn.ProviderChoice(); err != nil || name != "verbs" {
		t.Skipf("needs an RDMA device (the rxe tier): the provider here is %q (%s, %v)", name, why, err)
	}
}

// providerOf dials addr with gRPC, runs the RPC list and returns the
// client connections' stats.
func providerOf(t *testing.T, addr string) conn.Stats {
	t.Helper()
	dialer, dialed := recordingDialer()
	cc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithContextDialer(dialer),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(2*bigMsg), grpc.MaxCallSendMsgSize(2*bigMsg)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	rpcs(t, cc)
	conns := dialed()
	if len(conns) == 0 {
		t.Fatal("no connection dialed")
	}
	return conns[len(conns)-1].Stats()
}

// Two processes of one host with an RDMA device: the server listens on
// verbs and shm, and the client, on the same kernel, is served over shm.
func TestRXESameHostChoosesShm(t *testing.T) {
	verbsHere(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envServer+"=1")
	addr, stop := serverChild(t, cmd)
	st := providerOf(t, addr)
	if st.Provider != "shm" || !strings.Contains(st.ProviderReason, "same kernel") {
		t.Errorf("client on the server's host: provider %q (%s), want shm (same kernel)", st.Provider, st.ProviderReason)
	}
	stop()
}

// Across two hosts with RDMA devices the same listener serves over verbs:
// guest a serves, guest b dials.
func TestRXEPairChoosesVerbs(t *testing.T) {
	role, self, peer := os.Getenv("RXE_ROLE"), os.Getenv("RXE_ADDR"), os.Getenv("RXE_PEER")
	if role != "a" && role != "b" {
		t.Skip("runs only in the two-guest mode of tests/rxe (RXE_ROLE=a|b)")
	}
	verbsHere(t)
	const port, donePort = "7481", "7482"
	if role == "a" {
		l, err := conn.Listen(t.Context(), net.JoinHostPort(self, port))
		if err != nil {
			t.Fatal(err)
		}
		s := newServer()
		go s.Serve(l)
		defer s.Stop()
		done, err := net.Listen("tcp", net.JoinHostPort(self, donePort))
		if err != nil {
			t.Fatal(err)
		}
		defer done.Close()
		done.(*net.TCPListener).SetDeadline(time.Now().Add(4 * time.Minute))
		c, err := done.Accept()
		if err != nil {
			t.Fatalf("guest b never finished: %v", err)
		}
		c.Close()
		return
	}
	addr := net.JoinHostPort(peer, port)
	testutil.Eventually(t, time.Minute, "guest a to listen", func() (bool, string) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return false, err.Error()
		}
		c.Close()
		return true, ""
	})
	st := providerOf(t, addr)
	if st.Provider != "verbs" || !strings.Contains(st.ProviderReason, "another host") {
		t.Errorf("client on another host: provider %q (%s), want verbs (another host)", st.Provider, st.ProviderReason)
	}
	c, err := net.Dial("tcp", net.JoinHostPort(peer, donePort))
	if err != nil {
		t.Fatalf("telling guest a: %v", err)
	}
	c.Close()
}

// recordingDialer is conn.Dialer for grpc.WithContextDialer that keeps
// the connections it dialed; dialed returns them so far.
func recordingDialer() (dial func(context.Context, string) (net.Conn, error), dialed func() []*conn.Conn) {
	var mu sync.Mutex
	var conns []*conn.Conn
	dialer := conn.Dialer()
	return func(ctx context.Context, addr string) (net.Conn, error) {
			c, err := dialer(ctx, addr)
			if err == nil {
				mu.Lock()
				conns = append(conns, c.(*conn.Conn))
				mu.Unlock()
			}
			return c, err
		}, func() []*conn.Conn {
			mu.Lock()
			defer mu.Unlock()
			return slices.Clone(conns)
		}
}
