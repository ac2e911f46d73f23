//go:build cgo

package verbs

import (
	"context"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// deviceCQE is the size of c's device queue, and whether it has grown.
func deviceCQE(c transport.CQ) (int, bool) {
	q := c.(*cq)
	q.acct.mu.Lock()
	defer q.acct.mu.Unlock()
	return q.cap, q.grown.Load()
}

// TestVerbsCQGrowsBeforeNeeded: a CQ starts with initialCQE entries on a
// device that resizes CQs, stays that small while what may complete fits
// (receives and signaled sends retired as they are polled), and grows to
// the size asked for before a post could bring more.
func TestVerbsCQGrowsBeforeNeeded(t *testing.T) {
	t.Setenv(CQShareEnv, "1") // CQs of their own: views grow otherwise (sharedcq.go)
	d := openOrSkip(t)
	if !d.(*device).cqGrows {
		t.Skip("the device does not resize CQs")
	}
	cli, srv := pair(t, d, nil, nil)
	if n, grown := deviceCQE(srv.cq); grown || n < initialCQE || n >= 64 {
		t.Fatalf("new CQ of 64: device queue of %d entries, grown %v; want %d, not grown", n, grown, initialCQE)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Rounds of 8 receives and 8 sends, each retired before the next:
	// 40 completions on each CQ in all, never more than 8 outstanding.
	for round := range 5 {
		var recvs []transport.RecvWR
		var sends []transport.SendWR
		for i := range 8 {
			recvs = append(recvs, transport.RecvWR{ID: uint64(i), SG: srv.sge(i*64, 64)})
			sends = append(sends, transport.SendWR{ID: uint64(i), Opcode: transport.OpSend, SG: cli.sge(0, 8),
				Signaled: i%4 == 3}) // unsignaled ones retire with the next signaled one
		}
		if n, err := srv.qp.PostRecv(recvs...); n != 8 || err != nil {
			t.Fatalf("round %d: PostRecv: %d, %v", round, n, err)
		}
		if n, err := cli.qp.PostSend(sends...); n != 8 || err != nil {
			t.Fatalf("round %d: PostSend: %d, %v", round, n, err)
		}
		for range 8 {
			if wc := srv.next(ctx); wc.Err() != nil || wc.Opcode != transport.WCRecv {
				t.Fatalf("round %d: receive %+v", round, wc)
			}
		}
		for range 2 {
			if wc := cli.next(ctx); wc.Err() != nil || wc.Opcode != transport.WCSend {
				t.Fatalf("round %d: send %+v", round, wc)
			}
		}
	}
	for _, s := range []*side{cli, srv} {
		if n, grown := deviceCQE(s.cq); grown || n >= 64 {
			t.Fatalf("after 40 retired completions: device queue of %d entries, grown %v", n, grown)
		}
	}
	// 16 receives at once pass initialCQE: the queue grows first.
	var recvs []transport.RecvWR
	for i := range 16 {
		recvs = append(recvs, transport.RecvWR{ID: uint64(100 + i), SG: srv.sge(i*64, 64)})
	}
	if n, err := srv.qp.PostRecv(recvs...); n != 16 || err != nil {
		t.Fatalf("PostRecv 16: %d, %v", n, err)
	}
	if n, grown := deviceCQE(srv.cq); !grown || n < 64 {
		t.Fatalf("after 16 receives: device queue of %d entries, grown %v; want ≥ 64, grown", n, grown)
	}
	if got := srv.cq.Cap(); got < 64 {
		t.Fatalf("Cap %d after growing, want ≥ 64", got)
	}
	// The grown queue still delivers, the armed notification included.
	if n, err := cli.qp.PostSend(transport.SendWR{ID: 9, Opcode: transport.OpSend, SG: cli.sge(0, 8), Signaled: true}); n != 1 || err != nil {
		t.Fatalf("PostSend: %d, %v", n, err)
	}
	if wc := srv.next(ctx); wc.Err() != nil || wc.ID != 100 {
		t.Fatalf("receive after growing: %+v", wc)
	}
	if wc := cli.next(ctx); wc.Err() != nil || wc.ID != 9 {
		t.Fatalf("send: %+v", wc)
	}
	// Cap grows a queue too: it promises the entries.
	if n, grown := deviceCQE(cli.cq); grown {
		t.Fatalf("client CQ grew (%d entries) with at most 8 outstanding", n)
	}
	if got := cli.cq.Cap(); got < 64 {
		t.Fatalf("Cap %d, want ≥ 64", got)
	}
	if _, grown := deviceCQE(cli.cq); !grown {
		t.Fatal("Cap did not grow the queue")
	}
}
