package conn

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthgrpc "google.golang.org/grpc/health/grpc_health_v1"

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
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if dialer != nil {
		opts = append(opts, grpc.WithContextDialer(dialer))
	}
	cc, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := healthgrpc.NewHealthClient(cc).Check(ctx, &healthgrpc.HealthCheckRequest{})
	if err != nil || r.Status != healthgrpc.HealthCheckResponse_SERVING {
		t.Fatalf("health check over %s: %v %v", addr, r, err)
	}
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
	// The next dial knows the answer: a probe, which the server answers
	// with the same verdict, and the address stays known as TCP.
	check(t, l.Addr().String(), dial)
	wantProvider(t, "client, second dial", <-got, "tcp", "not the client's (at an earlier dial)")
	wantProvider(t, "server side, second dial", (<-cl.got).(*Conn), "tcp", "the client stays on TCP")
	if k, ok := lookupServer(l.Addr().String(), otherFamily{}.Name()); !ok || k.rdma != "" {
		t.Fatalf("after the probe: %+v %v, want known to stay TCP", k, ok)
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
	l, err := Listen(t.Context(), testAddr(), WithProvider(faults.Name()))
	if err != nil {
		t.Fatal(err)
	}
	cl := capture{l, make(chan net.Conn, 16)}
	serveHealth(t, cl)
	h := faults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg, Limit: 1})
	defer h.Remove()
	dial, got := recording(WithProvider(faults.Name()))
	check(t, l.Addr().String(), dial)
	if h.Fired() != 1 {
		t.Fatalf("rule fired %d times", h.Fired())
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

// The server's side of the negotiation cut at every step: the dial fails
// with a clear error, or falls back cleanly.
func TestNegotiationCutByServer(t *testing.T) {
	for _, tc := range []struct {
		name  string
		serve func(c net.Conn)
		want  string // in the dial error; "" for a fall-back
	}{
		{"at accept", func(c net.Conn) {}, "closed or failed before answering"},
		{"after the preface", func(c net.Conn) { io.ReadFull(c, make([]byte, len(clientStart("shm")))) }, "closed or failed before answering"},
		{"mid-reply", func(c net.Conn) {
			io.ReadFull(c, make([]byte, len(clientStart("shm"))))
			c.Write(encodeReply(verdictRDMA, "127.0.0.1:1")[:6])
		}, "EOF"},
		{"bad verdict", func(c net.Conn) {
			io.ReadFull(c, make([]byte, len(clientStart("shm"))))
			c.Write(encodeReply('X', ""))
		}, "verdict"},
		{"offer unreachable", func(c net.Conn) {
			io.ReadFull(c, make([]byte, len(clientStart("shm"))))
			c.Write(encodeReply(verdictRDMA, "127.0.0.1:1"))
			io.ReadFull(c, make([]byte, 1)) // stayTCP
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tl := serveOnce(t, tc.serve)
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			nc, err := Dial(ctx, tl.Addr().String(), WithProvider("shm"))
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("want a fall-back, got %v", err)
			case tc.want == "":
				wantProvider(t, "client", nc.(*Conn), "tcp", "the RDMA upgrade failed")
				if _, err := nc.Read(make([]byte, 1)); err == nil {
					t.Fatal("read from a closed server succeeded")
				}
				nc.Close()
			case err == nil:
				nc.Close()
				t.Fatalf("dial succeeded, want an error with %q", tc.want)
			case !strings.Contains(err.Error(), tc.want):
				t.Fatalf("dial error %q, want %q in it", err, tc.want)
			default:
				t.Logf("%v", err)
			}
		})
	}
}

// The client's side cut at every step: the listener serves on, delivers
// nothing half set up, and leaks nothing.
func TestNegotiationCutByClient(t *testing.T) {
	waitLingering(t)
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	l, err := Listen(t.Context(), testAddr(), WithProvider(faults.Name()))
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	start := clientStart(faults.Name())
	for _, tc := range []struct {
		name     string
		act      func(c net.Conn)
		accepted bool // a TCP connection reaches Accept
	}{
		{"at connect", func(c net.Conn) {}, false},
		{"mid-preface", func(c net.Conn) { c.Write(start[:10]) }, false},
		{"before the reply", func(c net.Conn) { c.Write(start) }, false},
		{"after the offer", func(c net.Conn) {
			c.Write(start)
			io.ReadFull(c, make([]byte, 8))
		}, false},
		{"after staying on TCP", func(c net.Conn) {
			c.Write(start)
			var h [8]byte
			io.ReadFull(c, h[:])
			io.ReadFull(c, make([]byte, int(h[6])<<8|int(h[7])))
			c.Write([]byte{stayTCP})
		}, true},
	} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		tc.act(c)
		c.Close()
		got := make(chan net.Conn, 1)
		go func() {
			nc, err := l.Accept()
			if err != nil {
				nc = nil
			}
			got <- nc
		}()
		select {
		case nc := <-got:
			if nc == nil || !tc.accepted {
				t.Fatalf("%s: Accept returned %v", tc.name, nc)
			}
			wantProvider(t, tc.name, nc.(*Conn), "tcp", "could not upgrade")
			nc.Close()
		case <-time.After(200 * time.Millisecond):
			if tc.accepted {
				t.Fatalf("%s: nothing accepted", tc.name)
			}
			l.Close() // ends the waiting Accept
			<-got
			if l, err = Listen(t.Context(), testAddr(), WithProvider(faults.Name())); err != nil {
				t.Fatal(err)
			}
			addr = l.Addr().String()
		}
	}
	// The listener still serves.
	c, err := Dial(t.Context(), addr, WithProvider(faults.Name()))
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if nc, err := l.Accept(); err == nil {
			nc.Close()
		}
	}()
	wantProvider(t, "after the cuts", c.(*Conn), faults.Name(), "option")
	c.Close()
	<-served
	l.Close()
	waitLingering(t)
	// Both ends' teardowns finish on their own (a slow guest takes a while).
	live := faults.Live()
	for end := time.Now().Add(10 * time.Second); (live.PDs != 0 || live.MRs != 0 || live.CQs != 0 || live.QPs != 0) && time.Now().Before(end); live = faults.Live() {
		time.Sleep(10 * time.Millisecond)
	}
	if live.PDs != 0 || live.MRs != 0 || live.CQs != 0 || live.QPs != 0 {
		t.Fatalf("live after the cuts: %+v", live)
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
				io.ReadFull(c, make([]byte, len(clientStart("shm"))))
				c.Write(encodeReply(verdictRDMA, stuck.Addr().String()))
				io.ReadFull(c, make([]byte, 1)) // stayTCP
			}()
		}
	}()
	const timeout = 300 * time.Millisecond
	dial := func() (*Conn, time.Duration) {
		start := time.Now()
		nc, err := Dial(t.Context(), tl.Addr().String(), WithProvider("shm"), WithUpgradeTimeout(timeout))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nc.Close() })
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
	if k, ok := lookupServer(addr, "shm"); ok && k.rdma != "" {
		t.Fatal("the address is still remembered as rdmagrpc")
	}
}

