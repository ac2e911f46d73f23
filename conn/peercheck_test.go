package conn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// TestPeerCheckHelper is the other user's process of TestPeerCheck: it
// dials RDMAGRPC_PEERCHECK_DIAL over shm and says what happened.
func TestPeerCheckHelper(t *testing.T) {
	addr := os.Getenv("RDMAGRPC_PEERCHECK_DIAL")
	if addr == "" {
		t.Skip("the helper of TestPeerCheck")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, addr, WithProvider("shm"))
	if err == nil {
		if err = c.(*Conn).Handshake(ctx); err != nil {
			c.Close()
		}
	}
	if err != nil {
		fmt.Printf("DIAL-ERR refused=%v: %v\n", errors.Is(err, ErrPeerRefused), err)
		return
	}
	c.Write([]byte("hi"))
	c.Close()
	fmt.Println("DIAL-OK")
}

// An abstract unix socket has no permissions: any user of the network
// namespace could dial a shm listener and be handed its memory. A
// listener now admits only its own user unless WithPeerCheck says
// otherwise; a refused dialer gets an error saying why, and nothing.
func TestPeerCheck(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to run a dialer as another user")
	}
	const nobody = 65534
	dir, err := os.MkdirTemp("", "peercheck")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "conn.test")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if err := copyExe(self, bin); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dialAsNobody := func(addr string) string {
		cmd := exec.Command(bin, "-test.run=^TestPeerCheckHelper$", "-test.v")
		cmd.Env = append(os.Environ(), "RDMAGRPC_PEERCHECK_DIAL="+addr)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("helper as uid %d: %v\n%s", nobody, err, out)
		}
		return string(out)
	}
	listen := func(opts ...Option) (string, *atomic.Int32) {
		ctx := context.Background()
		l, err := Listen(ctx, "127.0.0.1:0", append([]Option{WithProvider("shm")}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		var accepted atomic.Int32
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted.Add(1)
				io.Copy(io.Discard, c)
				c.Close()
			}
		}()
		return l.Addr().String(), &accepted
	}

	t.Run("default refuses another user", func(t *testing.T) {
		addr, accepted := listen()
		out := dialAsNobody(addr)
		if !strings.Contains(out, "DIAL-ERR refused=true") || !strings.Contains(out, fmt.Sprintf("uid %d is not the listener's", nobody)) {
			t.Fatalf("dial as uid %d:\n%s", nobody, out)
		}
		if accepted.Load() != 0 {
			t.Fatal("the listener accepted the refused dialer")
		}
		t.Logf("as uid %d: %s", nobody, strings.TrimSpace(strings.Split(out, "DIAL-ERR ")[1]))
	})
	t.Run("check widens", func(t *testing.T) {
		var seenUID, seenPID atomic.Int32
		addr, accepted := listen(WithPeerCheck(func(pid, uid, gid int) error {
			seenUID.Store(int32(uid))
			seenPID.Store(int32(pid))
			if uid == nobody || uid == 0 {
				return nil
			}
			return fmt.Errorf("uid %d not allowed", uid)
		}))
		if out := dialAsNobody(addr); !strings.Contains(out, "DIAL-OK") {
			t.Fatalf("dial as uid %d with the check admitting it:\n%s", nobody, out)
		}
		if seenUID.Load() != nobody || seenPID.Load() <= 0 || seenPID.Load() == int32(os.Getpid()) {
			t.Errorf("the check saw uid %d pid %d", seenUID.Load(), seenPID.Load())
		}
		testutil.Eventually(t, 10*time.Second, "accepted.Load() == 1", testutil.Bool(func() bool { return accepted.Load() == 1 }))
	})
	t.Run("check narrows", func(t *testing.T) {
		addr, _ := listen(WithPeerCheck(func(pid, uid, gid int) error { return errors.New("no thanks") }))
		c, err := Dial(context.Background(), addr, WithProvider("shm"))
		if err == nil {
			err = c.(*Conn).Handshake(context.Background())
			c.Close()
		}
		if !errors.Is(err, ErrPeerRefused) || !strings.Contains(err.Error(), "no thanks") {
			t.Fatalf("dial refused by the check: %v", err)
		}
	})
	t.Run("remote peers", func(t *testing.T) {
		l, err := Listen(context.Background(), testAddr(), WithProvider(leaks.Name()), WithPeerCheck(func(int, int, int) error { return nil }))
		if err == nil {
			l.Close()
			t.Fatal("WithPeerCheck accepted on a provider that cannot tell who its peers are")
		}
	})
}

func copyExe(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o755)
}
