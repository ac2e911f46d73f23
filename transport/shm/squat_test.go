package shm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A dial to 127.0.0.1:P tries the socket name of 127.0.0.1:P first and
// that of *:P next. Both are abstract names, which any local user may
// bind: a process of another user that binds the first name while a
// server listens on the wildcard must not be handed the dialer's request
// and memory files. The squatter here runs as uid 65534 and counts every
// byte and descriptor that reaches it.

const squatEnv = "RDMAGRPC_SHM_SQUAT" // helper mode: the socket name to bind

// squatter binds name as a SOCK_SEQPACKET listener, prints READY, and
// reads every connection it accepts until its stdin closes; then it
// prints how many connections, bytes and descriptors it received.
func squatter(name string) error {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: name}); err != nil {
		return fmt.Errorf("bind %s: %w", name, err)
	}
	if err := unix.Listen(fd, 64); err != nil {
		return err
	}
	type counts struct{ conns, bytes, fds int }
	got := make(chan counts, 1)
	go func() {
		var c counts
		for {
			nfd, _, err := unix.Accept4(fd, unix.SOCK_CLOEXEC)
			if err != nil {
				got <- c
				return
			}
			c.conns++
			// Whatever a dialer sends right after connect arrives within
			// a second; a dialer that refused this process sends nothing
			// and closes.
			unix.SetsockoptTimeval(nfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1})
			buf, oob := make([]byte, 4096), make([]byte, 1024)
			for {
				n, oobn, _, _, err := unix.Recvmsg(nfd, buf, oob, 0)
				if err != nil || n == 0 && oobn == 0 {
					break
				}
				c.bytes += n
				if oobn > 0 {
					if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
						for _, m := range msgs {
							if fds, err := unix.ParseUnixRights(&m); err == nil {
								c.fds += len(fds)
							}
						}
					}
				}
			}
			unix.Close(nfd)
		}
	}()
	fmt.Println("READY")
	bufio.NewReader(os.Stdin).ReadString('\n') // until the test closes stdin
	unix.Shutdown(fd, unix.SHUT_RDWR)          // ends the accept loop
	c := <-got
	fmt.Printf("conns=%d bytes=%d fds=%d\n", c.conns, c.bytes, c.fds)
	return nil
}

// startSquatter runs the squatter as uid 65534 on the socket name of
// ip:port; stop closes its stdin and returns what it received.
func startSquatter(t *testing.T, ip netip.Addr, port int) (stop func() string) {
	t.Helper()
	const nobody = 65534
	// t.TempDir's parent is 0700: the copy must be reachable by uid 65534.
	dir, err := os.MkdirTemp("", "squat")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "shm.test")
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), squatEnv+"="+sockName(ip, port))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	r, in := startChild(t, cmd)
	if line, err := r.ReadString('\n'); err != nil || strings.TrimSpace(line) != "READY" {
		t.Fatalf("squatter as uid %d did not start: %q %v", nobody, line, err)
	}
	return func() string {
		in.Close()
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("squatter's counts: %v", err)
		}
		return strings.TrimSpace(line)
	}
}

func TestSquatterOnTheSpecificNameGetsNothing(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to run the squatter as another user")
	}
	loop := netip.AddrFrom4([4]byte{127, 0, 0, 1})

	t.Run("wildcard server", func(t *testing.T) {
		srv := openSide(t, 64)
		l, err := srv.dev.Listen("0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		port := addrPort(l.Addr()).Port()
		stop := startSquatter(t, loop, int(port))
		cli := openSide(t, 64)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		errc := make(chan error, 1)
		go func() {
			r, err := l.Accept(ctx)
			if err == nil {
				srv.qp, err = r.Accept(ctx, srv.cfg(), []byte("the server"))
			}
			errc <- err
		}()
		cli.qp, err = cli.dev.Connect(ctx, "127.0.0.1:"+strconv.Itoa(int(port)), cli.cfg(), []byte("hello"))
		if err != nil {
			t.Fatalf("dial past the squatter: %v", err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimRight(string(cli.qp.PeerPrivate()), "\x00"); got != "the server" {
			t.Fatalf("answered by %q", got)
		}
		if got := stop(); got != "conns=1 bytes=0 fds=0" {
			t.Fatalf("the squatter received %s; want only the refused connection", got)
		}
	})

	t.Run("squatter alone", func(t *testing.T) {
		port := 20000 + os.Getpid()%20000
		stop := startSquatter(t, loop, port)
		cli := openSide(t, 64)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := cli.dev.Connect(ctx, "127.0.0.1:"+strconv.Itoa(port), cli.cfg(), []byte("hello"))
		if !errors.Is(err, transport.ErrListenerRefused) || !strings.Contains(err.Error(), "uid 65534 listens there") {
			t.Fatalf("dial to a squatter alone: %v", err)
		}
		// The early dial and the router's dial check the same way.
		if _, err := cli.dev.(transport.Router).DeviceFor(ctx, "127.0.0.1:"+strconv.Itoa(port)); !errors.Is(err, transport.ErrListenerRefused) {
			t.Fatalf("DeviceFor to a squatter: %v", err)
		}
		if got := stop(); got != "conns=2 bytes=0 fds=0" {
			t.Fatalf("the squatter received %s; want two refused connections", got)
		}
	})

	t.Run("check admits", func(t *testing.T) {
		port := 20001 + os.Getpid()%20000
		stop := startSquatter(t, loop, port)
		cli := openSide(t, 64)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var seen int
		ctx = transport.ContextWithPeerCheck(ctx, func(pid, uid, gid int) error {
			seen = uid
			return nil
		})
		// The squatter never answers: the dial ends at its deadline, after
		// the check let the request through.
		dctx, dcancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer dcancel()
		if _, err := cli.dev.Connect(dctx, "127.0.0.1:"+strconv.Itoa(port), cli.cfg(), []byte("hello")); err == nil {
			t.Fatal("a dial the squatter never answered succeeded")
		}
		if seen != 65534 {
			t.Fatalf("the check saw uid %d", seen)
		}
		if got := stop(); !strings.HasPrefix(got, "conns=1 bytes=") || strings.HasPrefix(got, "conns=1 bytes=0 ") {
			t.Fatalf("with a check that admits uid 65534 the squatter received %s; want the request", got)
		}
	})
}
