//go:build cgo

package verbs

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func poolCounts(p *recvPool) (posted, want int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.posted, p.want
}

// TestVerbsRecvPool: two QPs whose receives carry no data receive from
// the device's pool. Their receives complete in order with the
// consumer's IDs, whichever QP the pool's receives went to; the pool
// keeps as many posted as consumers have outstanding; a receive with an
// SGE is refused; in error the outstanding receives flush with their
// IDs; and a peer that sends beyond the receives posted fails the QP.
func TestVerbsRecvPool(t *testing.T) {
	d := openOrSkip(t)
	imm := func(c *transport.QPConfig) { c.MaxSendWR, c.MaxRecvWR, c.RecvImmOnly = 64, 64, true }
	cli1, srv1 := pairWith(t, d, nil, nil, imm)
	cli2, srv2 := pairWith(t, d, nil, nil, imm)
	q1, q2 := srv1.qp.(*qp), srv2.qp.(*qp)
	if q1.rq == nil || q1.rq.pool == nil {
		t.Skipf("%s has no shared receive queues: no receive pool", q1.dev.name)
	}
	p := q1.rq.pool
	if q2.rq.pool != p {
		t.Fatal("two QPs of one device receive from two pools")
	}
	if q1.attrs.maxRecvSGE != 0 {
		t.Fatalf("a pooled QP allows %d SGEs per receive, want 0", q1.attrs.maxRecvSGE)
	}
	if _, err := srv1.qp.PostRecv(transport.RecvWR{ID: 1, SG: srv1.sge(0, 8)}); !errors.Is(err, transport.ErrInvalidWR) {
		t.Fatalf("a receive with an SGE on a pooled QP: %v, want ErrInvalidWR", err)
	}
	_, base := poolCounts(p) // other QPs of the device may hold receives

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 20
	post := func(s *side, from uint64, k int) {
		t.Helper()
		recvs := make([]transport.RecvWR, k)
		for i := range recvs {
			recvs[i].ID = from + uint64(i)
		}
		if got, err := s.qp.PostRecv(recvs...); got != k || err != nil {
			t.Fatalf("PostRecv of %d: %d, %v", k, got, err)
		}
	}
	post(srv1, 1000, n)
	post(srv2, 2000, n)
	if posted, want := poolCounts(p); want != base+2*n || posted != min(want, p.size) {
		t.Fatalf("after 2 × %d receives: pool has %d posted for %d wanted, want %d for %d", n, posted, want, min(base+2*n, p.size), base+2*n)
	}
	// Interleaved, so that the pool's receives alternate between the QPs.
	for range 2 {
		postImmWrites(t, cli1, srv1, n/2)
		postImmWrites(t, cli2, srv2, n/2)
	}
	for _, e := range []struct {
		s    *side
		from uint64
	}{{srv1, 1000}, {srv2, 2000}} {
		for i := range n {
			if wc := e.s.next(ctx); wc.Err() != nil || wc.ID != e.from+uint64(i) || wc.Imm != uint32(i%(n/2)) || wc.Opcode != transport.WCRecvRDMAWithImm {
				t.Fatalf("receive %d of QP %d: %+v", i, e.s.qp.Num(), wc)
			}
		}
	}
	for _, c := range []*side{cli1, cli2} {
		for range 2 {
			if wc := c.next(ctx); wc.Err() != nil {
				t.Fatalf("sender's completion %+v", wc)
			}
		}
	}
	if posted, want := poolCounts(p); want != base || posted != min(base, p.size) {
		t.Fatalf("after the receives completed: pool has %d posted for %d wanted, want %d for %d", posted, want, min(base, p.size), base)
	}

	// In error, the receives outstanding flush, in order, with their IDs.
	post(srv1, 100, 5)
	if err := srv1.qp.SetError(); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if wc := srv1.next(ctx); wc.ID != uint64(100+i) || wc.Status != transport.StatusWRFlushErr || wc.QPNum != q1.num {
			t.Fatalf("flush of receive %d: %+v", 100+i, wc)
		}
	}
	if _, want := poolCounts(p); want != base {
		t.Fatalf("after the flushes the pool wants %d, want %d", want, base)
	}

	// A peer that sends beyond the receives posted: the QP fails, and
	// the receive posted after the overrun flushes.
	post(srv2, 300, 1)
	postImmWrites(t, cli2, srv2, 2)
	if wc := srv2.next(ctx); wc.Err() != nil || wc.ID != 300 {
		t.Fatalf("the one receive posted: %+v", wc)
	}
	deadline := time.Now().Add(10 * time.Second)
	var wc [4]transport.WorkCompletion
	for srv2.qp.State() != transport.QPSErr {
		// Polling finds the overrun.
		if k, err := srv2.cq.Poll(wc[:]); k != 0 || err != nil {
			t.Fatalf("after the overrun: %+v, %v", wc[:k], err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("QP %d is %v after its peer sent beyond its receives, want ERR", q2.num, srv2.qp.State())
		}
		time.Sleep(time.Millisecond)
	}
	post(srv2, 400, 1)
	if wc := srv2.next(ctx); wc.ID != 400 || wc.Status != transport.StatusWRFlushErr {
		t.Fatalf("a receive posted after the overrun: %+v", wc)
	}
}

