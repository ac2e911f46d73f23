package transporttest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// peerSender connects, waits for "send N", sends N 8-byte messages, waits
// for their completions (whatever their status), reports "sent", repeats.
func peerSender(ctx context.Context, p *peer) error {
	ep, err := p.connect(ctx, setup{qp: func(c *transport.QPConfig) { c.MaxSendWR = 64 }}, nil)
	if err != nil {
		return err
	}
	defer ep.close()
	for {
		m, err := p.ctl.recv(ctx)
		if errors.Is(err, errPeerDone) || m == bye {
			return nil
		}
		if err != nil {
			return err
		}
		f := strings.Fields(m)
		if len(f) != 2 || f[0] != "send" {
			return fmt.Errorf("control message %q, want send N", m)
		}
		n, err := strconv.Atoi(f[1])
		if err != nil {
			return fmt.Errorf("control message %q: %w", m, err)
		}
		for i := range n {
			if err := ep.postSend(transport.SendWR{ID: uint64(i), Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(0, 8)}, Signaled: true}); err != nil {
				return err
			}
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		poll(wctx, ep.scq, n) // statuses are the local half's business
		cancel()
		if err := p.ctl.sendf("sent"); err != nil {
			return err
		}
	}
}

var cqCases = []*testCase{
	{
		name: "ArmNotify",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			for id := uint64(1); id <= 3; id++ {
				if err := ep.postRecv(id, ep.sge(int(id)*64, 64)); err != nil {
					t.Fatal(err)
				}
			}
			short := func() context.Context {
				ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
				t.Cleanup(cancel)
				return ctx
			}
			// Not armed: nothing wakes Wait.
			if err := ep.rcq.Wait(short()); !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Wait on an unarmed idle CQ: %v, want deadline exceeded", err)
			}
			// A completion already queued when arming does not notify.
			e.send("send 1")
			e.expect("sent")
			if err := ep.rcq.ReqNotify(); err != nil {
				t.Fatal(err)
			}
			if err := ep.rcq.Wait(short()); !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Wait woke for a completion queued before arming: %v", err)
			}
			e.poll(ep.rcq, 1)
			// Armed, then a completion: Wait returns, once.
			if err := ep.rcq.ReqNotify(); err != nil {
				t.Fatal(err)
			}
			e.send("send 1")
			if err := ep.rcq.Wait(e.ctx()); err != nil {
				t.Fatalf("Wait after arm and completion: %v", err)
			}
			e.expect("sent")
			e.poll(ep.rcq, 1)
			if err := ep.rcq.Wait(short()); !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("second Wait without re-arming: %v, want deadline exceeded", err)
			}
			// Cancellation.
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(20*time.Millisecond, cancel)
			if err := ep.rcq.Wait(ctx); !errors.Is(err, context.Canceled) {
				t.Fatalf("Wait on a cancelled context: %v", err)
			}
		},
		peer: peerSender,
	},
	{
		name: "CQOverflow",
		local: func(t *testing.T, e *env) {
			ep, err := newEndpoint(e.dev, setup{cqSize: 4})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ep.close)
			n := ep.rcq.Cap() + 8
			ep.cfg.MaxRecvWR = n + 8
			r, err := e.l.Accept(e.ctx())
			if err != nil {
				t.Fatal(err)
			}
			if ep.qp, err = r.Accept(e.ctx(), ep.cfg, nil); err != nil {
				t.Fatal(err)
			}
			for i := range n {
				if err := ep.postRecv(uint64(i), ep.sge(i*64, 64)); err != nil {
					t.Fatal(err)
				}
			}
			e.send("send %d", n)
			e.expect("sent")
			buf := make([]transport.WorkCompletion, 1)
			for end := time.Now().Add(5 * time.Second); ; {
				if _, err := ep.rcq.Poll(buf); errors.Is(err, transport.ErrCQOverflow) {
					break
				} else if err != nil {
					t.Fatal(err)
				}
				if time.Now().After(end) {
					t.Fatalf("%d completions into a CQ of %d: no ErrCQOverflow", n, ep.rcq.Cap())
				}
				time.Sleep(time.Millisecond)
			}
		},
		peer: peerSender,
	},
	{
		name: "PostErrors",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{qp: func(c *transport.QPConfig) { c.MaxSendSGE, c.MaxRecvSGE = 2, 2 }}, nil)
			attr := e.dev.Attr()
			many := make([]transport.SGE, attr.MaxSGE+1)
			for i := range many {
				many[i] = ep.sge(i, 1)
			}
			if _, err := ep.qp.PostSend(transport.SendWR{Opcode: transport.OpSend, SG: many}); !errors.Is(err, transport.ErrInvalidWR) {
				t.Fatalf("send with %d SGEs: %v, want ErrInvalidWR", len(many), err)
			}
			if _, err := ep.qp.PostRecv(transport.RecvWR{SG: many}); !errors.Is(err, transport.ErrInvalidWR) {
				t.Fatalf("receive with %d SGEs: %v, want ErrInvalidWR", len(many), err)
			}
			if big := attr.MaxInline + 1; big <= memSize {
				if _, err := ep.qp.PostSend(transport.SendWR{Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(0, big)}, Inline: true}); !errors.Is(err, transport.ErrInvalidWR) {
					t.Fatalf("inline send of %d bytes: %v, want ErrInvalidWR", big, err)
				}
			}
			// Devices may grant more than asked: fill to what was granted.
			posted := 0
			for ; posted < 1<<16; posted++ {
				n, err := ep.qp.PostRecv(transport.RecvWR{ID: uint64(posted), SG: []transport.SGE{ep.sge(0, 8)}})
				if err != nil {
					if !errors.Is(err, transport.ErrQueueFull) || n != 0 {
						t.Fatalf("receive %d: %v (posted %d), want ErrQueueFull", posted, err, n)
					}
					break
				}
			}
			if posted < ep.cfg.MaxRecvWR || posted == 1<<16 {
				t.Fatalf("receive queue took %d, asked for %d", posted, ep.cfg.MaxRecvWR)
			}
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			return p.awaitBye(ctx)
		},
	},
}
