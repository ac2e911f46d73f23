package conn_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

func attr(s sdktrace.ReadOnlySpan, k string) attribute.Value {
	for _, a := range s.Attributes() {
		if string(a.Key) == k {
			return a.Value
		}
	}
	return attribute.Value{}
}

// otelgrpc's stats handlers and rdmagrpc's spans in one provider, as the
// README shows them: a small RPC, then a 256 KiB one that enlarges both
// directions. The client's enlargement happens inside the big RPC's client
// span, and each enlargement span hangs off its connection's span.
func TestOtelgrpcBesideEnlargements(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	t.Cleanup(func() { tp.Shutdown(context.Background()); mp.Shutdown(context.Background()) })
	ot := []otelgrpc.Option{otelgrpc.WithTracerProvider(tp), otelgrpc.WithMeterProvider(mp), otelgrpc.WithPropagators(propagation.TraceContext{})}
	opts := []conn.Option{conn.WithTracerProvider(tp), conn.WithMeterProvider(mp)}

	l, err := conn.Listen(context.Background(), testAddr(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.StatsHandler(otelgrpc.NewServerHandler(ot...)))
	testgrpc.RegisterTestServiceServer(srv, interop.NewTestServer())
	go srv.Serve(l)
	cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(conn.Dialer(opts...)),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(ot...)))
	if err != nil {
		t.Fatal(err)
	}
	tc := testgrpc.NewTestServiceClient(cc)
	ctx := context.Background()
	for _, size := range []int{64, 256 << 10} {
		if _, err := tc.UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: int32(size), Payload: &testgrpc.Payload{Body: make([]byte, size)}}); err != nil {
			t.Fatal(err)
		}
	}
	cc.Close()
	srv.Stop()
	// Connection spans end when grpc closes the conns; the server's
	// after it reads the client's close.
	testutil.Eventually(t, 10*time.Second, "both connection spans to end", func() (bool, string) {
		n := 0
		for _, s := range rec.Ended() {
			if s.Name() == "rdmagrpc.connection" {
				n++
			}
		}
		return n == 2, fmt.Sprintf("%d connection spans ended, want 2", n)
	})

	byName := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		byName[s.Name()] = append(byName[s.Name()], s)
	}
	var names []string
	for n, s := range byName {
		names = append(names, n)
		t.Logf("%d × %s", len(s), n)
	}
	slices.Sort(names)
	want := []string{"grpc.testing.TestService/UnaryCall", "rdmagrpc.connection", "rdmagrpc.enlargement.receiver", "rdmagrpc.enlargement.sender"}
	if !slices.Equal(names, want) {
		t.Fatalf("span names %v, want %v", names, want)
	}
	rpc := byName["grpc.testing.TestService/UnaryCall"]
	var clientRPCs, serverRPCs []sdktrace.ReadOnlySpan
	for _, s := range rpc {
		switch s.SpanKind() {
		case trace.SpanKindClient:
			clientRPCs = append(clientRPCs, s)
		case trace.SpanKindServer:
			serverRPCs = append(serverRPCs, s)
		}
	}
	if len(clientRPCs) != 2 || len(serverRPCs) != 2 || len(byName["rdmagrpc.connection"]) != 2 ||
		len(byName["rdmagrpc.enlargement.sender"]) != 2 || len(byName["rdmagrpc.enlargement.receiver"]) != 2 {
		t.Fatalf("spans: %d client and %d server RPCs, %d connections, %d sender and %d receiver enlargements; want 2, 2, 2, 2, 2",
			len(clientRPCs), len(serverRPCs), len(byName["rdmagrpc.connection"]), len(byName["rdmagrpc.enlargement.sender"]), len(byName["rdmagrpc.enlargement.receiver"]))
	}
	// otelgrpc propagated its context across rdmagrpc: each server RPC
	// span is the child of a client one.
	for _, s := range serverRPCs {
		if !slices.ContainsFunc(clientRPCs, func(c sdktrace.ReadOnlySpan) bool { return c.SpanContext().SpanID() == s.Parent().SpanID() }) {
			t.Errorf("server RPC span %v has no client RPC parent", s.SpanContext().SpanID())
		}
	}
	conns := map[trace.SpanID]string{}
	for _, s := range byName["rdmagrpc.connection"] {
		conns[s.SpanContext().SpanID()] = attr(s, "rdmagrpc.connection.role").AsString()
	}
	// The 256 KiB request enlarged the client's direction, the response
	// the server's; each sender span is a child of its connection's span.
	roles := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range byName["rdmagrpc.enlargement.sender"] {
		role, ok := conns[s.Parent().SpanID()]
		if !ok || attr(s, "rdmagrpc.enlargement.outcome").AsString() != "enlarged" {
			t.Errorf("sender enlargement span: parent %v (a connection: %v), outcome %q", s.Parent().SpanID(), ok, attr(s, "rdmagrpc.enlargement.outcome").AsString())
		}
		roles[role] = s
	}
	for _, s := range byName["rdmagrpc.enlargement.receiver"] {
		if _, ok := conns[s.Parent().SpanID()]; !ok || attr(s, "rdmagrpc.enlargement.outcome").AsString() != "served" {
			t.Errorf("receiver enlargement span: parent %v, outcome %q", s.Parent().SpanID(), attr(s, "rdmagrpc.enlargement.outcome").AsString())
		}
	}
	if roles["client"] == nil || roles["server"] == nil {
		t.Fatalf("sender enlargements by role: %v, want one client and one server", roles)
	}
	big := clientRPCs[1]
	if clientRPCs[0].StartTime().After(big.StartTime()) {
		big = clientRPCs[0]
	}
	e := roles["client"]
	if e.StartTime().Before(big.StartTime()) || e.EndTime().After(big.EndTime()) {
		t.Errorf("client enlargement %v–%v is not inside the 256 KiB RPC's span %v–%v", e.StartTime(), e.EndTime(), big.StartTime(), big.EndTime())
	}
}
