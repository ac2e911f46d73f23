package conn

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthgrpc "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"

	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// otherFamily is a provider that is not shm on the wire (it does not say
// it wraps it): a listener on shm must not offer it RDMA.
type otherFamily struct{ transport.Provider }

func (otherFamily) Name() string { return "conn-test-other-family" }

func init() {
	p, err := transport.Get("shm")
	if err != nil {
		panic(err)
	}
	transport.Register(otherFamily{p})
}

// capture records what a listener accepts.
type capture struct {
	net.Listener
	got chan net.Conn
}

func (c capture) Accept() (net.Conn, error) {
	nc, err := c.Listener.Accept()
	if err == nil {
		c.got <- nc
	}
	return nc, err
}

// serveHealth serves grpc-go's health service on l.
func serveHealth(t *testing.T, l net.Listener) {
	s := grpc.NewServer()
	healthgrpc.RegisterHealthServer(s, health.NewServer())
	go s.Serve(l)
	t.Cleanup(s.Stop)
}

// check makes one health RPC to addr; dialer nil is grpc-go's own TCP.
func check(t *testing.T, addr string, dialer func(context.Context, string) (net.Conn, error)) {
	t.Helper()
	checkCreds(t, addr, insecure.NewCredentials(), dialer)
}

// checkCreds makes one health RPC to addr with creds, within 10 s.
func checkCreds(t *testing.T, addr string, creds credentials.TransportCredentials, dialer func(context.Context, string) (net.Conn, error)) {
	t.Helper()
	cc, _ := healthRPC(t, addr, creds, dialer)
	cc.Close()
}

// healthRPC makes one health RPC to addr with creds, within 10 s, on a
// new client the caller closes, and returns it with the RPC's peer.
func healthRPC(t *testing.T, addr string, creds credentials.TransportCredentials, dialer func(context.Context, string) (net.Conn, error)) (*grpc.ClientConn, *peer.Peer) {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if dialer != nil {
		opts = append(opts, grpc.WithContextDialer(dialer))
	}
	cc, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var p peer.Peer
	r, err := healthgrpc.NewHealthClient(cc).Check(ctx, &healthgrpc.HealthCheckRequest{}, grpc.Peer(&p))
	if err != nil || r.Status != healthgrpc.HealthCheckResponse_SERVING {
		cc.Close()
		t.Fatalf("health check over %s (%s): %v %v", addr, creds.Info().SecurityProtocol, r, err)
	}
	return cc, &p
}

// recording is a dialer that keeps the connections it made.
func recording(opts ...Option) (func(context.Context, string) (net.Conn, error), chan *Conn) {
	got := make(chan *Conn, 16)
	d := Dialer(opts...)
	return func(ctx context.Context, a string) (net.Conn, error) {
		nc, err := d(ctx, a)
		if err == nil {
			got <- nc.(*Conn)
		}
		return nc, err
	}, got
}

func wantProvider(t *testing.T, who string, c *Conn, provider, why string) {
	t.Helper()
	// Stats says "negotiating" until the connection knows; the figure
	// checked here is the verdict.
	if err := c.Handshake(t.Context()); err != nil && provider != "" {
		t.Errorf("%s connection: handshake: %v", who, err)
	}
	s := c.Stats()
	if s.Provider != provider || !strings.Contains(s.ProviderReason, why) {
		t.Errorf("%s connection: provider %q (%s), want %q (%s)", who, s.Provider, s.ProviderReason, provider, why)
	}
}

// One address serves both: a plain grpc-go client over TCP, and an
// rdmagrpc client over RDMA.
func TestMixedOneAddressServesBoth(t *testing.T) {
	l, err := Listen(t.Context(), testAddr(), WithProvider("shm"))
	if err != nil {
		t.Fatal(err)
	}
	cl := capture{l, make(chan net.Conn, 16)}
	serveHealth(t, cl)
	addr := l.Addr().String()

	check(t, addr, nil)
	wantProvider(t, "server side of the plain client's", (<-cl.got).(*Conn), "tcp", "a plain TCP client")

	dial, got := recording(WithProvider("shm"))
	check(t, addr, dial)
	wantProvider(t, "rdmagrpc client", <-got, "shm", "option")
	wantProvider(t, "server side of the rdmagrpc client's", (<-cl.got).(*Conn), "shm", "option")
}

