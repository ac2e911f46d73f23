package conn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/net/nettest"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A dial to a server known to offer RDMA returns once its request is in
// the listener's socket, as a TCP connect returns once the kernel queued
// it: the calls after it wait for the answer, within their deadlines,
// and a refusal comes with them, as a reset does over TCP. Here the RDMA
// listener is the provider's own, answering only when the test says.
func TestKnownServerDialReturnsBeforeTheAnswer(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	tl, addr := knownProviderListener(t)
	defer tl.Close() // before the leak check, which runs ahead of cleanups

	start := time.Now()
	nc, err := Dial(t.Context(), addr, WithProvider("shm"))
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	c := nc.(*Conn)
	t.Logf("dial returned in %v, unanswered", time.Since(start))
	if c.RemoteAddr() == nil || c.LocalAddr() == nil {
		t.Fatal("no addresses before the answer")
	}
	c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := c.Write([]byte("x")); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("write before the answer: %v, want the deadline", err)
	}
	c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read before the answer: %v, want the deadline", err)
	}
	hctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if err := c.Handshake(hctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("handshake before the answer: %v, want its context's end", err)
	}
	// Close while the request waits: at once, and the listener finds the
	// request withdrawn (its socket closed) or a dead connection.
	start = time.Now()
	if err := c.Close(); err != nil {
		t.Fatalf("close before the answer: %v", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("close before the answer took %v", d)
	}
	if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after close: %v, want net.ErrClosed", err)
	}

	// A refusal: the dial returns, its first call fails saying why, and
	// the server is no longer taken for one known to offer RDMA.
	nc, err = Dial(t.Context(), addr, WithProvider("shm"))
	if err != nil {
		t.Fatalf("second dial: %v", err)
	}
	defer nc.Close()
	go func() {
		for {
			r, err := tl.Accept(context.Background())
			if err != nil {
				return
			}
			r.Reject(transport.RejectBacklogFull)
		}
	}()
	_, err = nc.Write([]byte("x"))
	if !errors.Is(err, ErrBacklogFull) {
		t.Fatalf("write to a listener that refused: %v, want the backlog full", err)
	}
	var rej *transport.RejectError
	if !errors.As(err, &rej) {
		t.Errorf("the refusal is not a transport.RejectError: %v", err)
	}
	if err := nc.(*Conn).Handshake(t.Context()); !errors.Is(err, ErrBacklogFull) {
		t.Errorf("handshake after the refusal: %v", err)
	}
	if _, ok := lookupServer(addr, "shm"); ok {
		t.Error("a listener that refused is still remembered")
	}
}

// The nettest suite on connections whose dial returned early: a first
// dial to each listener makes it known, and the pipe is the second.
func TestNettestEarlyDial(t *testing.T) {
	nettest.TestConn(t, func() (net.Conn, net.Conn, func(), error) { return earlyPipe(t) })
}

// earlyConns is conns on a dial that returned early.
func earlyConns(t *testing.T, opts ...Option) (*rdmaConn, *rdmaConn) {
	t.Helper()
	a, b := connsOf(t, earlyPipe, opts...)
	if _, ok := a.qp.(transport.EarlyQP); !ok {
		t.Fatalf("the dial's QP is a %T, not one of ConnectEarly", a.qp)
	}
	return a, b
}

func earlyPipe(t testing.TB, opts ...Option) (c1, c2 net.Conn, stop func(), err error) {
	// The first dial's upgrade, under WithUpgradeTimeout, may not make it
	// on a loaded machine (the whole suite runs beside): the listener is
	// then not known. Tried again, saying why.
	for try := 1; ; try++ {
		c1, c2, stop, err = dialPipe(t, true, opts...)
		if !errors.Is(err, errNotUpgraded) || try == 3 {
			break
		}
		t.Logf("%v: once more", err)
	}
	if err == nil && c1.(*Conn).tcp != nil {
		stop()
		return nil, nil, nil, errors.New("the second dial negotiated again: it was not early")
	}
	return c1, c2, stop, err
}

// errNotUpgraded: makeKnown's dial stayed on TCP.
var errNotUpgraded = errors.New("the first dial stayed on TCP")

// makeKnown dials l once, to the negotiation's verdict, and closes the
// connection: the next dial to l goes to RDMA directly.
func makeKnown(ctx context.Context, l *Listener, opts []Option) error {
	// An earlier listener may have had the port, and the cache rightly
	// remembers it.
	forgetServer(l.Addr().String(), l.name)
	c, err := Dial(ctx, l.Addr().String(), opts...)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.(*Conn).Handshake(ctx); err != nil {
		return err
	}
	if s := c.(*Conn).Stats(); s.Provider == "tcp" {
		return fmt.Errorf("%w (%s)", errNotUpgraded, s.ProviderReason)
	}
	return nil
}

