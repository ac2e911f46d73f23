package conn_test

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// writeForever is the peer process of TestPeerKilled: it dials and writes
// small and large messages until it is killed.
func writeForever(addr string) int {
	c, err := conn.Dial(context.Background(), addr)
	if err != nil {
		return 1
	}
	msg := make([]byte, 40<<10) // above the threshold: the direction enlarges
	for i := 0; ; i++ {
		if _, err := c.Write(msg[:1+i%len(msg)]); err != nil {
			return 1
		}
	}
}

// A peer killed mid-stream (SIGKILL, in the large phase): the other side's
// Read drains what arrived, then fails promptly; Write fails too.
func TestPeerKilled(t *testing.T) {
	l, err := conn.Listen(context.Background(), testAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envWriter+"="+l.Addr().String())
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	c, err := l.Accept()
	if err != nil {
		cmd.Process.Kill()
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.ReadFull(c, make([]byte, 1<<20)); err != nil { // the peer is mid-stream
		cmd.Process.Kill()
		t.Fatal(err)
	}
	if s := c.(*conn.Conn).Stats(); s.RecvPhase != "large" {
		t.Errorf("peer's direction in phase %q, want large", s.RecvPhase)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	done := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, c)
		if err == nil {
			err = io.EOF // io.Copy reports a clean end as nil
		}
		done <- err
	}()
	select {
	case err := <-done:
		if errors.Is(err, io.EOF) {
			t.Fatalf("read after the peer was killed: clean EOF, want an error saying the connection was lost")
		}
		t.Logf("read after kill: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("read still blocked 30 s after the peer was killed")
	}
	if _, err := c.Write([]byte("x")); err == nil {
		t.Fatal("write to a killed peer succeeded")
	}
}