// To a server that has not adopted rdmagrpc, a dial is a TCP dial: no
// time-out, one connection; WithoutFallback fails at once instead.
func TestMixedFallbackToPlainServer(t *testing.T) {
	tl, err := net.Listen("tcp", testAddr())
	if err != nil {
		t.Fatal(err)
	}
	serveHealth(t, tl)
	addr := tl.Addr().String()

	dial, got := recording(WithProvider("shm"))
	check(t, addr, dial)
	wantProvider(t, "client", <-got, "tcp", "plain gRPC (HTTP/2) server")

	start := time.Now()
	_, err = Dial(t.Context(), addr, WithProvider("shm"), WithoutFallback())
	if !errors.Is(err, ErrNoRDMA) {
		t.Fatalf("WithoutFallback to a plain server: %v, want ErrNoRDMA", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("WithoutFallback took %v: it waited for something", d)
	}
	t.Logf("WithoutFallback: %v (in %v)", err, time.Since(start).Round(time.Microsecond))
}

// A listener whose provider the client does not have says so and both
// stay on TCP.
func TestMixedProviderMismatch(t *testing.T) {
	l, err := Listen(t.Context(), testAddr(), WithProvider("shm"))
	if err != nil {
		t.Fatal(err)
	}
	cl := capture{l, make(chan net.Conn, 16)}
	serveHealth(t, cl)
	dial, got := recording(WithProvider(otherFamily{}.Name()))
	check(t, l.Addr().String(), dial)
	wantProvider(t, "client", <-got, "tcp", "the server offers no RDMA: the server's RDMA provider is shm")
	wantProvider(t, "server side", (<-cl.got).(*Conn), "tcp", "provider is shm")
	if _, ok := lookupServer(l.Addr().String(), otherFamily{}.Name()); ok {
		t.Fatal("a server that stays TCP is remembered")
	}

	_, err = Dial(t.Context(), l.Addr().String(), WithProvider(otherFamily{}.Name()), WithoutFallback())
	if !errors.Is(err, ErrNoRDMA) {
		t.Fatalf("WithoutFallback: %v, want ErrNoRDMA", err)
	}
}

// An offered upgrade that fails (here the client's first registration)
// leaves both ends on the TCP connection they negotiated on.
func TestMixedUpgradeFails(t *testing.T) {
	waitLingering(t)
	ReleaseKits() // so that the dial registers its rings, and the rule fails it
	l, err := Listen(t.Context(), testAddr(), WithProvider(faults.Name()))
	if err != nil {
		t.Fatal(err)
	}
	cl := capture{l, make(chan net.Conn, 16)}
	serveHealth(t, cl)
	// Every registration fails while the rule is in: with a limit of one,
	// a registration of anything else in the process (an earlier test's
	// connection still at work) could take the failure meant for the dial
	// (CI failed so once).
	h := faults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg})
	defer h.Remove()
	dial, got := recording(WithProvider(faults.Name()))
	check(t, l.Addr().String(), dial)
	if h.Fired() < 1 {
		t.Fatal("the rule never fired")
	}
	wantProvider(t, "client", <-got, "tcp", "the RDMA upgrade failed")
	wantProvider(t, "server side", (<-cl.got).(*Conn), "tcp", "the client could not upgrade")
}

// Names and literals as grpc-go users write them.
func TestMixedAddresses(t *testing.T) {
	for _, addr := range []string{"localhost:0", "[::1]:0", "127.0.0.1:0"} {
		t.Run(addr, func(t *testing.T) {
			l, err := Listen(t.Context(), addr, WithProvider("shm"))
			if err != nil {
				if strings.HasPrefix(addr, "[::1]") {
					t.Skipf("no IPv6 loopback here: %v", err)
				}
				t.Fatal(err)
			}
			serveHealth(t, l)
			_, port, _ := net.SplitHostPort(l.Addr().String())
			host, _, _ := net.SplitHostPort(addr)
			dial, got := recording(WithProvider("shm"))
			check(t, net.JoinHostPort(host, port), dial)
			wantProvider(t, "client", <-got, "shm", "option")
		})
	}
}

