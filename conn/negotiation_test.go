package conn

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The server's side of the negotiation cut at every step. The dial
// returns once TCP is connected and the first read says what went wrong,
// or the connection falls back cleanly and a plain server's bytes reach
// the reader whole; WithoutFallback, the dial waits and fails with the
// same error.
func TestNegotiationCutByServer(t *testing.T) {
	preface := h2Preface + "\x00\x00\x00\x04\x00\x00\x00\x00\x00" // what grpc-go writes first
	settings := "\x00\x00\x00\x04\x00\x00\x00\x00\x00"
	readStart := readClientStart
	for _, tc := range []struct {
		name  string
		serve func(c net.Conn)
		want  string // in the error of the first read; "" for a fall-back
		why   string // a fall-back's reason
		read  string // what a fall-back reads
	}{
		{"at accept", func(c net.Conn) {}, "closed or failed before answering", "", ""},
		{"after the preface", readStart, "closed or failed before answering", "", ""},
		{"mid-magic", func(c net.Conn) { readStart(c); c.Write([]byte(replyMagic[:2])) }, "closed or failed before answering", "", ""},
		{"mid-reply", func(c net.Conn) {
			readStart(c)
			c.Write(encodeReply(verdictRDMA, "127.0.0.1:1")[:6])
		}, "EOF", "", ""},
		{"bad verdict", func(c net.Conn) {
			readStart(c)
			c.Write(encodeReply('X', ""))
		}, "verdict", "", ""},
		{"offer unreachable", func(c net.Conn) {
			readStart(c)
			c.Write(encodeReply(verdictRDMA, "127.0.0.1:1"))
			io.ReadFull(c, make([]byte, 1)) // stayTCP
		}, "", "the RDMA upgrade failed", ""},
		{"stay on TCP, then settings", func(c net.Conn) {
			readStart(c)
			c.Write(append(encodeReply(verdictTCP, "no"), settings...))
		}, "", "offers no RDMA: no", settings},
		{"a plain server's settings", func(c net.Conn) {
			readStart(c)
			c.Write([]byte(settings))
		}, "", "plain gRPC", settings},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			addr := serveOnce(t, tc.serve).Addr().String()
			nc, err := Dial(t.Context(), addr, WithProvider("shm"))
			if err != nil {
				t.Fatalf("the dial waited for the negotiation: %v", err)
			}
			defer nc.Close()
			// Held until the verdict, or after it, its error.
			if _, err := nc.Write([]byte(preface)); err != nil && (tc.want == "" || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("write: %v", err)
			}
			nc.SetReadDeadline(time.Now().Add(10 * time.Second))
			b, err := io.ReadAll(nc)
			switch {
			case tc.want == "" && string(b) != tc.read:
				t.Fatalf("read %q (%v), want %q", b, err, tc.read)
			case tc.want == "":
				wantProvider(t, "client", nc.(*Conn), "tcp", tc.why)
			case err == nil || !strings.Contains(err.Error(), tc.want):
				t.Fatalf("read %q, error %v; want an error with %q", b, err, tc.want)
			default:
				t.Logf("first read: %v", err)
			}

			addr = serveOnce(t, tc.serve).Addr().String()
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			nc, err = Dial(ctx, addr, WithProvider("shm"), WithoutFallback())
			switch {
			case err == nil:
				nc.Close()
				t.Fatal("WithoutFallback: the dial succeeded")
			case tc.want == "" && !errors.Is(err, ErrNoRDMA):
				t.Fatalf("WithoutFallback: %v, want ErrNoRDMA", err)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("WithoutFallback: dial error %q, want %q in it", err, tc.want)
			}
		})
	}
}

// A dial returns once TCP is connected, whatever the server does: one
// that never answers leaves a read to its deadline, and Close ends the
// negotiation behind the dial.
func TestDialDoesNotWaitForTheAnswer(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	release := make(chan struct{})
	addr := serveOnce(t, func(c net.Conn) { <-release }).Addr().String()
	defer close(release)
	nc, err := Dial(t.Context(), addr, WithProvider("shm"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Write([]byte(h2Preface)); err != nil {
		t.Fatalf("write before the verdict: %v", err)
	}
	nc.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := nc.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read from a silent server: %v, want the deadline", err)
	}
	// A write that does not fit what a Conn holds waits for the verdict.
	nc.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := nc.Write(make([]byte, maxHeld)); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a write of %d bytes before the verdict: %d, %v; want the deadline", maxHeld, n, err)
	}
	done := make(chan error, 1)
	go func() {
		nc.SetReadDeadline(time.Time{})
		_, err := nc.Read(make([]byte, 1))
		done <- err
	}()
	time.Sleep(20 * time.Millisecond) // fixed: the read must be waiting, a state it does not show
	if err := nc.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("a read waiting for the verdict at Close: %v, want net.ErrClosed", err)
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
	start := clientStart(faults.Name(), nil, clientHost())
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
		ReleaseKits() // closed connections' kits, kept for the next ones
		time.Sleep(10 * time.Millisecond)
	}
	if live.PDs != 0 || live.MRs != 0 || live.CQs != 0 || live.QPs != 0 {
		t.Fatalf("live after the cuts: %+v", live)
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

// Bytes a write handed over before the verdict go out whole, whatever
// deadline is set after it: the write returned, as a TCP write does once
// its bytes are in the socket buffer.
func TestHeldBytesOutlastWriteDeadline(t *testing.T) {
	payload := random(10 << 10)
	got := make(chan []byte, 1)
	addr := serveOnce(t, func(c net.Conn) {
		readClientStart(c)
		time.Sleep(50 * time.Millisecond) // the client writes and sets its deadline meanwhile
		c.Write([]byte("\x00\x00\x00\x04\x00\x00\x00\x00\x00"))
		b := make([]byte, len(payload))
		io.ReadFull(c, b)
		got <- b
	}).Addr().String()
	nc, err := Dial(t.Context(), addr, WithProvider("shm"))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.Write(append([]byte(h2Preface), payload...)); err != nil {
		t.Fatalf("write before the verdict: %v", err)
	}
	nc.SetWriteDeadline(time.Now().Add(-time.Second))
	select {
	case b := <-got:
		if !bytes.Equal(b, payload) {
			t.Fatal("the server read other bytes than were written")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the held bytes never reached the server")
	}
	if _, err := nc.Write([]byte("x")); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a write past the deadline: %v", err)
	}
	nc.SetWriteDeadline(time.Time{})
	if _, err := nc.Write([]byte("x")); err != nil {
		t.Fatalf("a write with the deadline cleared: %v", err)
	}
}

// readClientStart reads an rdmagrpc client's start, as a fake server:
// the preface, and the SETTINGS frame whatever its length.
func readClientStart(c net.Conn) {
	b := make([]byte, len(h2Preface)+9)
	if _, err := io.ReadFull(c, b); err != nil {
		return
	}
	h := b[len(h2Preface):]
	io.ReadFull(c, make([]byte, int(h[0])<<16|int(h[1])<<8|int(h[2])))
}
