package conn_test

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
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
	"google.golang.org/grpc/stats"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// rpcWorld is a gRPC server and client over rdmagrpc with otelgrpc's
// handlers followed by rdmagrpc's, all spans in one recorder.
type rpcWorld struct {
	rec  *tracetest.SpanRecorder
	addr string
	cli  []grpc.DialOption
}

func newRPCWorld(t *testing.T, sopts ...grpc.ServerOption) *rpcWorld {
	t.Helper()
	return newRPCWorldWith(t, nil, sopts...)
}

// newRPCWorldWith adds conn options on both sides.
func newRPCWorldWith(t *testing.T, copts []conn.Option, sopts ...grpc.ServerOption) *rpcWorld {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	t.Cleanup(func() { tp.Shutdown(context.Background()); mp.Shutdown(context.Background()) })
	ot := []otelgrpc.Option{otelgrpc.WithTracerProvider(tp), otelgrpc.WithMeterProvider(mp), otelgrpc.WithPropagators(propagation.TraceContext{})}
	opts := append([]conn.Option{conn.WithTracerProvider(tp), conn.WithMeterProvider(mp)}, copts...)
	l, err := conn.Listen(context.Background(), testAddr(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(append(sopts, grpc.StatsHandler(otelgrpc.NewServerHandler(ot...)), grpc.StatsHandler(conn.StatsHandler()))...)
	testgrpc.RegisterTestServiceServer(srv, interop.NewTestServer())
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	return &rpcWorld{rec: rec, addr: l.Addr().String(), cli: []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(conn.Dialer(opts...)),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(ot...)),
		grpc.WithStatsHandler(conn.StatsHandler()),
	}}
}

// client is a new channel: its first RPC makes a fresh connection.
func (w *rpcWorld) client(t *testing.T) testgrpc.TestServiceClient {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+w.addr, w.cli...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return testgrpc.NewTestServiceClient(cc)
}

func unary(ctx context.Context, tc testgrpc.TestServiceClient, size int) error {
	_, err := tc.UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: int32(size), Payload: &testgrpc.Payload{Body: make([]byte, size)}})
	return err
}

// spans are the ended spans of a kind and name, the RPCs' by their kind.
func (w *rpcWorld) spans(name string, kind trace.SpanKind) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range w.rec.Ended() {
		if s.Name() == name && (kind == trace.SpanKindUnspecified || s.SpanKind() == kind) {
			out = append(out, s)
		}
	}
	return out
}

func enlargementEvents(s sdktrace.ReadOnlySpan) []sdktrace.Event {
	var out []sdktrace.Event
	for _, e := range s.Events() {
		if strings.Contains(e.Name, "enlargement") {
			out = append(out, e)
		}
	}
	return out
}

func eventAttr(e sdktrace.Event, k string) (v string, ok bool) {
	for _, a := range e.Attributes {
		if string(a.Key) == k {
			return a.Value.String(), true
		}
	}
	return "", false
}

const unaryName = "grpc.testing.TestService/UnaryCall"

