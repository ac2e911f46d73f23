package conn

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	channelzgrpc "google.golang.org/grpc/channelz/grpc_channelz_v1"
	channelzsvc "google.golang.org/grpc/channelz/service"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/credentials/local"
	"google.golang.org/grpc/health"
	healthgrpc "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
)

// seen is what a server interceptor saw of one RPC's connection.
type seen struct {
	addr, local net.Addr
	stats       Stats
	ok          bool
}

// introspectServer serves health and channelz on l, recording what each
// health RPC's handler context says of its connection.
func introspectServer(t *testing.T, l net.Listener, opts ...grpc.ServerOption) chan seen {
	got := make(chan seen, 64)
	opts = append(opts, grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if info.FullMethod != healthgrpc.Health_Check_FullMethodName {
			return h(ctx, req)
		}
		var s seen
		if p, ok := peer.FromContext(ctx); ok {
			s.addr, s.local = p.Addr, p.LocalAddr
		}
		s.stats, s.ok = StatsFromContext(ctx)
		select {
		case got <- s:
		default:
		}
		return h(ctx, req)
	}))
	srv := grpc.NewServer(opts...)
	healthgrpc.RegisterHealthServer(srv, health.NewServer())
	channelzsvc.RegisterChannelzServiceToServer(srv)
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	return got
}

// peerCheck makes one health RPC and returns the client, closed when the
// test ends, and the RPC's peer.
func peerCheck(t *testing.T, addr string, creds credentials.TransportCredentials, dialer func(context.Context, string) (net.Conn, error)) (*grpc.ClientConn, *peer.Peer) {
	t.Helper()
	cc, p := healthRPC(t, addr, creds, dialer)
	t.Cleanup(func() { cc.Close() })
	return cc, p
}

// A gRPC handler and a client read what their connection runs on: the
// addresses are TCP ones with the real IPs (the server's port as the
// client dialed it), channelz shows them, and StatsFromContext and
// StatsFromPeer give the connection's Stats, provider included, with TLS
// too; a connection that is not rdmagrpc's has none.
func TestIntrospection(t *testing.T) {
	sCreds, cCreds := testTLS(t)
	for _, tc := range []struct {
		name   string
		server credentials.TransportCredentials
		client credentials.TransportCredentials
		addr   string
		opts   []Option
	}{
		{"plaintext", insecure.NewCredentials(), insecure.NewCredentials(), testAddr(), nil},
		{"tls", sCreds, cCreds, testAddr(), nil},
		// grpc-go's local credentials admit loopback TCP addresses only:
		// shm, also where verbs is the default (the rxe guest).
		{"local", local.NewCredentials(), local.NewCredentials(), "127.0.0.1:0", []Option{WithProvider("shm")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := Listen(context.Background(), tc.addr, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			got := introspectServer(t, l, grpc.Creds(tc.server))
			want := l.Addr().String()
			// First contact (negotiated on the dial's TCP connection),
			// then a dial to a server known to offer RDMA.
			for i, contact := range []string{"first contact", "known server"} {
				cc, p := peerCheck(t, want, tc.client, Dialer(tc.opts...))
				a, ok := p.Addr.(*net.TCPAddr)
				if !ok || a.String() != want {
					t.Errorf("%s: client's peer.Addr %T %v, want the *net.TCPAddr %s", contact, p.Addr, p.Addr, want)
				}
				cs, ok := StatsFromPeer(p)
				if !ok || cs.Provider == "tcp" || cs.Provider == ProviderNegotiating {
					t.Errorf("%s: StatsFromPeer %v %q, want the RDMA connection's", contact, ok, cs.Provider)
				}
				s := <-got
				ra, rok := s.addr.(*net.TCPAddr)
				la, lok := s.local.(*net.TCPAddr)
				if !rok || !lok || !ra.IP.Equal(la.IP) || ra.Port == 0 || la.String() != want {
					t.Errorf("%s: server's peer %T %v, local %T %v: want *net.TCPAddr values, the local one %s", contact, s.addr, s.addr, s.local, s.local, want)
				}
				if !s.ok || s.stats.Provider != cs.Provider {
					t.Errorf("%s: StatsFromContext %v %q, want the client's provider %q", contact, s.ok, s.stats.Provider, cs.Provider)
				}
				if i == 1 {
					checkChannelz(t, cc)
				}
			}
			// A plain grpc-go client reaches the same listener over TCP.
			_, p := peerCheck(t, want, tc.client, nil)
			if _, ok := StatsFromPeer(p); ok {
				t.Errorf("StatsFromPeer found an rdmagrpc connection under grpc-go's own dialer")
			}
			s := <-got
			if !s.ok || s.stats.Provider != "tcp" {
				t.Errorf("a plain client's RPC: StatsFromContext %v %q, want tcp", s.ok, s.stats.Provider)
			}
		})
	}
}

// checkChannelz asks the server's channelz for its sockets: each has a
// TCP/IP local and remote address.
func checkChannelz(t *testing.T, cc *grpc.ClientConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cz := channelzgrpc.NewChannelzClient(cc)
	servers, err := cz.GetServers(ctx, &channelzgrpc.GetServersRequest{})
	if err != nil {
		t.Fatalf("channelz: %v", err)
	}
	n := 0
	var once sync.Once
	for _, sv := range servers.Server {
		socks, err := cz.GetServerSockets(ctx, &channelzgrpc.GetServerSocketsRequest{ServerId: sv.Ref.ServerId})
		if err != nil {
			t.Fatalf("channelz: %v", err)
		}
		for _, r := range socks.SocketRef {
			sk, err := cz.GetSocket(ctx, &channelzgrpc.GetSocketRequest{SocketId: r.SocketId})
			if err != nil {
				continue // closed since
			}
			n++
			if sk.Socket.GetLocal().GetTcpipAddress() == nil || sk.Socket.GetRemote().GetTcpipAddress() == nil {
				once.Do(func() {
					t.Errorf("channelz socket %d: local %v, remote %v: want TCP/IP addresses", r.SocketId, sk.Socket.GetLocal(), sk.Socket.GetRemote())
				})
			}
		}
	}
	if n == 0 {
		t.Errorf("channelz listed no server socket")
	}
}
