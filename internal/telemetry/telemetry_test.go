package telemetry

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// A connection made without telemetry has a nil *Conn: every hook must
// be a no-op on it, and on the nil *Enlargement it hands out.
func TestNilIsNoop(t *testing.T) {
	var s *Set
	c := s.StartConn(context.Background(), Client, 1, "shm", "test")
	if c != nil {
		t.Fatal("a nil Set made a Conn")
	}
	c.Connected(nil, nil, nil)
	c.Registered(4096, time.Microsecond, nil)
	c.CreditStall()
	c.RendezvousOut(1)
	c.RendezvousIn()
	c.ReadRequested(1, 1, 1, time.Now())
	c.ReadLanded(1)
	e := c.StartEnlargement(Sender, time.Now(), 1, 2, 3)
	e.Requested(1)
	e.Answered(true)
	e.Registration(time.Microsecond)
	e.End(Enlarged, Large, 0, nil)
	e.Abort(errors.New("x"))
	c.Fail(errors.New("x"))
	c.End()
}

// One Set per pair of providers: instruments and gauge callbacks are
// registered once however many connections are dialled.
func TestForCachesPerProviders(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	mp1 := sdkmetric.NewMeterProvider()
	mp2 := sdkmetric.NewMeterProvider()
	first := For(tp, mp1)
	if again := For(tp, mp1); first != again {
		t.Error("same providers, different Sets")
	}
	if first == For(tp, mp2) {
		t.Error("different meter providers share a Set")
	}
	global := For(nil, nil)
	if again := For(nil, nil); global != again {
		t.Error("the globals, different Sets")
	}
}

type addr string

func (a addr) Network() string { return "rdma" }
func (a addr) String() string  { return string(a) }

func TestConnectedAttributes(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	mp := sdkmetric.NewMeterProvider()
	for _, x := range []struct {
		remote net.Addr
		want   []attribute.KeyValue
	}{
		{addr("[fe80::1]:7000"), []attribute.KeyValue{semconv.NetworkPeerAddress("fe80::1"), semconv.NetworkPeerPort(7000), semconv.NetworkTypeIPv6}},
		{addr("10.0.0.1:7000"), []attribute.KeyValue{semconv.NetworkPeerAddress("10.0.0.1"), semconv.NetworkPeerPort(7000), semconv.NetworkTypeIPv4}},
		{addr("node-a:7000"), []attribute.KeyValue{semconv.NetworkPeerAddress("node-a"), semconv.NetworkPeerPort(7000)}},
		{addr("no port"), []attribute.KeyValue{semconv.NetworkPeerAddress("no port")}},
	} {
		c := For(tp, mp).StartConn(context.Background(), Server, 7, "verbs", "test")
		c.Connected(nil, x.remote, func() Snapshot { return Snapshot{} })
		c.End()
		spans := rec.Ended()
		got := map[attribute.Key]attribute.Value{}
		for _, a := range spans[len(spans)-1].Attributes() {
			got[a.Key] = a.Value
		}
		for _, w := range x.want {
			if got[w.Key] != w.Value {
				t.Errorf("%v: %s = %v, want %v", x.remote, w.Key, got[w.Key].String(), w.Value.String())
			}
		}
		if _, ok := got[semconv.NetworkTypeKey]; ok != (len(x.want) == 3) {
			t.Errorf("%v: network.type present %v", x.remote, ok)
		}
	}
}
