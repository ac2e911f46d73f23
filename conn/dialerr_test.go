package conn

import (
	"context"
	"errors"
	"net"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fullBacklog listens on loopback with an accept queue of one that it
// never accepts from, and fills it: the kernel then drops further SYNs,
// so a dial to it waits until its deadline.
func fullBacklog(t *testing.T) string {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := (&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: sa.(*unix.SockaddrInet4).Port}).String()
	// Fill the queue: connections that complete until one does not.
	for range 8 {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		cancel()
		if err != nil {
			return addr
		}
		t.Cleanup(func() { c.Close() })
	}
	t.Skip("the kernel kept completing connections to a listener that never accepts: cannot make a dial time out here")
	return ""
}

// silent is a TCP server that accepts and never writes.
func silent(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	return l.Addr().String()
}

// A dial that times out fails as net.Dialer's does: errors.Is finds
// context.DeadlineExceeded and the error is a net.Error whose Timeout
// is true; whether TCP's connect timed out or (WithoutFallback, which
// waits for it) the negotiation.
func TestDialTimeoutIsTCPs(t *testing.T) {
	addr := fullBacklog(t)
	for _, tc := range []struct {
		name string
		addr string
		opts []Option
	}{
		{"connect", addr, nil},
		{"connect/WithoutFallback", addr, []Option{WithoutFallback()}},
		{"negotiation/WithoutFallback", silent(t), []Option{WithoutFallback()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			start := time.Now()
			c, err := Dial(ctx, tc.addr, tc.opts...)
			if err == nil {
				c.Close()
				t.Fatalf("dial to %s succeeded", tc.addr)
			}
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("dial: %v; want an error that is context.DeadlineExceeded", err)
			}
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				t.Errorf("dial: %v; want a net.Error whose Timeout is true", err)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("the dial returned after %v, its deadline was 300ms", d)
			}
			t.Log(err)
		})
	}
}

// A dial to a network this host has no route to fails at once with TCP's
// error: errors.Is finds syscall.ENETUNREACH. The dial runs on a thread
// moved to a network namespace of its own, with no route at all.
func TestDialUnreachableIsTCPs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, for a network namespace")
	}
	type result struct {
		err error
		ns  error
	}
	done := make(chan result, 1)
	go func() {
		// The thread is left locked: it ends with the goroutine rather
		// than go back to the runtime in the other namespace.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- result{ns: err}
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, err := Dial(ctx, "198.51.100.7:50051")
		if err == nil {
			c.Close()
		}
		done <- result{err: err}
	}()
	r := <-done
	if r.ns != nil {
		t.Skipf("no network namespace here: %v", r.ns)
	}
	if !errors.Is(r.err, syscall.ENETUNREACH) {
		t.Fatalf("dial with no route: %v; want an error that is syscall.ENETUNREACH", r.err)
	}
	var ne net.Error
	if !errors.As(r.err, &ne) || ne.Timeout() {
		t.Errorf("dial: %v; want a net.Error that is not a time-out", r.err)
	}
	t.Log(r.err)
}