// A 256 KiB unary RPC on a fresh connection: its client span carries the
// client's enlargement (sender) with its duration and a link to the
// enlargement's span, which links back to it. 100 concurrent small RPCs
// after it carry none. (A server span ends when the handler's answer is
// queued, before grpc-go's writer has written it: the server's own
// enlargement, for the 256 KiB answer, ends after its RPC did, and so is
// on no server span, truly.)
func TestStatsHandlerEnlargementOnRPC(t *testing.T) {
	w := newRPCWorld(t)
	tc := w.client(t)
	ctx := t.Context()
	if err := unary(ctx, tc, 256<<10); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 100 {
		wg.Go(func() {
			if err := unary(ctx, tc, 64); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()

	// The server span ends after the client's has its answer: wait.
	var clients, servers []sdktrace.ReadOnlySpan
	testutil.Eventually(t, 10*time.Second, "101 client and 101 server RPC spans", func() (bool, string) {
		clients, servers = w.spans(unaryName, trace.SpanKindClient), w.spans(unaryName, trace.SpanKindServer)
		return len(clients) == 101 && len(servers) == 101, fmt.Sprintf("%d client and %d server RPC spans", len(clients), len(servers))
	})
	senders := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, s := range w.spans("rdmagrpc.enlargement.sender", trace.SpanKindUnspecified) {
		senders[s.SpanContext().SpanID()] = s
	}
	big := func(spans []sdktrace.ReadOnlySpan) sdktrace.ReadOnlySpan {
		first := spans[0]
		for _, s := range spans {
			if s.StartTime().Before(first.StartTime()) {
				first = s
			}
		}
		return first
	}
	for _, e := range enlargementEvents(big(servers)) {
		t.Logf("server span of the 256 KiB RPC: event %s %v", e.Name, e.Attributes)
	}
	for _, who := range []struct {
		role  string
		spans []sdktrace.ReadOnlySpan
	}{{"client", clients}} {
		b := big(who.spans)
		for _, k := range []string{"rdmagrpc.connection.id", "rdmagrpc.provider", "rdmagrpc.buffer.phase"} {
			if attr(b, k).Type() == attribute.EMPTY {
				t.Errorf("%s span of the 256 KiB RPC: no %s", who.role, k)
			}
		}
		if p := attr(b, "rdmagrpc.buffer.phase").AsString(); p != "small" {
			t.Errorf("%s span: phase %q at the start of the first RPC, want small", who.role, p)
		}
		var sender *sdktrace.Event
		for _, e := range enlargementEvents(b) {
			t.Logf("%s span of the 256 KiB RPC: event %s %v", who.role, e.Name, e.Attributes)
			if side, _ := eventAttr(e, "rdmagrpc.enlargement.side"); side == "sender" {
				sender = &e
			}
		}
		if sender == nil {
			t.Fatalf("%s span of the 256 KiB RPC: no sender enlargement event (events %v)", who.role, b.Events())
		}
		if d, ok := eventAttr(*sender, "rdmagrpc.enlargement.duration"); !ok || d == "0" {
			t.Errorf("%s: enlargement event without its duration", who.role)
		}
		if sender.Time.Before(b.StartTime()) || sender.Time.After(b.EndTime()) {
			t.Errorf("%s: enlargement event at %v, outside the RPC span %v–%v", who.role, sender.Time, b.StartTime(), b.EndTime())
		}
		var linked sdktrace.ReadOnlySpan
		for _, l := range b.Links() {
			if s, ok := senders[l.SpanContext.SpanID()]; ok {
				linked = s
			}
		}
		if linked == nil {
			t.Fatalf("%s span of the 256 KiB RPC: no link to an rdmagrpc.enlargement.sender span (links %v)", who.role, b.Links())
		}
		back := false
		for _, l := range linked.Links() {
			back = back || l.SpanContext.SpanID() == b.SpanContext().SpanID()
		}
		if !back {
			t.Errorf("%s: the enlargement span does not link to the RPC in flight when it started (links %v)", who.role, linked.Links())
		}
		for _, s := range who.spans {
			if s == b {
				continue
			}
			if ev := enlargementEvents(s); len(ev) > 0 {
				t.Errorf("%s span of a small RPC after the enlargement carries %v", who.role, ev)
			}
		}
	}
}

// Small RPCs running beside a large one on a fresh connection: an RPC
// carries an enlargement event only if that enlargement ended while it
// was in flight.
func TestStatsHandlerOnlyOverlapping(t *testing.T) {
	w := newRPCWorld(t)
	tc := w.client(t)
	ctx := t.Context()
	if err := unary(ctx, tc, 64); err != nil { // connected, still small
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Go(func() {
			size := 64
			if i == 50 {
				size = 256 << 10
			}
			if err := unary(ctx, tc, size); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	testutil.Eventually(t, 10*time.Second, "the server spans to end", func() (bool, string) {
		n := len(w.spans(unaryName, trace.SpanKindServer))
		return n == 101, fmt.Sprintf("%d of 101 server spans ended", n)
	})
	with := 0
	for _, s := range w.spans(unaryName, trace.SpanKindUnspecified) {
		for _, e := range enlargementEvents(s) {
			with++
			if e.Time.Before(s.StartTime()) || e.Time.After(s.EndTime()) {
				t.Errorf("%v span %v–%v carries an enlargement that ended at %v", s.SpanKind(), s.StartTime(), s.EndTime(), e.Time)
			}
		}
	}
	if with == 0 {
		t.Fatal("no RPC span carries the enlargement")
	}
	t.Logf("%d enlargement events on %d RPC spans", with, len(w.spans(unaryName, trace.SpanKindUnspecified)))
}

// A 2 MiB request and a 2 MiB response, each written at once (grpc-go's
// write buffers and windows made large enough), go by rendezvous: the
// client span carries the transfer it sent and the one it received, with
// bytes and time. (The server's received transfer is not on the server
// span, by the definition of "during": a request written at once, headers
// and all, lands whole before grpc-go reads its headers, which is when the
// server's RPC starts.)
func TestStatsHandlerRendezvousOnRPC(t *testing.T) {
	w := newRPCWorld(t, grpc.InitialWindowSize(8<<20), grpc.InitialConnWindowSize(8<<20), grpc.WriteBufferSize(4<<20))
	w.cli = append(w.cli, grpc.WithWriteBufferSize(4<<20), grpc.WithInitialWindowSize(8<<20), grpc.WithInitialConnWindowSize(8<<20))
	tc := w.client(t)
	if err := unary(t.Context(), tc, 2<<20); err != nil {
		t.Fatal(err)
	}
	var spans []sdktrace.ReadOnlySpan
	testutil.Eventually(t, 10*time.Second, "the client span to end", testutil.Bool(func() bool {
		spans = w.spans(unaryName, trace.SpanKindClient)
		return len(spans) > 0
	}))
	if len(spans) != 1 {
		t.Fatalf("%d client spans, want 1", len(spans))
	}
	bytes := map[string]int{}
	for _, e := range spans[0].Events() {
		t.Logf("client span: %s %v", e.Name, e.Attributes)
		if e.Name != "rdmagrpc.rendezvous.sent" && e.Name != "rdmagrpc.rendezvous.received" {
			continue
		}
		if d, ok := eventAttr(e, "rdmagrpc.rendezvous.duration"); !ok || d == "0" {
			t.Errorf("%s without its duration", e.Name)
		}
		b, _ := eventAttr(e, "rdmagrpc.rendezvous.bytes")
		n, _ := strconv.Atoi(b)
		bytes[e.Name] += n
	}
	for _, name := range []string{"rdmagrpc.rendezvous.sent", "rdmagrpc.rendezvous.received"} {
		if bytes[name] < 1<<20 {
			t.Errorf("client span: %d bytes in %s events, want the 2 MiB message's bulk", bytes[name], name)
		}
	}
}

// With no SDK (or a span that does not record), the handler allocates
// nothing per RPC.
func TestStatsHandlerNoSpanNoAllocs(t *testing.T) {
	h := conn.StatsHandler()
	ctx := context.Background()
	begin, out, end := &stats.Begin{Client: true}, &stats.OutHeader{Client: true}, &stats.End{Client: true}
	if n := testing.AllocsPerRun(1000, func() {
		c := h.TagRPC(ctx, &stats.RPCTagInfo{FullMethodName: unaryName})
		h.HandleRPC(c, begin)
		h.HandleRPC(c, out)
		h.HandleRPC(c, end)
	}); n != 0 {
		t.Fatalf("%v allocations per RPC with no recording span, want 0", n)
	}
}

// What the handler costs per RPC: with no recording span (no SDK), and
// with the SDK recording (a span started per RPC, as otelgrpc does; the
// handler's own part is the difference from "sdk, span only").
func BenchmarkStatsHandler(b *testing.B) {
	h := conn.StatsHandler()
	begin, out, end := &stats.Begin{Client: true}, &stats.OutHeader{Client: true}, &stats.End{Client: true}
	rpc := func(ctx context.Context) {
		c := h.TagRPC(ctx, &stats.RPCTagInfo{FullMethodName: unaryName})
		h.HandleRPC(c, begin)
		h.HandleRPC(c, out)
		h.HandleRPC(c, end)
	}
	b.Run("no-sdk", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			rpc(context.Background())
		}
	})
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
	b.Cleanup(func() { tp.Shutdown(context.Background()) })
	tr := tp.Tracer("bench")
	b.Run("sdk-span-only", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, s := tr.Start(context.Background(), unaryName)
			s.End()
		}
	})
	b.Run("sdk", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			ctx, s := tr.Start(context.Background(), unaryName)
			rpc(ctx)
			s.End()
		}
	})
}

