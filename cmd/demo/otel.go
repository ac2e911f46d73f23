package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
)

// otelDemo installs the OpenTelemetry SDK as the otel globals, which is
// all rdmagrpc and otelgrpc need (both default to the globals): traces
// and metrics go to JSON files through the stdout exporters, and the
// spans are kept to print the enlargements beside the RPCs at the end.
type otelDemo struct {
	dir    string
	tp     *sdktrace.TracerProvider
	mp     *sdkmetric.MeterProvider
	spans  *tracetest.SpanRecorder
	traces *os.File
	mets   *os.File
}

func startOtel(dir string) (*otelDemo, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	d := &otelDemo{dir: dir, spans: tracetest.NewSpanRecorder()}
	var err error
	if d.traces, err = os.Create(filepath.Join(dir, "traces.json")); err != nil {
		return nil, err
	}
	if d.mets, err = os.Create(filepath.Join(dir, "metrics.json")); err != nil {
		d.traces.Close()
		return nil, err
	}
	te, err := stdouttrace.New(stdouttrace.WithWriter(d.traces), stdouttrace.WithPrettyPrint())
	if err != nil {
		return nil, err
	}
	me, err := stdoutmetric.New(stdoutmetric.WithWriter(d.mets), stdoutmetric.WithPrettyPrint())
	if err != nil {
		return nil, err
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(semconv.ServiceName("rdmagrpc-demo")))
	if err != nil {
		return nil, err
	}
	d.tp = sdktrace.NewTracerProvider(sdktrace.WithResource(res), sdktrace.WithBatcher(te), sdktrace.WithSpanProcessor(d.spans))
	// Exports at snapshot (connections open) and at shutdown (closed)
	// only: a run takes seconds.
	d.mp = sdkmetric.NewMeterProvider(sdkmetric.WithResource(res), sdkmetric.WithReader(sdkmetric.NewPeriodicReader(me, sdkmetric.WithInterval(time.Hour))))
	otel.SetTracerProvider(d.tp)
	otel.SetMeterProvider(d.mp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	return d, nil
}

// serverOptions and dialOptions add otelgrpc's stats handlers, or nothing
// when telemetry is off.
func (d *otelDemo) serverOptions() []grpc.ServerOption {
	if d == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler())}
}

func (d *otelDemo) dialOptions() []grpc.DialOption {
	if d == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler())}
}

// snapshot exports the metrics now, while the connections are open (the
// gauges of open connections and registered memory by phase).
func (d *otelDemo) snapshot() {
	if d == nil {
		return
	}
	if err := d.mp.ForceFlush(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "metrics:", err)
	}
}

// finish flushes both exporters and prints the enlargement spans beside
// the RPC spans that were in flight when they started. Call it once the
// gRPC client and server are closed, so the connection spans have ended.
func (d *otelDemo) finish() error {
	if d == nil {
		return nil
	}
	ctx := context.Background()
	err := errors.Join(d.tp.Shutdown(ctx), d.mp.Shutdown(ctx), d.traces.Close(), d.mets.Close())

	spans := d.spans.Ended()
	count := map[string]int{}
	var rpcs, enl []sdktrace.ReadOnlySpan
	clientConns := map[trace.SpanID]bool{}
	for _, s := range spans {
		key := s.Name()
		switch {
		case s.Name() == "rdmagrpc.connection":
			clientConns[s.SpanContext().SpanID()] = attrOf(s, "rdmagrpc.connection.role").AsString() == "client"
		case s.SpanKind() == trace.SpanKindClient || s.SpanKind() == trace.SpanKindServer:
			key += " (" + s.SpanKind().String() + ")"
			rpcs = append(rpcs, s)
		case s.Name() == "rdmagrpc.enlargement.sender" || s.Name() == "rdmagrpc.enlargement.receiver":
			enl = append(enl, s)
		}
		count[key]++
	}
	fmt.Printf("\nOpenTelemetry: %d spans in %s, metrics in %s\n", len(spans), d.traces.Name(), d.mets.Name())
	var keys []string
	for k := range count {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Printf("  %5d × %s\n", count[k], k)
	}
	fmt.Println("  enlargements, beside the RPC span in flight on the same side:")
	for _, e := range enl {
		get := func(k string) attribute.Value { return attrOf(e, k) }
		fmt.Printf("    %-30s conn %d  %d → %d×%d bytes  %-8s %9v  trace %s",
			e.Name(), get("rdmagrpc.connection.id").AsInt64(), get("rdmagrpc.enlargement.from_size").AsInt64(),
			get("rdmagrpc.enlargement.to_count").AsInt64(), get("rdmagrpc.enlargement.to_size").AsInt64(),
			get("rdmagrpc.enlargement.outcome").AsString(), e.EndTime().Sub(e.StartTime()).Round(time.Microsecond), e.SpanContext().TraceID())
		if r := during(e, clientConns[e.Parent().SpanID()], rpcs); r != nil {
			fmt.Printf("\n    %-30s during %s (%s) span %s, trace %s", "", r.Name(), r.SpanKind(), r.SpanContext().SpanID(), r.SpanContext().TraceID())
		}
		fmt.Println()
	}
	return err
}

// during returns the RPC span of the same side (client or server) in
// flight when e started. RPC spans and enlargement spans are in different
// traces (a transport write does not know which RPC filled it), so time
// is what relates them.
func during(e sdktrace.ReadOnlySpan, client bool, rpcs []sdktrace.ReadOnlySpan) sdktrace.ReadOnlySpan {
	kind := trace.SpanKindServer
	if client {
		kind = trace.SpanKindClient
	}
	var best sdktrace.ReadOnlySpan
	for _, r := range rpcs {
		if r.SpanKind() == kind && !r.StartTime().After(e.StartTime()) && !r.EndTime().Before(e.StartTime()) &&
			(best == nil || r.StartTime().After(best.StartTime())) {
			best = r
		}
	}
	return best
}

func attrOf(s sdktrace.ReadOnlySpan, k string) attribute.Value {
	for _, a := range s.Attributes() {
		if string(a.Key) == k {
			return a.Value
		}
	}
	return attribute.Value{}
}
