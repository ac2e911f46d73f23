package conn_test

import (
	"context"
	"io"
	"strings"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// envKillPeer runs the peer process of TestPeerKilledInEachPhase (package
// conn): "phase address".
const envKillPeer = "RDMAGRPC_CONN_TEST_KILL_PEER"

// killPeer is that peer: it dials, waits for one byte (so that the test
// has set up its side), then reads everything and writes messages of its
// phase's size until it is killed.
func killPeer(spec string) int {
	phase, addr, _ := strings.Cut(spec, " ")
	// The test's listener is over shm whatever the default provider is
	// (verbs, in the rxe guest).
	opts := []conn.Option{conn.WithAckTimeout(time.Minute, 0), conn.WithProvider("shm"), conn.WithIdleShrink(50 * time.Millisecond)}
	size := map[string]int{"small": 100, "enlarging-peer-waits": 64 << 10, "large": 40 << 10, "rendezvous": 8 << 20}[phase]
	if phase == "enlarging-we-wait" {
		// Never answer an enlargement request: hold every control
		// record's arrival (and what follows it) for a minute.
		shm, err := transport.Get("shm")
		if err != nil {
			return 1
		}
		inj := fault.Wrap(shm, "kill-peer-hold", fault.Rule{Op: fault.OpCompletion, Action: fault.ActDelay, Delay: time.Minute,
			WCOpcodes: []transport.WCOpcode{transport.WCRecvRDMAWithImm},
			Match:     func(ev *fault.Event) bool { return ev.WC.Imm>>29 == 4 }})
		transport.Register(inj)
		opts = append(opts, conn.WithProvider(inj.Name()))
	}
	c, err := conn.Dial(context.Background(), addr, opts...)
	if err != nil {
		return 1
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		return 1
	}
	go io.Copy(io.Discard, c)
	if phase == "shrinking" {
		// 26 large messages, then idle: the direction shrinks.
		for range 26 {
			if _, err := c.Write(make([]byte, 40<<10)); err != nil {
				return 1
			}
		}
		select {}
	}
	if size == 0 {
		select {}
	}
	msg := make([]byte, size)
	for {
		if _, err := c.Write(msg); err != nil {
			return 1
		}
	}
}
