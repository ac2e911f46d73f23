package bench

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/conn"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"   // processes of this host
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs" // verbs where a device exists, else shm
)

// Transport names, in table order. TCP is the reference of every ratio.
const (
	TCP  = "tcp"
	Unix = "unix"
	RDMA = "rdmagrpc"
)

// network is a way to listen and dial; the same grpc-go server and
// client run over each.
type network struct {
	name   string
	listen func(ctx context.Context) (net.Listener, error)
	dial   func(ctx context.Context, addr string) (net.Conn, error)
}

var unixSeq atomic.Uint64

// transports returns TCP loopback, a unix socket in dir, and rdmagrpc
// with opts (the provider is conn's own choice unless opts name one).
func transports(dir string, opts ...conn.Option) []network {
	var d net.Dialer
	return []network{
		{
			name: TCP,
			listen: func(ctx context.Context) (net.Listener, error) {
				// A remote child's host (remote.go), else loopback.
				return (&net.ListenConfig{}).Listen(ctx, "tcp", net.JoinHostPort(envHost(tcpHostEnv), "0"))
			},
			dial: func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) },
		},
		{
			name: Unix,
			listen: func(ctx context.Context) (net.Listener, error) {
				p := filepath.Join(dir, fmt.Sprintf("b%d.sock", unixSeq.Add(1)))
				os.Remove(p)
				return (&net.ListenConfig{}).Listen(ctx, "unix", p)
			},
			dial: func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "unix", addr) },
		},
		rdma(opts...),
	}
}

// HostEnv names the address rdmagrpc listens on (default 127.0.0.1): an
// RDMA device's own address where there is one (rdma_cm does not bind
// loopback to it). An environment variable, so that the idle server child
// inherits it.
const HostEnv = "RDMAGRPC_BENCH_HOST"

// envHost is the address the environment variable name holds, or
// 127.0.0.1.
func envHost(name string) string {
	if h := os.Getenv(name); h != "" {
		return h
	}
	return "127.0.0.1"
}

func rdma(opts ...conn.Option) network {
	host := envHost(HostEnv)
	return network{
		name: RDMA,
		listen: func(ctx context.Context) (net.Listener, error) {
			return conn.Listen(ctx, net.JoinHostPort(host, "0"), opts...)
		},
		dial: conn.Dialer(opts...),
	}
}

// pipe returns both ends of one connection of t.
func pipe(ctx context.Context, t network) (client, server net.Conn, err error) {
	l, err := t.listen(ctx)
	if err != nil {
		return nil, nil, err
	}
	defer l.Close()
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() { c, err := l.Accept(); ch <- res{c, err} }()
	client, err = t.dial(ctx, l.Addr().String())
	if err != nil {
		l.Close()
		<-ch
		return nil, nil, err
	}
	r := <-ch
	if r.err != nil {
		client.Close()
		return nil, nil, r.err
	}
	return client, r.c, nil
}
