package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"google.golang.org/grpc"
)

// otelDemo installs the OpenTelemetry SDK as the otel globals, which is
// all rdmagrpc and otelgrpc need (both default to the globals): traces
// and metrics go to JSON files through the stdout exporters, which the
// demo reads back at the end.
type otelDemo struct {
	dir    string
	tp     *sdktrace.TracerProvider
	mp     *sdkmetric.MeterProvider
	traces *os.File
	mets   *os.File
}

func startOtel(dir string) (*otelDemo, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	d := &otelDemo{dir: dir}
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
	d.tp = sdktrace.NewTracerProvider(sdktrace.WithResource(res), sdktrace.WithBatcher(te))
	// Exports at snapshot (connections open) and at shutdown (closed)
	// only: a run takes seconds.
	d.mp = sdkmetric.NewMeterProvider(sdkmetric.WithResource(res), sdkmetric.WithReader(sdkmetric.NewPeriodicReader(me, sdkmetric.WithInterval(time.Hour))))
	otel.SetTracerProvider(d.tp)
	otel.SetMeterProvider(d.mp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	return d, nil
}

// serverOptions and dialOptions add otelgrpc's stats handlers and, after
// them, rdmagrpc's (which puts transport events on otelgrpc's RPC spans),
// or nothing when telemetry is off.
func (d *otelDemo) serverOptions() []grpc.ServerOption {
	if d == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler()), grpc.StatsHandler(conn.StatsHandler())}
}

func (d *otelDemo) dialOptions() []grpc.DialOption {
	if d == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler()), grpc.WithStatsHandler(conn.StatsHandler())}
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

// finish flushes both exporters, then reads the exported trace back and
// prints what it holds: the spans by name and the slowest RPC with the
// transport events on it. Call it once the gRPC client and server are
// closed, so the connection spans have ended.
func (d *otelDemo) finish() error {
	if d == nil {
		return nil
	}
	ctx := context.Background()
	if err := errors.Join(d.tp.Shutdown(ctx), d.mp.Shutdown(ctx), d.traces.Close(), d.mets.Close()); err != nil {
		return err
	}
	spans, err := readExported(d.traces.Name())
	if err != nil {
		return err
	}
	count := map[string]int{}
	for _, s := range spans {
		key := s.Name
		switch s.SpanKind {
		case kindClient:
			key += " (client)"
		case kindServer:
			key += " (server)"
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
	printSlowestRPC(spans)
	return nil
}
