package bench

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// What conn.StatsHandler costs a client with the OpenTelemetry SDK
// recording every RPC span: 64 B unary calls, one at a time,
// against the server in the child process, with otelgrpc's handler alone
// and with rdmagrpc's after it. The spans go to a processor that drops
// them, so what is measured is the making of them.
func rowOtelP50(with bool) string { return row2("otel unary 64 B p50" + handlerSuffix(with)) }
func rowOtelCPU(with bool) string { return row2("otel client CPU/RPC" + handlerSuffix(with)) }
func handlerSuffix(with bool) string {
	if with {
		return ", + conn.StatsHandler"
	}
	return ", otelgrpc only"
}

// dropSpans is a span processor that keeps nothing.
type dropSpans struct{}

func (dropSpans) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (dropSpans) OnEnd(sdktrace.ReadOnlySpan)                     {}
func (dropSpans) Shutdown(context.Context) error                  { return nil }
func (dropSpans) ForceFlush(context.Context) error                { return nil }

func (rep *Report) statsHandlerCost(ctx context.Context, t network, addr string) error {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(dropSpans{}))
	defer tp.Shutdown(context.Background())
	for _, with := range []bool{false, true} {
		opts := []grpc.DialOption{
			grpc.WithContextDialer(t.dial),
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(tp))),
		}
		if with {
			opts = append(opts, grpc.WithStatsHandler(conn.StatsHandler()))
		}
		cc, err := grpc.NewClient("passthrough:///"+addr, opts...)
		if err != nil {
			return fmt.Errorf("%s: client: %w", t.name, err)
		}
		r := &rig{t: t, cc: cc, tc: testgrpc.NewBenchmarkServiceClient(cc)}
		p50, cpu, err := r.otelCosts(ctx, rep.Config.BenchTime)
		cc.Close()
		if err != nil {
			return err
		}
		rep.add(rowOtelP50(with), t.name, p50.Seconds())
		rep.add(rowOtelCPU(with), t.name, cpu.Seconds())
	}
	return nil
}

func (r *rig) otelCosts(ctx context.Context, d time.Duration) (p50, cpu time.Duration, err error) {
	if err := r.unary(ctx, 64); err != nil { // connect
		return 0, 0, err
	}
	if p50, _, err = r.latency(ctx, 64, d); err != nil {
		return 0, 0, err
	}
	_, cpu, err = r.qps(ctx, 1, 64, d)
	return p50, cpu, err
}
