//go:build cgo

package verbs

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport/transporttest"
)

// The shared conformance suite over real verbs; it runs where a device
// exists (the tests/rxe guest) and skips elsewhere.
func TestConformance(t *testing.T) {
	for _, cross := range []bool{false, true} {
		name := map[bool]string{false: "OneProcess", true: "TwoProcesses"}[cross]
		t.Run(name, func(t *testing.T) {
			d := openOrSkip(t)
			addr := net.JoinHostPort(hostIP(t, d), "0")
			transporttest.Run(t, transporttest.Harness{Provider: Name, Device: d.Name(), ListenAddr: addr, CrossProcess: cross})
		})
	}
}

// agentPort is the TCP port of the conformance peer agent in guest b.
const agentPort = "7472"

// TestRXEPairConformance is the suite across two Soft-RoCE hosts (the
// two-guest mode of tests/rxe): guest a runs every case's local half and
// listens on its own address; guest b runs a peer agent that starts each
// peer half as a process of its own, which connects over the emulated
// link. The control channel between the halves is TCP over that link.
func TestRXEPairConformance(t *testing.T) {
	role := pairRole(t)
	d := openOrSkip(t)
	if role == "b" {
		l, err := net.Listen("tcp", net.JoinHostPort(os.Getenv("RXE_ADDR"), agentPort))
		if err != nil {
			t.Fatal(err)
		}
		// Guest a stops the agent when its suite is done; this bounds a
		// run whose guest a never came up.
		ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
		defer cancel()
		if err := transporttest.ServeAgent(ctx, l, t.Logf); err != nil {
			t.Fatal(err)
		}
		return
	}
	agent := net.JoinHostPort(os.Getenv("RXE_PEER"), agentPort)
	t.Cleanup(func() {
		if err := transporttest.StopAgent(agent); err != nil {
			t.Errorf("stop the peer agent in guest b: %v", err)
		}
	})
	transporttest.Run(t, transporttest.Harness{
		Provider:   Name,
		Device:     d.Name(),
		ListenAddr: net.JoinHostPort(os.Getenv("RXE_ADDR"), "0"),
		PeerAgent:  agent,
	})
}