// An offered RDMA address that does not answer costs WithUpgradeTimeout
// once; the next dials to it stay on TCP at once.
func TestMixedUnreachableUpgradeRemembered(t *testing.T) {
	p, err := transport.Get("shm")
	if err != nil {
		t.Fatal(err)
	}
	dev, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	stuck, err := dev.Listen(testAddr()) // never accepts: dials to it hang
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close()
	// What this test makes dials remember would keep, for 30 s, a later
	// test's dials to a listener that got this port on TCP.
	t.Cleanup(func() { forgetFailedUpgrade(stuck.Addr().String()) })
	tl, err := net.Listen("tcp", testAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer tl.Close()
	go func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				readClientStart(c)
				c.Write(encodeReply(verdictRDMA, stuck.Addr().String()))
				io.ReadFull(c, make([]byte, 1)) // stayTCP
			}()
		}
	}()
	const timeout = 300 * time.Millisecond
	// The time to the verdict: Handshake waits for it.
	dial := func() (*Conn, time.Duration) {
		start := time.Now()
		nc, err := Dial(t.Context(), tl.Addr().String(), WithProvider("shm"), WithUpgradeTimeout(timeout))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nc.Close() })
		nc.(*Conn).Handshake(t.Context())
		return nc.(*Conn), time.Since(start)
	}
	c, first := dial()
	wantProvider(t, "first dial", c, "tcp", "the RDMA upgrade failed")
	if first < timeout {
		t.Fatalf("first dial fell back after %v, before the upgrade timeout", first)
	}
	c, second := dial()
	wantProvider(t, "second dial", c, "tcp", "failed less than")
	if second >= timeout {
		t.Fatalf("second dial took %v: it tried the unreachable address again", second)
	}
	t.Logf("first dial %v (the upgrade timed out), second %v", first, second)
}

// A listener that offered RDMA on its own port is dialed directly next
// time; when it is gone, the next dial negotiates afresh and finds what is
// there now.
func TestMixedKnownServerDialedDirectly(t *testing.T) {
	nl, err := Listen(t.Context(), testAddr(), WithProvider("shm"))
	if err != nil {
		t.Fatal(err)
	}
	l := nl.(*Listener)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	addr := l.Addr().String()
	// An earlier test's listener may have had this port, and the cache
	// rightly remembers it: start from a dial that has not seen it.
	forgetServer(addr, "shm")
	for range 5 {
		c, err := Dial(t.Context(), addr, WithProvider("shm"))
		if err != nil {
			t.Fatal(err)
		}
		wantProvider(t, "dial", c.(*Conn), "shm", "option")
		c.Close()
	}
	if n := l.negotiations.Load(); n != 1 {
		t.Fatalf("%d negotiations for 5 dials, want 1", n)
	}
	l.Close()
	// A plain gRPC server now has the address.
	tl, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("cannot listen on %s again: %v", addr, err)
	}
	serveHealth(t, tl)
	dial, got := recording(WithProvider("shm"))
	check(t, addr, dial)
	wantProvider(t, "after the server changed", <-got, "tcp", "plain gRPC (HTTP/2) server")
	if _, ok := lookupServer(addr, "shm"); ok {
		t.Fatal("the address is still remembered as rdmagrpc")
	}
}

// A plain server's address taken over by an rdmagrpc listener: the next
// dial upgrades, since a server that stays TCP is not remembered.
func TestMixedPlainServerReplaced(t *testing.T) {
	tl, err := net.Listen("tcp", testAddr())
	if err != nil {
		t.Fatal(err)
	}
	addr := tl.Addr().String()
	forgetServer(addr, "shm")
	s := grpc.NewServer()
	healthgrpc.RegisterHealthServer(s, health.NewServer())
	go s.Serve(tl)

	dial, got := recording(WithProvider("shm"))
	check(t, addr, dial)
	wantProvider(t, "first dial", <-got, "tcp", "plain gRPC (HTTP/2) server")
	s.Stop()

	nl, err := Listen(t.Context(), addr, WithProvider("shm"))
	if err != nil {
		t.Skipf("cannot listen on %s again: %v", addr, err)
	}
	l := nl.(*Listener)
	serveHealth(t, l)
	check(t, addr, dial)
	wantProvider(t, "dial to the new server", <-got, "shm", "option")
	check(t, addr, dial)
	wantProvider(t, "the dial after", <-got, "shm", "option")
	if n := l.negotiations.Load(); n != 1 {
		t.Fatalf("%d negotiations, want 1 (the second dial goes to RDMA directly)", n)
	}
}
