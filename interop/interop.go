// Package interop runs grpc-go's interoperability TestService over
// rdmagrpc: the server half on a conn.Listener, the client half through
// conn.Dialer, in plaintext or with TLS, with grpc-go's own test case code
// (google.golang.org/grpc/interop). The commands interop/server and
// interop/client wrap it with grpc-go's interop flag names.
package interop

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// Case is one interop test case, named as in grpc's interop spec.
type Case struct {
	Name string
	run  func(ctx context.Context, cc *grpc.ClientConn, tc testgrpc.TestServiceClient)
}

// Cases are every case of the spec that applies to one server without a
// cloud identity, in plaintext or over TLS. Left out: the credential cases
// (compute_engine_creds, jwt_token_creds, oauth2_auth_token,
// per_rpc_creds, google_default_credentials, ...), which need a cloud
// identity;
// the ORCA cases, which need a load-reporting server; and the xDS and
// load-balancing cases (pick_first_unary among them: it checks the id of
// one of several backends), which need several backends.
var Cases = []Case{
	{"empty_unary", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoEmptyUnaryCall(ctx, tc)
	}},
	{"large_unary", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoLargeUnaryCall(ctx, tc)
	}},
	{"client_streaming", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoClientStreaming(ctx, tc)
	}},
	{"server_streaming", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoServerStreaming(ctx, tc)
	}},
	{"ping_pong", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoPingPong(ctx, tc)
	}},
	{"empty_stream", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoEmptyStream(ctx, tc)
	}},
	{"timeout_on_sleeping_server", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoTimeoutOnSleepingServer(ctx, tc)
	}},
	{"cancel_after_begin", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		if err := CancelAfterBegin(ctx, tc); err != nil {
			panic(err) // grpc-go's cases end the process on a failure; so does this one
		}
	}},
	{"cancel_after_first_response", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoCancelAfterFirstResponse(ctx, tc)
	}},
	{"status_code_and_message", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoStatusCodeAndMessage(ctx, tc)
	}},
	{"special_status_message", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoSpecialStatusMessage(ctx, tc)
	}},
	{"unimplemented_method", func(ctx context.Context, cc *grpc.ClientConn, _ testgrpc.TestServiceClient) {
		interop.DoUnimplementedMethod(ctx, cc)
	}},
	{"unimplemented_service", func(ctx context.Context, cc *grpc.ClientConn, _ testgrpc.TestServiceClient) {
		interop.DoUnimplementedService(ctx, testgrpc.NewUnimplementedServiceClient(cc))
	}},
	{"custom_metadata", func(ctx context.Context, _ *grpc.ClientConn, tc testgrpc.TestServiceClient) {
		interop.DoCustomMetadata(ctx, tc)
	}},
}

// CancelAfterBegin is the spec's cancel_after_begin: a client-streaming
// call canceled once begun ends with Canceled. grpc-go's own code for it
// (interop.DoCancelAfterBegin) cancels, then closes the sending side and
// reads the answer; grpc-go ends a canceled stream in a goroutine of its
// own and, until it has, hands out an answer already received before the
// context's error. Over a transport as fast as shm the server's answer to
// the close can arrive first: the case ended with OK once in CI, on a
// loaded 2-core VM. Here the client reads before it
// closes: the server answers nothing before the close, so the read can
// only end with the cancel, and the close and read after it must say the
// same.
func CancelAfterBegin(ctx context.Context, tc testgrpc.TestServiceClient) error {
	ctx, cancel := context.WithCancel(ctx)
	stream, err := tc.StreamingInputCall(ctx)
	if err != nil {
		cancel()
		return fmt.Errorf("cancel_after_begin: StreamingInputCall: %w", err)
	}
	cancel()
	if err := stream.RecvMsg(new(testgrpc.StreamingInputCallResponse)); status.Code(err) != codes.Canceled {
		return fmt.Errorf("cancel_after_begin: a read after the cancel: %v, want code Canceled", err)
	}
	if _, err := stream.CloseAndRecv(); status.Code(err) != codes.Canceled {
		return fmt.Errorf("cancel_after_begin: CloseAndRecv: %v, want code Canceled", err)
	}
	return nil
}