// Through the small ring only (four 1 KiB slots), a 256 KiB request
// waits for credits many times: the client span carries one event with
// how many stalls and how long they took, before otelgrpc ends the span.
func TestStatsHandlerCreditStalls(t *testing.T) {
	w := newRPCWorldWith(t, []conn.Option{conn.WithThreshold(1 << 30), conn.WithRendezvousThreshold(-1)})
	tc := w.client(t)
	if err := unary(t.Context(), tc, 256<<10); err != nil {
		t.Fatal(err)
	}
	spans := w.spans(unaryName, trace.SpanKindClient)
	if len(spans) != 1 {
		t.Fatalf("%d client spans, want 1", len(spans))
	}
	for _, e := range spans[0].Events() {
		if e.Name != "rdmagrpc.credit.stalls" {
			continue
		}
		n, _ := eventAttr(e, "rdmagrpc.credit.stall.count")
		wait, _ := eventAttr(e, "rdmagrpc.credit.stall.wait")
		t.Logf("client span: %s stalls, %s s waited", n, wait)
		if n == "" || n == "0" || wait == "" || wait == "0" {
			t.Fatalf("stall event without its count or wait: %v", e.Attributes)
		}
		return
	}
	t.Fatalf("no credit stall event on the client span: %v", spans[0].Events())
}