// A server known to stay TCP is dialed at TCP's speed: the dial returns
// once TCP is connected and the server's answer to the probe is read with
// its first bytes. When an rdmagrpc listener takes the address over, the
// probed connection still works over TCP and the dial after it upgrades.
func TestMixedKnownPlainServerProbed(t *testing.T) {
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
	check(t, addr, dial)
	wantProvider(t, "second dial", <-got, "tcp", "at an earlier dial")
	s.Stop()

	nl, err := Listen(t.Context(), addr, WithProvider("shm"))
	if err != nil {
		t.Skipf("cannot listen on %s again: %v", addr, err)
	}
	l := nl.(*Listener)
	serveHealth(t, l)
	check(t, addr, dial)
	wantProvider(t, "probe of the new server", <-got, "tcp", "at an earlier dial")
	if n := l.probes.Load(); n != 1 {
		t.Fatalf("%d probes, want 1", n)
	}
	if k, ok := lookupServer(addr, "shm"); ok {
		t.Fatalf("still remembered as %+v after the server offered RDMA", k)
	}
	check(t, addr, dial)
	wantProvider(t, "dial after the probe", <-got, "shm", "option")
	if n := l.negotiations.Load(); n != 1 {
		t.Fatalf("%d negotiations, want 1", n)
	}
}

// A probe cut by the server at each step: the dial succeeds (it waits for
// nothing), and the first read says what went wrong; a plain server's
// bytes reach the reader whole.
func TestNegotiationProbeCut(t *testing.T) {
	preface := h2Preface + "\x00\x00\x00\x04\x00\x00\x00\x00\x00" // what grpc-go writes first
	settings := "\x00\x00\x00\x04\x00\x00\x00\x00\x00"
	for _, tc := range []struct {
		name  string
		serve func(c net.Conn)
		read  string // what the first read returns
		want  string // else in its error
	}{
		{"at accept", func(c net.Conn) {}, "", ""}, // EOF: ReadAll says nil
		{"mid-answer", func(c net.Conn) {
			io.ReadFull(c, make([]byte, len(clientStartProbe("shm"))))
			c.Write(encodeReply(verdictTCP, "no")[:6])
		}, "", "the answer to our probe"},
		{"bad verdict", func(c net.Conn) {
			io.ReadFull(c, make([]byte, len(clientStartProbe("shm"))))
			c.Write(encodeReply('X', ""))
		}, "", "verdict"},
		{"a plain server's settings", func(c net.Conn) {
			io.ReadFull(c, make([]byte, len(clientStartProbe("shm"))))
			c.Write([]byte(settings))
		}, settings, ""},
		{"an answer, then settings", func(c net.Conn) {
			io.ReadFull(c, make([]byte, len(clientStartProbe("shm"))))
			c.Write(append(encodeReply(verdictTCP, "no"), settings...))
		}, settings, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := serveOnce(t, tc.serve).Addr().String()
			rememberServer(addr, "shm", knownServer{why: "test"})
			t.Cleanup(func() { forgetServer(addr, "shm") })
			nc, err := Dial(t.Context(), addr, WithProvider("shm"))
			if err != nil {
				t.Fatalf("a probe's dial failed: %v", err)
			}
			defer nc.Close()
			if _, err := nc.Write([]byte(preface)); err != nil && tc.name != "at accept" {
				t.Fatalf("write: %v", err)
			}
			nc.SetReadDeadline(time.Now().Add(10 * time.Second))
			b, err := io.ReadAll(nc)
			switch {
			case tc.want == "" && string(b) != tc.read:
				t.Fatalf("read %q (%v), want %q", b, err, tc.read)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("read %q, error %v; want an error with %q", b, err, tc.want)
			}
		})
	}
}

// serveOnce is a TCP server, closed with the test, that hands its first
// connection to serve and closes it after.
func serveOnce(t *testing.T, serve func(net.Conn)) net.Listener {
	t.Helper()
	tl, err := net.Listen("tcp", testAddr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tl.Close() })
	go func() {
		c, err := tl.Accept()
		if err != nil {
			return
		}
		serve(c)
		c.Close()
	}()
	return tl
}
