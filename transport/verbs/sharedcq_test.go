//go:build cgo

package verbs

import (
	"context"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// TestVerbsSharedCQ: the CQs of several connections are views of one
// device CQ; each view gets its own QPs' completions only, whoever polls
// the device queue, and an armed view is woken by a completion another
// view's poll took for it. A view takes its entries of the shared CQ
// when a post needs them, and the last view to close destroys it.
func TestVerbsSharedCQ(t *testing.T) {
	d := openOrSkip(t)
	dev := d.(*device)
	if !dev.cqGrows {
		t.Skip("the device does not resize CQs: each CQ has a device queue of its own")
	}
	a1, b1 := pair(t, d, nil, nil)
	a2, b2 := pair(t, d, nil, nil)
	sides := []*side{a1, b1, a2, b2}
	sh := a1.cq.(*cq).sh
	for i, s := range sides {
		if c := s.cq.(*cq); c.sh == nil || c.sh != sh {
			t.Fatalf("CQ %d is not a view of the first one's shared CQ (%p, %p)", i, c.sh, sh)
		}
	}
	sh.mu.Lock()
	allot, views := sh.allot, len(sh.views)
	sh.mu.Unlock()
	if views != 4 || allot != 4*initialCQE {
		t.Fatalf("shared CQ: %d views, %d entries allotted; want 4 and %d", views, allot, 4*initialCQE)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// b2 is armed and waits; a1's traffic and b2's go through the device
	// queue together, and only a1 polls.
	if _, err := b2.qp.PostRecv(transport.RecvWR{ID: 200, SG: b2.sge(0, 64)}); err != nil {
		t.Fatal(err)
	}
	if _, err := b1.qp.PostRecv(transport.RecvWR{ID: 100, SG: b1.sge(0, 64)}); err != nil {
		t.Fatal(err)
	}
	if n, err := b2.cq.Poll(make([]transport.WorkCompletion, 1)); n != 0 || err != nil {
		t.Fatalf("b2 polled %d, %v before anything was sent", n, err)
	}
	if err := b2.cq.ReqNotify(); err != nil {
		t.Fatal(err)
	}
	woke := make(chan error, 1)
	go func() { woke <- b2.cq.Wait(ctx) }()
	if _, err := a2.qp.PostSend(transport.SendWR{ID: 20, Opcode: transport.OpSend, SG: a2.sge(0, 8), Signaled: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := a1.qp.PostSend(transport.SendWR{ID: 10, Opcode: transport.OpSend, SG: a1.sge(0, 8), Signaled: true}); err != nil {
		t.Fatal(err)
	}
	if wc := a1.next(ctx); wc.Err() != nil || wc.ID != 10 || wc.QPNum != a1.qp.Num() {
		t.Fatalf("a1's send: %+v", wc)
	}
	// Let a1's polls take what b2 and the others got from the device.
	deadline := time.Now().Add(10 * time.Second)
	for {
		sh.mu.Lock()
		waiting := len(b2.cq.(*cq).lane)
		sh.mu.Unlock()
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("b2's receive never reached its lane through a1's polls")
		}
		a1.cq.Poll(make([]transport.WorkCompletion, 1))
		time.Sleep(time.Millisecond)
	}
	select {
	case err := <-woke:
		if err != nil {
			t.Fatalf("b2's Wait: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("b2 armed, its completion taken by a1's poll: never woken")
	}
	if wc := b2.next(ctx); wc.Err() != nil || wc.ID != 200 || wc.QPNum != b2.qp.Num() || wc.Opcode != transport.WCRecv {
		t.Fatalf("b2's receive: %+v", wc)
	}
	if wc := a2.next(ctx); wc.Err() != nil || wc.ID != 20 || wc.QPNum != a2.qp.Num() {
		t.Fatalf("a2's send: %+v", wc)
	}
	if wc := b1.next(ctx); wc.Err() != nil || wc.ID != 100 || wc.QPNum != b1.qp.Num() {
		t.Fatalf("b1's receive: %+v", wc)
	}

	// Sixteen receives pass a view's first entries: it takes the 64 its
	// CQ was created for, and the device queue holds every allotment.
	var recvs []transport.RecvWR
	for i := range 16 {
		recvs = append(recvs, transport.RecvWR{ID: uint64(300 + i), SG: b1.sge(i*64, 64)})
	}
	if n, err := b1.qp.PostRecv(recvs...); n != 16 || err != nil {
		t.Fatalf("PostRecv 16: %d, %v", n, err)
	}
	sh.mu.Lock()
	allot, dcap := sh.allot, sh.cap
	sh.mu.Unlock()
	if allot != 3*initialCQE+64 || dcap < allot {
		t.Fatalf("after 16 receives on one view: %d entries allotted in a device queue of %d; want %d, held", allot, dcap, 3*initialCQE+64)
	}
	for i := range 16 {
		if _, err := a1.qp.PostSend(transport.SendWR{ID: uint64(i), Opcode: transport.OpSend, SG: a1.sge(0, 8), Signaled: true}); err != nil {
			t.Fatal(err)
		}
		if wc := a1.next(ctx); wc.Err() != nil {
			t.Fatalf("send %d: %+v", i, wc)
		}
	}
	for i := range 16 {
		if wc := b1.next(ctx); wc.Err() != nil || wc.ID != uint64(300+i) {
			t.Fatalf("receive %d: %+v", i, wc)
		}
	}

	// A view that QPs use refuses to close, as verbs refuses to destroy
	// such a CQ; the last view closed destroys the shared one.
	if err := a1.cq.Close(); err == nil {
		t.Fatal("Close of a view with a QP on it succeeded")
	}
	for _, s := range sides {
		if err := s.qp.Close(); err != nil {
			t.Fatalf("QP.Close: %v", err)
		}
	}
	for _, s := range sides {
		if err := s.cq.Close(); err != nil {
			t.Fatalf("CQ.Close: %v", err)
		}
	}
	dev.sharedMu.Lock()
	left := len(dev.shared)
	dev.sharedMu.Unlock()
	if left != 0 {
		t.Fatalf("%d shared CQs left after every view closed", left)
	}
}

// TestVerbsSharedCQClosedUnderEvents: the last views of a shared CQ
// close while its completion events are in flight; the event handler,
// which holds no view, must find the device CQ gone rather than poll it.
func TestVerbsSharedCQClosedUnderEvents(t *testing.T) {
	d := openOrSkip(t)
	if !d.(*device).cqGrows {
		t.Skip("the device does not resize CQs: each CQ has a device queue of its own")
	}
	for round := range 20 {
		cli, srv := pair(t, d, nil, nil)
		if _, err := srv.qp.PostRecv(transport.RecvWR{ID: 1, SG: srv.sge(0, 64)}); err != nil {
			t.Fatal(err)
		}
		for _, s := range []*side{cli, srv} {
			if err := s.cq.ReqNotify(); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := cli.qp.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpSend, SG: cli.sge(0, 8), Signaled: true}); err != nil {
			t.Fatal(err)
		}
		for _, s := range []*side{cli, srv} {
			if err := s.qp.Close(); err != nil {
				t.Fatalf("round %d: QP.Close: %v", round, err)
			}
		}
		for _, s := range []*side{cli, srv} {
			if err := s.cq.Close(); err != nil {
				t.Fatalf("round %d: CQ.Close: %v", round, err)
			}
		}
	}
}
