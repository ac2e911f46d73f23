package conn

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// The peer process is killPeer in killpeer_test.go (package conn_test, same
// test binary): this is its environment variable.
const envKillPeer = "RDMAGRPC_CONN_TEST_KILL_PEER"

// The peer process killed with SIGKILL in each phase: small buffers; an
// enlargement in flight, the peer waiting for our ack or we for its;
// large buffers; a shrink, our retired ring not drained yet; a rendezvous
// transfer in the middle. Our Read and Write
// fail within 5 s of the kill (never a clean end, never a time-out), and
// after Close nothing is left: no PD, CQ, QP, MR, budget byte or
// goroutine.
func TestPeerKilledInEachPhase(t *testing.T) {
	const prompt = 5 * time.Second
	for _, tc := range []struct {
		phase string
		write int // the size of our writes
		// reach returns once the connection is in the phase.
		reach func(t *testing.T, c *rdmaConn)
	}{
		{"small", 100, func(t *testing.T, c *rdmaConn) {
			readN(t, c, 10<<10)
			if s := c.Stats(); s.RecvPhase != "small" || s.SendPhase != "small" {
				t.Fatalf("phases %s/%s, want small", s.SendPhase, s.RecvPhase)
			}
		}},
		{"enlarging-peer-waits", 100, func(t *testing.T, c *rdmaConn) {
			// Our enlargement server is muted: the peer waits for an ack.
			testutil.Eventually(t, 10*time.Second, "c.enl.reqIn >= 1", testutil.Bool(func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.enl.reqIn >= 1 }))
		}},
		{"enlarging-we-wait", 64 << 10, func(t *testing.T, c *rdmaConn) {
			// The peer holds our request: our write waits for its ack.
			testutil.Eventually(t, 10*time.Second, "c.enl.waiting && c.enl.attempts == 1", testutil.Bool(func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.enl.waiting && c.enl.attempts == 1 }))
		}},
		{"large", 40 << 10, func(t *testing.T, c *rdmaConn) {
			readN(t, c, 1<<20)
			if s := c.Stats(); s.RecvPhase != "large" {
				t.Fatalf("peer's direction in phase %s, want large", s.RecvPhase)
			}
		}},
		{"shrinking", 100, func(t *testing.T, c *rdmaConn) {
			// The peer wrote 26 messages of 40 KiB, then shrank its
			// direction: our large ring is retired with its last message
			// still unread.
			readN(t, c, 25*40<<10)
			testutil.Eventually(t, 10*time.Second, "c.rx[large].retiring", testutil.Bool(func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.rx[large].retiring }))
		}},
		{"rendezvous", 8 << 20, func(t *testing.T, c *rdmaConn) {
			readN(t, c, 5<<20) // into the second advert of an 8 MiB message
			testutil.Eventually(t, 10*time.Second, "c.Stats().Rendezvous >= 1", testutil.Bool(func() bool { return c.Stats().Rendezvous >= 1 }))
			if s := c.Stats(); s.RendezvousIn < 2 {
				t.Fatalf("%d adverts in, want the peer mid-transfer", s.RendezvousIn)
			}
		}},
	} {
		t.Run(tc.phase, func(t *testing.T) {
			goroutines := goleak.IgnoreCurrent()
			budget := bufpool.NewBudget(0)
			l, err := Listen(context.Background(), testAddr(), WithProvider(leaks.Name()), WithBudget(budget), WithAckTimeout(30*time.Second, 0))
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), envKillPeer+"="+tc.phase+" "+l.Addr().String())
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			killed := false
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			defer func() {
				if !killed {
					cmd.Process.Kill()
				}
				<-exited
			}()
			accepted := make(chan net.Conn, 1)
			go func() {
				nc, err := l.Accept()
				if err != nil {
					nc = nil
				}
				accepted <- nc
			}()
			var nc net.Conn
			select {
			case nc = <-accepted:
			case err := <-exited:
				exited <- err // for the deferred wait
				l.Close()
				<-accepted
				t.Fatalf("peer exited before connecting: %v", err)
			}
			if nc == nil {
				t.Fatal("accept failed")
			}
			c := unwrap(t, nc)
			if tc.phase == "enlarging-peer-waits" {
				c.mu.Lock()
				c.enl.serving = true // muted
				c.mu.Unlock()
			}
			if _, err := c.Write([]byte{1}); err != nil { // go
				t.Fatal(err)
			}
			werr := make(chan error, 1)
			go func() {
				msg := random(tc.write)
				for {
					if _, err := c.Write(msg); err != nil {
						werr <- err
						return
					}
				}
			}()
			tc.reach(t, c)
			time.Sleep(20 * time.Millisecond) // both directions in flight
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			killed = true
			start := time.Now()
			rerr := make(chan error, 1)
			go func() {
				_, err := io.Copy(io.Discard, c)
				if err == nil {
					err = io.EOF
				}
				rerr <- err
			}()
			for _, side := range []struct {
				op string
				ch chan error
			}{{"read", rerr}, {"write", werr}} {
				select {
				case err := <-side.ch:
					if errors.Is(err, io.EOF) || isTimeout(err) {
						t.Fatalf("%s after the kill: %v, want the connection lost", side.op, err)
					}
					t.Logf("%s failed %v after the kill: %v", side.op, time.Since(start).Round(time.Millisecond), err)
				case <-time.After(prompt - time.Since(start)):
					t.Fatalf("%s still blocked %v after the kill", side.op, prompt)
				}
			}
			c.Close()
			l.Close()
			<-exited
			exited <- nil // for the deferred wait
			noLeaks(t, budget, goroutines)
		})
	}
}

func readN(t *testing.T, c *rdmaConn, n int64) {
	t.Helper()
	if _, err := io.CopyN(io.Discard, c, n); err != nil {
		t.Fatal(err)
	}
}
