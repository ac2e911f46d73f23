package shm

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// ConnectEarly returns with the request queued for the listener, before
// anyone accepts it; Established waits for the answer, an acceptance, a
// refusal, or the QP's Close.
func TestConnectEarly(t *testing.T) {
	cli, srv, l := listenSides(t, 64, 64)
	defer l.Close()
	ec := cli.dev.(transport.EarlyConnector)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	addr := l.Addr().String()

	q, err := ec.ConnectEarly(ctx, addr, cli.cfg(), []byte("hello"))
	if err != nil {
		t.Fatal(err)
	}
	cli.qp = q
	if q.LocalAddr() == nil || q.RemoteAddr() == nil {
		t.Fatal("no addresses before the answer")
	}
	done := make(chan error, 1)
	go func() { done <- q.Established(ctx) }()
	select {
	case err := <-done:
		t.Fatalf("established before anyone accepted: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	r, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if srv.qp, err = r.Accept(ctx, srv.cfg(), []byte("welcome")); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("established: %v", err)
	}
	if err := q.Established(ctx); err != nil {
		t.Fatalf("established, asked again: %v", err)
	}
	if got := string(bytes.TrimRight(q.PeerPrivate(), "\x00")); got != "welcome" {
		t.Fatalf("accept private data %q", got)
	}
	copy(cli.mem, "early")
	if _, err := q.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpWrite, SG: cli.sge(0, 5), RemoteAddr: srv.mr.Addr(), RKey: srv.mr.RKey(), Signaled: true}); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, poll(t, cli.scq, 1)[0], transport.StatusSuccess)
	if string(srv.mem[:5]) != "early" {
		t.Fatalf("written %q", srv.mem[:5])
	}

	t.Run("refused", func(t *testing.T) {
		q, err := ec.ConnectEarly(ctx, addr, cli.cfg(), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer q.Close()
		r, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		r.Reject([]byte("no"))
		var rej *transport.RejectError
		if err := q.Established(ctx); !errors.As(err, &rej) || !bytes.HasPrefix(rej.Private, []byte("no")) {
			t.Fatalf("established after a refusal: %v, want the refusal", err)
		}
	})
	t.Run("closed while waiting", func(t *testing.T) {
		q, err := ec.ConnectEarly(ctx, addr, cli.cfg(), nil)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- q.Established(ctx) }()
		time.Sleep(10 * time.Millisecond) // fixed: the wait must have begun, a state it does not show
		start := time.Now()
		q.Close()
		if err := <-done; err == nil {
			t.Fatal("established after Close")
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("Close took %v to end the wait", d)
		}
		if err := q.Established(ctx); err == nil {
			t.Fatal("established, asked after Close")
		}
		// The listener finds the request, and no one to answer it.
		r, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if sq, err := r.Accept(ctx, srv.cfg(), nil); err == nil {
			sq.Close()
			t.Fatal("accepted a request withdrawn by Close")
		}
	})
	t.Run("closed before waiting", func(t *testing.T) {
		q, err := ec.ConnectEarly(ctx, addr, cli.cfg(), nil)
		if err != nil {
			t.Fatal(err)
		}
		q.Close()
		if err := q.Established(ctx); err == nil {
			t.Fatal("established after Close")
		}
	})
	// EstablishedBy: the same waits bounded by a time, with no context.
	t.Run("by a deadline", func(t *testing.T) {
		q, err := ec.ConnectEarly(ctx, addr, cli.cfg(), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer q.Close()
		done := make(chan error, 1)
		go func() { done <- q.(transport.DeadlineEstablisher).EstablishedBy(time.Now().Add(10 * time.Second)) }()
		// The request withdrawn before its wait (above) comes first:
		// answering it fails.
		for range 2 {
			r, err := l.Accept(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if sq, err := r.Accept(ctx, srv.cfg(), nil); err == nil {
				defer sq.Close()
				break
			}
		}
		if err := <-done; err != nil {
			t.Fatalf("established by a deadline: %v", err)
		}
	})
	t.Run("past the deadline", func(t *testing.T) {
		q, err := ec.ConnectEarly(ctx, addr, cli.cfg(), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer q.Close()
		start := time.Now()
		err = q.(transport.DeadlineEstablisher).EstablishedBy(start.Add(50 * time.Millisecond))
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("unanswered past the deadline: %v, want context.DeadlineExceeded", err)
		}
		if d := time.Since(start); d < 50*time.Millisecond || d > 5*time.Second {
			t.Errorf("the wait took %v for a deadline 50ms away", d)
		}
		r, err := l.Accept(ctx) // withdrawn: no one answers it
		if err != nil {
			t.Fatal(err)
		}
		r.Reject(nil)
	})
	t.Run("closed while waiting by a deadline", func(t *testing.T) {
		q, err := ec.ConnectEarly(ctx, addr, cli.cfg(), nil)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- q.(transport.DeadlineEstablisher).EstablishedBy(time.Now().Add(time.Minute)) }()
		time.Sleep(10 * time.Millisecond) // fixed: the wait must have begun, a state it does not show
		start := time.Now()
		q.Close()
		if err := <-done; !errors.Is(err, net.ErrClosed) {
			t.Fatalf("waiting by a deadline, closed: %v, want net.ErrClosed", err)
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("Close took %v to end the wait", d)
		}
		r, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		r.Reject(nil)
	})
}
