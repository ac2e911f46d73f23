package conn_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm" // a program names the providers it uses
)

// A gRPC server on an rdmagrpc listener and a client that dials it with
// conn.Dialer. The same address also serves plain gRPC clients over TCP.
// The shm provider (processes of one host) is chosen here so that the
// example runs anywhere; without WithProvider, verbs is used where
// transport/verbs is imported and an RDMA device is usable.
func ExampleListen() {
	ctx := context.Background()
	shm := conn.WithProvider("shm")

	lis, err := conn.Listen(ctx, "127.0.0.1:0", shm)
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer()
	testgrpc.RegisterTestServiceServer(srv, interop.NewTestServer())
	go srv.Serve(lis)
	defer srv.Stop()

	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
		grpc.WithContextDialer(conn.Dialer(shm)),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()

	resp, err := testgrpc.NewTestServiceClient(cc).UnaryCall(ctx,
		&testgrpc.SimpleRequest{ResponseSize: 100})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("response bytes:", len(resp.GetPayload().GetBody()))
	// Output: response bytes: 100
}

// The dialer a gRPC client passes to grpc.WithContextDialer. Options
// apply to every connection the client opens.
func ExampleDialer() {
	cc, err := grpc.NewClient("10.0.0.1:7000",
		grpc.WithContextDialer(conn.Dialer()),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	// use cc as with any other transport
}

// pair returns both ends of a raw connection over the shm provider, the
// dialed one first, with the negotiation settled.
func pair(ctx context.Context, opts ...conn.Option) (*conn.Conn, *conn.Conn, func()) {
	opts = append([]conn.Option{conn.WithProvider("shm")}, opts...)
	lis, err := conn.Listen(ctx, "127.0.0.1:0", opts...)
	if err != nil {
		log.Fatal(err)
	}
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := lis.Accept()
		if err != nil {
			log.Fatal(err)
		}
		accepted <- c
	}()
	nc, err := conn.Dial(ctx, lis.Addr().String(), opts...)
	if err != nil {
		log.Fatal(err)
	}
	c := nc.(*conn.Conn)
	// Dial returns once TCP is connected; Handshake waits for the
	// negotiation's outcome, as crypto/tls's does.
	if err := c.Handshake(ctx); err != nil {
		log.Fatal(err)
	}
	s := (<-accepted).(*conn.Conn)
	return c, s, func() { c.Close(); s.Close(); lis.Close() }
}

// Stats tells which provider a connection runs on and follows its
// buffers: every connection starts small, and its first write above the
// threshold enlarges that direction.
func ExampleConn_Stats() {
	ctx := context.Background()
	c, s, done := pair(ctx)
	defer done()

	st := c.Stats()
	fmt.Println("provider:", st.Provider)
	fmt.Println("before:", st.SendPhase, st.RegisteredBytes, "bytes registered")

	msg := make([]byte, 64<<10)
	go c.Write(msg)
	if _, err := io.ReadFull(s, make([]byte, len(msg))); err != nil {
		log.Fatal(err)
	}
	st = c.Stats()
	fmt.Println("after:", st.SendPhase, "slots of", st.LastEnlargeTo, "bytes,", st.Enlargements, "enlargement")
	// Output:
	// provider: shm
	// before: small 8192 bytes registered
	// after: large slots of 32768 bytes, 1 enlargement
}

// WithBufferPhases sets the whole ladder: the small phase every
// connection starts in, the large phase its first enlargement asks for,
// and deeper phases a direction climbs to when it keeps stalling on
// credits.
func ExampleWithBufferPhases() {
	ctx := context.Background()
	c, s, done := pair(ctx, conn.WithBufferPhases(
		conn.Phase{Size: 2 << 10, Count: 4},  // small: 8 KiB per ring
		conn.Phase{Size: 16 << 10, Count: 8}, // first large phase
		conn.Phase{Size: 64 << 10, Count: 16},
	))
	defer done()

	msg := make([]byte, 8<<10)
	go c.Write(msg)
	if _, err := io.ReadFull(s, make([]byte, len(msg))); err != nil {
		log.Fatal(err)
	}
	st := c.Stats()
	fmt.Println(st.SendPhase, "phase", st.SendPhaseIndex, "slots of", st.LastEnlargeTo, "bytes")
	// Output: large phase 1 slots of 16384 bytes
}

// StatsHandler puts the transport's events (enlargements, shrinks,
// rendezvous transfers, credit stalls) on the spans of the RPCs they held
// up. It goes after otelgrpc's handler, which starts those spans.
func ExampleStatsHandler() {
	srv := grpc.NewServer(
		grpc.StatsHandler(otelgrpc.NewServerHandler()),
		grpc.StatsHandler(conn.StatsHandler()))
	defer srv.Stop()

	cc, err := grpc.NewClient("10.0.0.1:7000",
		grpc.WithContextDialer(conn.Dialer()),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler()),
		grpc.WithStatsHandler(conn.StatsHandler()),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
}