// A stream left open and idle past WithIdleShrink: both directions shrink
// under it, and its span carries both shrinks, linked to their spans,
// which link back to it.
func TestStatsHandlerShrinkOnRPC(t *testing.T) {
	w := newRPCWorldWith(t, []conn.Option{conn.WithIdleShrink(50 * time.Millisecond)})
	tc := w.client(t)
	st, err := tc.FullDuplexCall(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&testgrpc.StreamingOutputCallRequest{
		ResponseParameters: []*testgrpc.ResponseParameters{{Size: 256 << 10}},
		Payload:            &testgrpc.Payload{Body: make([]byte, 256<<10)}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond) // idle: both directions shrink
	st.CloseSend()
	if _, err := st.Recv(); err != io.EOF {
		t.Fatalf("end of stream: %v", err)
	}
	const name = "grpc.testing.TestService/FullDuplexCall"
	var spans []sdktrace.ReadOnlySpan
	testutil.Eventually(t, 10*time.Second, "the client span to end", testutil.Bool(func() bool {
		spans = w.spans(name, trace.SpanKindClient)
		return len(spans) > 0
	}))
	if len(spans) != 1 {
		t.Fatalf("%d client spans", len(spans))
	}
	s := spans[0]
	shrinkSpans := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, x := range w.spans("rdmagrpc.shrink", trace.SpanKindUnspecified) {
		shrinkSpans[x.SpanContext().SpanID()] = x
	}
	sides := map[string]bool{}
	for _, e := range s.Events() {
		if e.Name != "rdmagrpc.shrink" {
			continue
		}
		side, _ := eventAttr(e, "rdmagrpc.enlargement.side")
		reason, _ := eventAttr(e, "rdmagrpc.shrink.reason")
		id, _ := eventAttr(e, "rdmagrpc.link.span_id")
		t.Logf("client span: shrink event, side %s, reason %s, span %s", side, reason, id)
		sides[side] = reason == "idle"
		found := false
		for sid, x := range shrinkSpans {
			if sid.String() == id {
				found = true
				back := false
				for _, l := range x.Links() {
					back = back || l.SpanContext.SpanID() == s.SpanContext().SpanID()
				}
				if !back {
					t.Errorf("shrink span %s does not link to the RPC in flight", id)
				}
			}
		}
		if !found {
			t.Errorf("shrink event's span %s not among the %d shrink spans", id, len(shrinkSpans))
		}
	}
	if !sides["sender"] || !sides["receiver"] {
		t.Fatalf("shrink events by side on the client span: %v, want sender and receiver, reason idle", sides)
	}
}
