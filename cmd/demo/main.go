// Command demo runs a gRPC server and client over rdmagrpc in one
// process, with traffic that crosses the enlargement threshold, and shows
// what happened to each connection: RPC latencies, the enlargement with
// its sizes and duration, and the registered memory before and after.
// It also exports OpenTelemetry traces and metrics (otelgrpc's RPC spans
// and rdmagrpc's connection and enlargement spans) to JSON files, and
// prints the enlargement spans beside the RPC spans in flight.
//
//	go run ./cmd/demo            # verbs where a device exists, else shm
//	RDMAGRPC_PROVIDER=shm go run ./cmd/demo
//	go run ./cmd/demo -otel ''   # no OpenTelemetry
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

// recorder keeps the *conn.Conn values gRPC gets, to print their Stats.
type recorder struct {
	mu    sync.Mutex
	conns []*conn.Conn
}

func (r *recorder) add(c net.Conn) net.Conn {
	r.mu.Lock()
	r.conns = append(r.conns, c.(*conn.Conn))
	r.mu.Unlock()
	return c
}

type recordingListener struct {
	net.Listener
	r *recorder
}

func (l recordingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return l.r.add(c), nil
}

func main() {
	otelDir := flag.String("otel", filepath.Join(os.TempDir(), "rdmagrpc-demo"), "write OpenTelemetry traces.json and metrics.json here; empty: off")
	flag.Parse()
	log.SetFlags(0)
	ctx := context.Background()
	var od *otelDemo
	if *otelDir != "" {
		var err error
		if od, err = startOtel(*otelDir); err != nil {
			log.Fatal(err)
		}
	}
	view, why := startEBPF()
	addr := "127.0.0.1:0"
	if a := os.Getenv("RDMAGRPC_DEMO_ADDR"); a != "" {
		addr = a
	}
	var server, client recorder
	l, err := conn.Listen(ctx, addr)
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(od.serverOptions()...)
	testgrpc.RegisterTestServiceServer(srv, interop.NewTestServer())
	go srv.Serve(recordingListener{l, &server})

	dial := conn.Dialer()
	cc, err := grpc.NewClient("passthrough:///"+l.Addr().String(), append(od.dialOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
			c, err := dial(ctx, a)
			if err != nil {
				return nil, err
			}
			return client.add(c), nil
		}))...)
	if err != nil {
		log.Fatal(err)
	}
	tc := testgrpc.NewTestServiceClient(cc)

	fmt.Printf("rdmagrpc demo: gRPC TestService over rdmagrpc at %v\n\n", l.Addr())
	run := func(name string, n, size int) {
		var lat []time.Duration
		for range n {
			t := time.Now()
			_, err := tc.UnaryCall(ctx, &testgrpc.SimpleRequest{ResponseSize: int32(size), Payload: &testgrpc.Payload{Body: make([]byte, size)}})
			if err != nil {
				log.Fatalf("%s: %v", name, err)
			}
			lat = append(lat, time.Since(t))
		}
		slices.Sort(lat)
		fmt.Printf("%-28s %4d RPCs  p50 %9v  p99 %9v\n", name, n, lat[len(lat)/2].Round(time.Microsecond), lat[len(lat)*99/100].Round(time.Microsecond))
	}
	run("unary 64 B (small phase)", 200, 64)
	show("after small RPCs", &client, &server)
	run("unary 256 KiB (crosses)", 20, 256<<10)
	run("unary 64 B (after)", 200, 64)
	show("after large RPCs", &client, &server)
	od.snapshot() // the gauges while the connections are open
	if view != nil {
		view.report()
	} else {
		fmt.Printf("\neBPF view: skipped: %s\n", why)
	}
	// Closed before the exporters flush, so the connection spans are in.
	cc.Close()
	srv.Stop()
	if err := od.finish(); err != nil {
		log.Fatal(err)
	}
}

func show(when string, client, server *recorder) {
	fmt.Printf("\nconnections %s:\n", when)
	for _, side := range []struct {
		name string
		r    *recorder
	}{{"client", client}, {"server", server}} {
		side.r.mu.Lock()
		for _, c := range side.r.conns {
			s := c.Stats()
			fmt.Printf("  %s %s (pid %d)  %v→%v  provider %s\n", side.name, conn.ConnName(c.ID()), os.Getpid(), c.LocalAddr(), c.RemoteAddr(), s.Provider)
			fmt.Printf("    registered %7d bytes   send phase %-6s recv phase %-6s  bytes out %9d in %9d  credit stalls %d\n",
				s.RegisteredBytes, s.SendPhase, s.RecvPhase, s.BytesOut, s.BytesIn, s.CreditStalls)
			if s.Enlargements+s.EnlargeFailures > 0 {
				fmt.Printf("    enlargement: %s, slots %d → %d bytes, took %v\n", s.LastEnlargeOutcome, s.LastEnlargeFrom, s.LastEnlargeTo, s.LastEnlargeDuration.Round(time.Microsecond))
			}
			if s.EnlargementsServed > 0 {
				fmt.Printf("    served the peer's enlargement: %d large receive buffers provisioned\n", s.EnlargementsServed)
			}
		}
		side.r.mu.Unlock()
	}
}