// TestVerbsRecvPoolRefillsUnpolled: a pool of 16 serves a QP whose CQ
// nobody polls or arms. Its 40 messages still arrive: when the pool runs
// low the device says so (the SRQ limit event), and the provider drains
// the device's CQs into their views' lanes, which counts the receives
// used, and posts them again. Then the consumer polls all 40, in order.
func TestVerbsRecvPoolRefillsUnpolled(t *testing.T) {
	t.Setenv(RecvPoolEnv, "16")
	// The sender's queue all on the device: held sends have the
	// provider poll the CQ itself (sendhold.go), which would drain it.
	t.Setenv(SendDepthEnv, "0")
	d := openOrSkip(t)
	imm := func(c *transport.QPConfig) { c.MaxSendWR, c.MaxRecvWR, c.RecvImmOnly = 64, 64, true }
	cli, srv := pairWith(t, d, nil, nil, imm)
	q := srv.qp.(*qp)
	if q.rq == nil || q.rq.pool == nil {
		t.Skipf("%s has no shared receive queues: no receive pool", q.dev.name)
	}
	if s := q.rq.pool.size; s != 16 {
		t.Fatalf("pool of %d receives, want the 16 asked for", s)
	}
	const n = 40
	recvs := make([]transport.RecvWR, n)
	for i := range recvs {
		recvs[i].ID = uint64(500 + i)
	}
	if k, err := srv.qp.PostRecv(recvs...); k != n || err != nil {
		t.Fatalf("PostRecv of %d: %d, %v", n, k, err)
	}
	for i := range n {
		cli.mem[i*8] = byte(i + 1)
	}
	postImmWrites(t, cli, srv, n)
	// Neither side polls (the two CQs are views of one device CQ: a
	// poll of either would drain it) until the 40th message is in
	// memory: each found a receive.
	deadline := time.Now().Add(20 * time.Second)
	for srv.mem[(n-1)*8] != n {
		if time.Now().After(deadline) {
			t.Fatalf("message %d not in memory after 20 s: the pool was not refilled while nobody polled", n)
		}
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if k := q.rq.pool.lows.Load(); k == 0 {
		t.Fatal("the pool was refilled without a limit event: who polled?")
	}
	if wc := cli.next(ctx); wc.Err() != nil || wc.ID != n-1 {
		t.Fatalf("sender's completion %+v", wc)
	}
	for i := range n {
		if wc := srv.next(ctx); wc.Err() != nil || wc.ID != uint64(500+i) || wc.Imm != uint32(i) {
			t.Fatalf("receive %d: %+v", i, wc)
		}
	}
}