// A client dialing in a loop cannot run ahead of a listener by more than
// maxEarly unanswered requests: the next dial waits for its answer, as a
// TCP connect blocks once the listener's queue is full; a dial closed
// while it waits leaves the count. Here the listener is the provider's
// own and answers only when the test says.
func TestEarlyDialsBounded(t *testing.T) {
	_, addr := knownProviderListener(t)

	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
		// Their kits would serve the next tests' dials, which some
		// count on to register.
		waitLingering(t)
		ReleaseKits()
	}()
	for i := range maxEarly {
		// An early dial waits for its answer for WithUpgradeTimeout and
		// then leaves the gate: the wait must outlast the whole loop,
		// which takes seconds under -race in the rxe guest (with the 2 s
		// default the first dials left, and dial 257 got in).
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		c, err := Dial(ctx, addr, WithProvider("shm"), WithUpgradeTimeout(2*time.Minute))
		cancel()
		if err != nil {
			t.Fatalf("dial %d of the first %d: %v", i+1, maxEarly, err)
		}
		conns = append(conns, c)
	}
	ks, ok := lookupServer(addr, "shm")
	if !ok || ks.early.inFlight() != maxEarly {
		t.Fatalf("the server's gate: %v known, want %d in it", ok, maxEarly)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	c, err := Dial(ctx, addr, WithProvider("shm"))
	cancel()
	if err == nil {
		conns = append(conns, c)
		t.Fatalf("dial %d returned before its answer, with %d unanswered", maxEarly+1, maxEarly)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("dial %d: %v, want its context's end while it waits for room", maxEarly+1, err)
	}
	// One of the waiting dials is closed: it leaves the gate.
	conns[0].Close()
	testutil.Eventually(t, 5*time.Second, "the closed dial to leave the gate", testutil.Bool(func() bool { return ks.early.inFlight() < maxEarly }))
	// The dial that timed out forgot the server, as any failed direct
	// dial does; known again, it is dialed early again, and its dials
	// still in flight count as before.
	rememberServer(addr, "shm", offer{provider: "shm", addr: addr})
	if again, _ := lookupServer(addr, "shm"); again != ks {
		t.Fatal("known again, the server has a new count of dials in flight")
	}
	ctx, cancel = context.WithTimeout(t.Context(), 5*time.Second)
	c, err = Dial(ctx, addr, WithProvider("shm"))
	cancel()
	if err != nil {
		t.Fatalf("dial after an answer: %v", err)
	}
	conns = append(conns, c)
	r := c.(*Conn).rdma
	if r == nil {
		t.Fatal("the dial after an answer negotiated over TCP: it did not go to the listener it knew")
	}
	if _, ok := r.qp.(transport.EarlyQP); !ok {
		t.Fatalf("the dial after an answer waited for its own: its QP is a %T", r.qp)
	}
}

// knownProviderListener is an shm provider's own listener, which answers
// nothing unless the test does, known to dials as an RDMA listener (they
// go to it directly); its address.
func knownProviderListener(t *testing.T) (transport.Listener, string) {
	t.Helper()
	dev, err := openDevice("shm")
	if err != nil {
		t.Fatal(err)
	}
	tl, err := dev.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tl.Close() })
	addr := tl.Addr().String()
	rememberServer(addr, "shm", offer{provider: "shm", addr: addr})
	t.Cleanup(func() { forgetServer(addr, "shm") })
	return tl, addr
}

// A refusal ends a dial, and is not gone round over TCP, except a
// listener's that could not take the connection (out of descriptors): it
// may still take it over TCP.
func TestFinalRefusals(t *testing.T) {
	for _, tc := range []struct {
		private []byte
		final   bool
	}{
		{transport.RejectBacklogFull, true},
		{append(slices.Clone(transport.RejectPeerRefused), "uid 7"...), true},
		{nil, true},
		{append(slices.Clone(transport.RejectListenerFailed), "out of descriptors"...), false},
	} {
		err := fmt.Errorf("dial: %w", &transport.RejectError{Private: tc.private})
		if got := final(t.Context(), err); got != tc.final {
			t.Errorf("reject %q: final %v, want %v", tc.private, got, tc.final)
		}
	}
	if !final(canceled(t), errors.New("any")) {
		t.Error("a dial whose context ended is not final")
	}
}

func canceled(t *testing.T) context.Context {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	return ctx
}
