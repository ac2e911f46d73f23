//go:build cgo

package verbs

import (
	"context"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// TestVerbsSharedReceiveQueue: a QP asked for 64 receives starts with a
// shared queue of defaultRecvDepth and grows it when one post of 40
// finds it full. The peer's 40 WRITE_WITH_IMMs complete those receives
// in order. In error, the receives still outstanding, and one posted
// after the error, complete as flushed, in order, with nothing more.
func TestVerbsSharedReceiveQueue(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pairWith(t, d, nil, nil, func(c *transport.QPConfig) { c.MaxSendWR, c.MaxRecvWR = 64, 64 })
	q := srv.qp.(*qp)
	if q.rq == nil {
		t.Skipf("%s has no shared receive queues: each QP has a receive queue of its own", q.dev.name)
	}
	if s := q.rq.size; s < defaultRecvDepth || s >= 64 {
		t.Fatalf("shared queue starts with %d WRs, want %d (or what the device rounds it to, below 64)", s, defaultRecvDepth)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 40
	recvs := make([]transport.RecvWR, n)
	for i := range recvs {
		recvs[i].ID = uint64(i)
	}
	if k, err := srv.qp.PostRecv(recvs...); k != n || err != nil {
		t.Fatalf("PostRecv of %d: %d, %v", n, k, err)
	}
	if s := q.rq.size; n > 31 && s < 64 {
		t.Fatalf("shared queue holds %d WRs after a post of %d, want the 64 asked for", s, n)
	}
	postImmWrites(t, cli, srv, n)
	for i := range n {
		if wc := srv.next(ctx); wc.Err() != nil || wc.ID != uint64(i) || wc.Imm != uint32(i) || wc.Opcode != transport.WCRecvRDMAWithImm {
			t.Fatalf("receive %d: %+v", i, wc)
		}
	}
	if wc := cli.next(ctx); wc.Err() != nil || wc.ID != n-1 {
		t.Fatalf("sender's completion %+v", wc)
	}

	for i := range 5 {
		recvs[i].ID = uint64(100 + i)
	}
	if k, err := srv.qp.PostRecv(recvs[:5]...); k != 5 || err != nil {
		t.Fatalf("PostRecv: %d, %v", k, err)
	}
	if err := srv.qp.SetError(); err != nil {
		t.Fatal(err)
	}
	if k, err := srv.qp.PostRecv(transport.RecvWR{ID: 200}); k != 1 || err != nil {
		t.Fatalf("PostRecv in error: %d, %v", k, err)
	}
	for _, id := range []uint64{100, 101, 102, 103, 104, 200} {
		if wc := srv.next(ctx); wc.ID != id || wc.Status != transport.StatusWRFlushErr || wc.QPNum != q.num {
			t.Fatalf("flush of receive %d: %+v", id, wc)
		}
	}
	var wc [8]transport.WorkCompletion
	if k, err := srv.cq.Poll(wc[:]); k != 0 || err != nil {
		t.Fatalf("after the flushes: %+v, %v", wc[:k], err)
	}
}

// postImmWrites posts k WRITE_WITH_IMMs from c into s's memory: write i
// carries c's 8 bytes at i*8 to s's i*8, with immediate i; the last is
// signalled.
func postImmWrites(t *testing.T, c, s *side, k int) {
	t.Helper()
	wrs := make([]transport.SendWR, k)
	for i := range wrs {
		wrs[i] = transport.SendWR{ID: uint64(i), Opcode: transport.OpWriteWithImm, Imm: uint32(i),
			SG: c.sge(i*8, 8), RemoteAddr: s.mr.Addr() + uint64(i*8), RKey: s.mr.RKey(), Signaled: i == k-1}
	}
	if got, err := c.qp.PostSend(wrs...); got != k || err != nil {
		t.Fatalf("PostSend of %d: %d, %v", k, got, err)
	}
}
