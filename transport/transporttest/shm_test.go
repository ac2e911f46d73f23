package transporttest_test

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport/transporttest"

	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
)

func TestMain(m *testing.M) {
	transporttest.MaybeRunPeer()
	os.Exit(m.Run())
}

func TestShmOneProcess(t *testing.T) {
	transporttest.Run(t, transporttest.Harness{Provider: "shm", ListenAddr: "127.0.0.1:0"})
}

func TestShmTwoProcesses(t *testing.T) {
	transporttest.Run(t, transporttest.Harness{Provider: "shm", ListenAddr: "127.0.0.1:0", CrossProcess: true})
}

// The peer-agent path on one host: the agent serves from this process
// and starts each peer half as a child, as it does in the second guest
// of the rxe tier.
func TestShmPeerAgent(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- transporttest.ServeAgent(ctx, l, t.Logf) }()
	transporttest.Run(t, transporttest.Harness{Provider: "shm", ListenAddr: "127.0.0.1:0", PeerAgent: l.Addr().String()})
	if err := transporttest.StopAgent(l.Addr().String()); err != nil {
		t.Errorf("stop agent: %v", err)
	}
	if err := <-served; err != nil {
		t.Errorf("agent: %v", err)
	}
}
