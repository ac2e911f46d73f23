//go:build cgo

package verbs

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// TestVerbsSendsBeyondTheDeviceQueue: a QP asked for 16 send WRs keeps
// defaultSendDepth on the device and holds the rest. One post of 16
// WRITE_WITH_IMMs, inline from a slice the caller reuses at once and
// from registered memory by turns, reaches the peer whole and in order
// while the sender never polls; the sender then sees the completions it
// asked for and no other. In error, every WR (held ones too) completes
// as flushed, in order.
func TestVerbsSendsBeyondTheDeviceQueue(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pair(t, d, nil, nil)
	q := cli.qp.(*qp)
	if q.hold == nil || int(q.cfgC.max_send_wr) >= 16 {
		t.Fatalf("QP asked for 16 send WRs: %d on the device, hold %v; want %d and a hold", q.cfgC.max_send_wr, q.hold != nil, defaultSendDepth)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 16
	var recvs []transport.RecvWR
	for i := range n {
		recvs = append(recvs, transport.RecvWR{ID: uint64(i)})
	}
	if k, err := srv.qp.PostRecv(recvs...); k != n || err != nil {
		t.Fatalf("PostRecv: %d, %v", k, err)
	}
	want := func(i int) []byte { return bytes.Repeat([]byte{byte('a' + i)}, 48) }
	var wrs []transport.SendWR
	var data [][]byte
	for i := range n {
		wr := transport.SendWR{ID: uint64(100 + i), Opcode: transport.OpWriteWithImm, Imm: uint32(i),
			RemoteAddr: srv.mr.Addr() + uint64(i*64), RKey: srv.mr.RKey(), Signaled: i == 9 || i == n-1}
		if i%2 == 0 {
			wr.Inline, wr.Data = true, want(i)
			data = append(data, wr.Data)
		} else {
			copy(cli.mem[i*64:], want(i))
			wr.SG = cli.sge(i*64, 48)
		}
		wrs = append(wrs, wr)
	}
	if k, err := cli.qp.PostSend(wrs...); k != n || err != nil {
		t.Fatalf("PostSend: %d, %v", k, err)
	}
	// The inline bytes are the caller's again: a held WR has its copy.
	for _, b := range data {
		clear(b)
	}
	if h := q.hold.everHeld.Load(); h < n-defaultSendDepth {
		t.Fatalf("%d of %d WRs waited for the device, want at least %d", h, n, n-defaultSendDepth)
	}
	for i := range n {
		wc := srv.next(ctx)
		if wc.Err() != nil || wc.Opcode != transport.WCRecvRDMAWithImm || wc.Imm != uint32(i) {
			t.Fatalf("receive %d: %+v", i, wc)
		}
		if got := srv.mem[i*64 : i*64+48]; !bytes.Equal(got, want(i)) {
			t.Fatalf("write %d landed %q, want %q", i, got, want(i))
		}
	}
	for _, id := range []uint64{109, 115} {
		if wc := cli.next(ctx); wc.Err() != nil || wc.ID != id {
			t.Fatalf("sender's completion %+v, want ID %d", wc, id)
		}
	}
	var wc [8]transport.WorkCompletion
	if k, err := cli.cq.Poll(wc[:]); k != 0 || err != nil {
		t.Fatalf("completions not asked for: %+v, %v", wc[:k], err)
	}

	// In error: 16 WRs, one signaled, all flushed in order.
	if err := cli.qp.SetError(); err != nil {
		t.Fatal(err)
	}
	wrs = wrs[:0]
	for i := range n {
		wrs = append(wrs, transport.SendWR{ID: uint64(200 + i), Opcode: transport.OpWrite, SG: cli.sge(0, 8),
			RemoteAddr: srv.mr.Addr(), RKey: srv.mr.RKey(), Signaled: i == 3})
	}
	if k, err := cli.qp.PostSend(wrs...); k != n || err != nil {
		t.Fatalf("PostSend in error: %d, %v", k, err)
	}
	for i := range n {
		if wc := cli.next(ctx); wc.ID != uint64(200+i) || wc.Status != transport.StatusWRFlushErr {
			t.Fatalf("flush %d: %+v", i, wc)
		}
	}
}

// TestVerbsPollOfOneSeesPastUnaskedCompletions: behind completions the
// provider asked for and drops, a Poll with room for one still finds the
// consumer's. A batch the provider dropped whole once read as an empty
// queue: the consumer armed it and waited for an event that had come.
func TestVerbsPollOfOneSeesPastUnaskedCompletions(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pairWith(t, d, nil, nil, func(c *transport.QPConfig) { c.MaxSendWR = 64 })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 64 // fifteen the provider signaled before the one asked for
	var wrs []transport.SendWR
	for i := range n {
		wrs = append(wrs, transport.SendWR{ID: uint64(i), Opcode: transport.OpWrite, SG: cli.sge(i*8, 8),
			RemoteAddr: srv.mr.Addr() + uint64(i*8), RKey: srv.mr.RKey(), Signaled: i == n-1})
	}
	if k, err := cli.qp.PostSend(wrs...); k != n || err != nil {
		t.Fatalf("PostSend: %d, %v", k, err)
	}
	if wc := cli.next(ctx); wc.Err() != nil || wc.ID != n-1 {
		t.Fatalf("completion %+v, want ID %d", wc, n-1)
	}
}

// TestVerbsStashWakesArmedView: a completion that the provider's own poll
// takes into a view's stash (the poll that serves held sends) wakes the
// view's consumer if it armed. A consumer sleeps on its armed view; the
// event that would have woken it is the shared CQ's handler routing the
// completion to it, and a completion already in the stash is not there
// to route. Eight busy connections hung on this: a writer's post polled
// its peer's credit message into the stash while the connection's
// poller slept.
func TestVerbsStashWakesArmedView(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pair(t, d, nil, nil)
	c := cli.cq.(*cq)
	if !c.view {
		t.Skip("the device's CQs are not views of shared CQs here (RDMAGRPC_VERBS_CQ_SHARE)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if k, err := cli.qp.PostRecv(transport.RecvWR{ID: 7}); k != 1 || err != nil {
		t.Fatalf("PostRecv: %d, %v", k, err)
	}
	// The receive completes before the consumer arms, into the view's
	// lane (another poll took it), so that no event is raised for it; the
	// consumer's own poll would find it (arm, then poll), but the
	// provider's poll takes it first.
	postImmWrites(t, srv, cli, 1)
	if wc := srv.next(ctx); wc.Err() != nil {
		t.Fatalf("write: %+v", wc)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		c.sh.mu.Lock()
		_, _, wake := c.sh.drainLocked(nil, nil, 0, nil)
		n := len(c.lane)
		c.sh.mu.Unlock()
		wakeViews(wake, false)
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the receive never reached the device queue")
		}
	}
	woke := make(chan struct{}, 1)
	c.SetNotify(func() {
		select {
		case woke <- struct{}{}:
		default:
		}
	})
	if err := cli.cq.ReqNotify(); err != nil {
		t.Fatal(err)
	}
	c.stashPoll()
	if c.nstash.Load() != 1 {
		t.Fatalf("the provider's poll stashed %d completions, want the receive", c.nstash.Load())
	}
	select {
	case <-woke:
	case <-time.After(5 * time.Second):
		t.Fatal("the armed view's consumer was not woken for the completion in its stash")
	}
	var wc [2]transport.WorkCompletion
	if k, err := cli.cq.Poll(wc[:]); k != 1 || err != nil || wc[0].ID != 7 || wc[0].Opcode != transport.WCRecvRDMAWithImm {
		t.Fatalf("Poll: %d, %v, %+v", k, err, wc[:k])
	}
}
