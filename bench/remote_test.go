package bench

import (
	"context"
	"net"
	"testing"
	"time"
)

// A server child started through a spawner (the other host's, here this
// one's) serves as a local one does, on the spawner's host address, and
// the spawner exits when the bench says it is over.
func TestRemoteChild(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- Spawn(context.Background(), l, "127.0.0.1") }()
	t.Setenv(RemoteEnv, l.Addr().String())
	if !Remote() {
		t.Fatal("Remote() false with the spawner set")
	}
	s, err := startServer(TCP, "")
	if err != nil {
		t.Fatal(err)
	}
	host, _, err := net.SplitHostPort(s.raw)
	if err != nil || host != "127.0.0.1" {
		t.Errorf("remote child listens on %q (%v), want the spawner's host", s.raw, err)
	}
	c, err := net.Dial("tcp", s.raw)
	if err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, 100<<10)
	if _, err := c.Write(payload); err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).CloseWrite()
	var n [8]byte
	if _, err := c.Read(n[:]); err != nil {
		t.Fatalf("the sink's count: %v", err)
	}
	c.Close()
	if cpu, err := s.cpu(); err != nil || cpu <= 0 {
		t.Errorf("remote child's CPU time %v, %v", cpu, err)
	}
	s.stop()
	if err := StopRemote(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("spawner: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("spawner still running after StopRemote")
	}
	if c, err := net.DialTimeout("tcp", l.Addr().String(), time.Second); err == nil {
		c.Close()
		t.Error("the spawner's listener is still open")
	}
}
