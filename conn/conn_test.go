package conn

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/net/nettest"

	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"   // the default where no RDMA device exists
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs" // chosen automatically where a device exists (the rxe tier)
)

// testAddr is where tests listen: the guest's RoCE address in the rxe
// tier (verbs cannot use loopback), else loopback.
func testAddr() string {
	if a := os.Getenv("RXE_ADDR"); a != "" {
		return net.JoinHostPort(a, "0")
	}
	return "127.0.0.1:0"
}

func pipe(t testing.TB, opts ...Option) (c1, c2 net.Conn, stop func(), err error) {
	return dialPipe(t, false, opts...)
}

// dialPipe is pipe; early: the pipe's dial is a second one, which goes to
// the listener the first made known and returns early (early_test.go).
func dialPipe(t testing.TB, early bool, opts ...Option) (c1, c2 net.Conn, stop func(), err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := Listen(ctx, testAddr(), opts...)
	if err != nil {
		return nil, nil, nil, err
	}
	defer l.Close()
	// A timed-out upgrade to this port, by an earlier test whose listener
	// had it, is remembered for failedUpgradeTTL: it would keep this
	// test's dial on TCP.
	forgetFailedUpgrade(l.(*Listener).l.Addr().String())
	// Nor may an earlier test's successful dial to this port make this
	// pipe's dial an early one (which Stats reports as negotiating
	// until the listener answers): a pipe is early only when asked.
	forgetAddr(l.Addr().String())
	type res struct {
		c   net.Conn
		err error
	}
	dials := 1
	if early {
		dials = 2
	}
	ch := make(chan res, dials)
	go func() {
		for range dials {
			c, err := l.Accept()
			ch <- res{c, err}
		}
	}()
	if early {
		// The listener's port may be another test's later: what makeKnown
		// remembered goes with this test.
		ll := l.(*Listener)
		t.Cleanup(func() { forgetServer(ll.Addr().String(), ll.name) })
		if err := makeKnown(ctx, ll, opts); err != nil {
			// The connection it made, if accepted, goes too.
			l.Close()
			if first := <-ch; first.err == nil {
				first.c.Close()
			}
			return nil, nil, nil, err
		}
		first := <-ch
		if first.err != nil {
			return nil, nil, nil, first.err
		}
		first.c.Close()
	}
	c1, err = Dial(ctx, l.Addr().String(), opts...)
	if err != nil {
		return nil, nil, nil, err
	}
	r := <-ch
	if r.err != nil {
		c1.Close()
		return nil, nil, nil, r.err
	}
	return c1, r.c, func() { c1.Close(); r.c.Close() }, nil
}

func TestNettest(t *testing.T) {
	nettest.TestConn(t, func() (net.Conn, net.Conn, func(), error) { return pipe(t) })
}

// forgetAddr drops what dials remembered of the server at addr, under
// every provider.
func forgetAddr(addr string) {
	knownServers.Lock()
	for k := range knownServers.m {
		if k[0] == addr {
			delete(knownServers.m, k)
		}
	}
	knownServers.Unlock()
}

func forgetFailedUpgrade(addr string) {
	failedUpgrades.Lock()
	delete(failedUpgrades.m, addr)
	failedUpgrades.Unlock()
}
