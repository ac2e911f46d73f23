package conn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// What Write accepted before Close is delivered, as over TCP: on a first
// dial, whose negotiation runs behind it and holds small writes, and on a
// later one, which goes to RDMA directly; with the default linger (Close
// returns at once, delivery goes on in the background) and with a
// positive one (Close waits for it).
func TestCloseDeliversWhatWriteAccepted(t *testing.T) {
	for _, linger := range []int{-1, 5} {
		t.Run(fmt.Sprintf("linger %d", linger), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			l, err := Listen(ctx, testAddr())
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			addr := l.Addr().String()
			forgetFailedUpgrade(l.(*Listener).l.Addr().String())
			t.Cleanup(func() { forgetServer(addr, l.(*Listener).name) })
			got := make(chan string, 4)
			go func() {
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					go func() {
						defer c.Close()
						b, err := io.ReadAll(c)
						if err != nil {
							got <- "error: " + err.Error()
							return
						}
						got <- string(b)
					}()
				}
			}()
			for _, dial := range []string{"first dial", "later dial"} {
				c, err := Dial(ctx, addr)
				if err != nil {
					t.Fatal(err)
				}
				if linger >= 0 {
					if err := c.(*Conn).SetLinger(linger); err != nil {
						t.Fatal(err)
					}
				}
				msg := "seventeen bytes!!"
				if n, err := c.Write([]byte(msg)); n != len(msg) || err != nil {
					t.Fatalf("%s: write %d, %v", dial, n, err)
				}
				start := time.Now()
				if err := c.Close(); err != nil {
					t.Fatalf("%s: close: %v", dial, err)
				}
				took := time.Since(start)
				if _, err := c.Write([]byte("x")); err == nil {
					t.Fatalf("%s: a write after Close succeeded", dial)
				}
				select {
				case s := <-got:
					if s != msg {
						t.Fatalf("%s: the server read %q, want %q", dial, s, msg)
					}
				case <-ctx.Done():
					t.Fatalf("%s: the server never read to the end", dial)
				}
				t.Logf("%s: Close took %v, the server read all", dial, took)
				if dial == "first dial" {
					// The listener is remembered once a connection knew
					// its verdict: the second dial goes to RDMA directly.
					testutil.Eventually(t, 10*time.Second, "the listener to be remembered", testutil.Bool(func() bool { _, ok := lookupServer(addr, l.(*Listener).name); return ok }))
				}
			}
		})
	}
}

// Stats never waits for a peer: before the negotiation's verdict it says
// the connection is negotiating.
func TestStatsDoesNotWaitForTheNegotiation(t *testing.T) {
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer tl.Close()
	silent := make(chan net.Conn, 1)
	go func() {
		c, err := tl.Accept()
		if err == nil {
			silent <- c // accepted, never answered
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, tl.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan Stats, 1)
	go func() { done <- c.(*Conn).Stats() }()
	select {
	case s := <-done:
		if s.Provider != ProviderNegotiating {
			t.Fatalf("Stats before the verdict: provider %q (%s)", s.Provider, s.ProviderReason)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Stats waited for a server that never answers")
	}
	sc := <-silent
	sc.Close()
}

// A dial that nothing answers fails as net.Dial does: the TCP error first
// (errors.Is finds syscall.ECONNREFUSED), the direct RDMA attempt's
// reason in the text.
func TestDialRefusedIsTCPs(t *testing.T) {
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := tl.Addr().String()
	tl.Close() // nothing listens there now
	_, err = Dial(context.Background(), addr)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial to %s: %v; want an error that is syscall.ECONNREFUSED", addr, err)
	}
	var ne net.Error
	if !errors.As(err, &ne) || ne.Timeout() {
		t.Fatalf("dial to %s: %v is not a net.Error, or says time-out", addr, err)
	}
	if !strings.Contains(err.Error(), "directly over RDMA") {
		t.Errorf("the RDMA attempt's reason is not in %q", err)
	}
	t.Log(err)
}
