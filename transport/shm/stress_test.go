package shm

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// waitPoll is the canonical verbs loop: poll, arm, poll again, wait.
func waitPoll(ctx context.Context, cq transport.CQ, wc []transport.WorkCompletion) (int, error) {
	for {
		if n, err := cq.Poll(wc); n > 0 || err != nil {
			return n, err
		}
		if err := cq.ReqNotify(); err != nil {
			return 0, err
		}
		if n, err := cq.Poll(wc); n > 0 || err != nil {
			return n, err
		}
		if err := cq.Wait(ctx); err != nil {
			return 0, err
		}
	}
}

// TestStreamWithNotify streams sequenced messages while the receiver sleeps
// on its CQ between bursts: a lost wake-up (arm/notify race) hangs it.
func TestStreamWithNotify(t *testing.T) {
	cli, srv := pair(t, nil)
	const total, window = 3000, 16
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i := range window {
		srv.qp.PostRecv(transport.RecvWR{ID: uint64(i), SG: srv.sge(i*64, 64)})
	}
	done := make(chan error, 1)
	go func() {
		wc := make([]transport.WorkCompletion, 8)
		next := uint64(0)
		for next < total {
			n, err := waitPoll(ctx, srv.rcq, wc)
			if err != nil {
				done <- err
				return
			}
			for _, w := range wc[:n] {
				if w.Status != transport.StatusSuccess {
					done <- w.Err()
					return
				}
				off := int(w.ID) * 64
				if got := binary.LittleEndian.Uint64(srv.mem[off:]); got != next {
					t.Errorf("message %d carries %d", next, got)
				}
				next++
				srv.qp.PostRecv(transport.RecvWR{ID: w.ID, SG: srv.sge(off, 64)})
			}
		}
		done <- nil
	}()
	wc := make([]transport.WorkCompletion, 8)
	for i := range uint64(total) {
		binary.LittleEndian.PutUint64(cli.mem[(i%8)*64:], i)
		// RNRRetry is 7: running ahead of the receiver is retried.
		if _, err := cli.qp.PostSend(transport.SendWR{ID: i, Opcode: transport.OpSend, SG: cli.sge(int(i%8)*64, 8), Signaled: true, Inline: true}); err != nil {
			t.Fatal(err)
		}
		n, err := waitPoll(ctx, cli.scq, wc)
		if err != nil || n != 1 || wc[0].Status != transport.StatusSuccess {
			t.Fatalf("send %d: %d %v %+v", i, n, err, wc[0])
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