// Select returns the cases named in list (comma-separated, or "all").
func Select(list string) ([]Case, error) {
	if list == "all" {
		return Cases, nil
	}
	var out []Case
	for name := range strings.SplitSeq(list, ",") {
		i := slices.IndexFunc(Cases, func(c Case) bool { return c.Name == name })
		if i < 0 {
			return nil, fmt.Errorf("interop: unknown test case %q", name)
		}
		out = append(out, Cases[i])
	}
	return out, nil
}

// NewServer is grpc-go's interop TestService.
func NewServer(opts ...grpc.ServerOption) *grpc.Server {
	s := grpc.NewServer(opts...)
	testgrpc.RegisterTestServiceServer(s, interop.NewTestServer())
	return s
}

// Listen listens for the interop server on addr over rdmagrpc.
func Listen(ctx context.Context, addr string, opts ...conn.Option) (net.Listener, error) {
	return conn.Listen(ctx, addr, opts...)
}

// Recorder is a listener that remembers the rdmagrpc connections it
// accepted, so that a server can say what they ran on.
type Recorder struct {
	net.Listener
	mu    sync.Mutex
	conns []*conn.Conn
}

// Record wraps l.
func Record(l net.Listener) *Recorder { return &Recorder{Listener: l} }

// Accept is l's, remembering an rdmagrpc connection.
func (r *Recorder) Accept() (net.Conn, error) {
	nc, err := r.Listener.Accept()
	if c, ok := nc.(*conn.Conn); ok {
		r.mu.Lock()
		r.conns = append(r.conns, c)
		r.mu.Unlock()
	}
	return nc, err
}

// Report writes "SERVED p (reason)" for each accepted connection, p as
// Stats reports it.
func (r *Recorder) Report(out io.Writer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		s := c.Stats()
		fmt.Fprintf(out, "SERVED %s (%s)\n", s.Provider, s.ProviderReason)
	}
}

// Run dials addr over rdmagrpc with creds (nil: plaintext) and runs cases
// in order, writing "PASS name" after each, then "PROVIDER p" for each
// connection the client made (p as Stats reports it: tcp when it fell
// back). grpc-go's case code ends the process on a failure, as its own
// interop client does; the last line written names the case.
func Run(ctx context.Context, addr string, cases []Case, out io.Writer, creds credentials.TransportCredentials, opts ...conn.Option) error {
	var mu sync.Mutex
	var conns []*conn.Conn
	dial := conn.Dialer(opts...)
	err := run(ctx, addr, cases, out, creds, grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
		nc, err := dial(ctx, a)
		if c, ok := nc.(*conn.Conn); ok {
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
		return nc, err
	}))
	mu.Lock()
	defer mu.Unlock()
	for _, c := range conns {
		s := c.Stats()
		fmt.Fprintf(out, "PROVIDER %s (%s)\n", s.Provider, s.ProviderReason)
	}
	return err
}

// RunTCP is Run with grpc-go's own TCP dialer: a client that has not
// adopted rdmagrpc.
func RunTCP(ctx context.Context, addr string, cases []Case, out io.Writer, creds credentials.TransportCredentials) error {
	return run(ctx, addr, cases, out, creds)
}

func run(ctx context.Context, addr string, cases []Case, out io.Writer, creds credentials.TransportCredentials, opts ...grpc.DialOption) error {
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	cc, err := grpc.NewClient("passthrough:///"+addr, append(opts, grpc.WithTransportCredentials(creds))...)
	if err != nil {
		return fmt.Errorf("interop: client for %s: %w", addr, err)
	}
	defer cc.Close()
	tc := testgrpc.NewTestServiceClient(cc)
	for _, c := range cases {
		fmt.Fprintf(out, "RUN %s\n", c.Name)
		start := time.Now()
		cctx, cancel := context.WithTimeout(ctx, time.Minute)
		c.run(cctx, cc, tc)
		cancel()
		fmt.Fprintf(out, "PASS %s (%v)\n", c.Name, time.Since(start).Round(time.Millisecond))
	}
	return nil
}
