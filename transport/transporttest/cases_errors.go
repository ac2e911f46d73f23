package transporttest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// accessCase: the local half issues op against memory the peer described
// (perhaps wrongly); the requester must see want and its QP go to ERROR.
// The peer's prepare may change what it grants or announces.
func accessCase(name string, op transport.Opcode, peerAccess transport.Access, otherPD, dereg bool, mutate func(*remoteMR)) *testCase {
	return &testCase{
		name: name,
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			r := e.remoteMR()
			if mutate != nil {
				mutate(&r)
			}
			if dereg {
				e.send("dereg")
				e.expect("gone")
			}
			if err := ep.postSend(transport.SendWR{ID: 11, Opcode: op, SG: []transport.SGE{ep.sge(0, 64)}, RemoteAddr: r.addr, RKey: r.rkey, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			wc := e.poll(ep.scq, 1)[0]
			e.check(wc, 11, transport.StatusRemAccessErr, 0, ep.qp.Num())
			if s := ep.qp.State(); s != transport.QPSErr {
				t.Fatalf("requester QP in %v after a remote access error, want ERROR", s)
			}
			// Later work is flushed.
			if err := ep.postSend(transport.SendWR{ID: 12, Opcode: transport.OpWrite, SG: []transport.SGE{ep.sge(0, 8)}, RemoteAddr: r.addr, RKey: r.rkey, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			e.check(e.poll(ep.scq, 1)[0], 12, transport.StatusWRFlushErr, 0, ep.qp.Num())
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{access: peerAccess}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			fill(ep.mem[:4096], 3)
			announce := ep
			if otherPD {
				// Memory of another PD of the same peer: its rkey is real
				// but not valid for this connection's QP.
				other, err := newEndpoint(p.dev, setup{})
				if err != nil {
					return err
				}
				defer other.close()
				announce = other
			}
			if err := sendMR(p.ctl, announce); err != nil {
				return err
			}
			if dereg {
				if _, err := p.ctl.expect(ctx, "dereg"); err != nil {
					return err
				}
				if err := ep.mr.Dereg(); err != nil {
					return err
				}
				ep.mr = nil
				if err := p.ctl.sendf("gone"); err != nil {
					return err
				}
			}
			return p.awaitBye(ctx)
		},
	}
}

var errorCases = []*testCase{
	accessCase("RemoteAccess/BadRKey", transport.OpWrite, 0, false, false, func(r *remoteMR) { r.rkey ^= 0x5a5a5a00 }),
	accessCase("RemoteAccess/OutOfBounds", transport.OpWrite, 0, false, false, func(r *remoteMR) { r.addr += uint64(r.len) - 8 }),
	accessCase("RemoteAccess/BeforeRegion", transport.OpRead, 0, false, false, func(r *remoteMR) { r.addr -= 32 }),
	accessCase("RemoteAccess/NoRemoteWrite", transport.OpWrite, transport.AccessLocalWrite|transport.AccessRemoteRead, false, false, nil),
	accessCase("RemoteAccess/NoRemoteRead", transport.OpRead, transport.AccessLocalWrite|transport.AccessRemoteWrite, false, false, nil),
	accessCase("RemoteAccess/OtherPD", transport.OpWrite, 0, true, false, nil),
	accessCase("RemoteAccess/Deregistered", transport.OpWrite, 0, false, true, nil),
	{
		name: "LocalBadLKey",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			e.expect("ready")
			bad := ep.sge(0, 16)
			bad.LKey ^= 0x5a5a5a00
			if err := ep.postSend(transport.SendWR{ID: 3, Opcode: transport.OpSend, SG: []transport.SGE{bad}, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			// rxe 6.1 reports a bad gather lkey as LocQPOpErr (HCAs:
			// LocProtErr); rxe is the reference.
			e.check(e.poll(ep.scq, 1)[0], 3, transport.StatusLocQPOpErr, 0, ep.qp.Num())
			if s := ep.qp.State(); s != transport.QPSErr {
				t.Fatalf("QP in %v after a local protection error, want ERROR", s)
			}
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if err := ep.postRecv(1, ep.sge(0, 64)); err != nil {
				return err
			}
			if err := p.ctl.sendf("ready"); err != nil {
				return err
			}
			return p.awaitBye(ctx)
		},
	},
	{
		name: "ReceiveTooSmall",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			e.expect("ready")
			if err := ep.postSend(transport.SendWR{ID: 4, Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(0, 64)}, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			e.check(e.poll(ep.scq, 1)[0], 4, transport.StatusRemOpErr, 0, ep.qp.Num())
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if err := ep.postRecv(1, ep.sge(0, 16)); err != nil {
				return err
			}
			if err := p.ctl.sendf("ready"); err != nil {
				return err
			}
			wcs, err := poll(ctx, ep.rcq, 1)
			if err != nil {
				return err
			}
			// What rxe 6.1 does: the responder's receive fails with a local
			// QP operation error, the requester sees a remote operational
			// error (rxe_resp.c length check, class A error).
			if err := check(wcs[0], 1, transport.StatusLocQPOpErr, 0, ep.qp.Num()); err != nil {
				return fmt.Errorf("responder receive: %w", err)
			}
			return p.okThenBye(ctx)
		},
	},
	{
		name: "FlushOnSetError",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			for id := uint64(1); id <= 4; id++ {
				if err := ep.postRecv(id, ep.sge(int(id)*64, 64)); err != nil {
					t.Fatal(err)
				}
			}
			if err := ep.qp.SetError(); err != nil {
				t.Fatal(err)
			}
			wcs := e.poll(ep.rcq, 4)
			for i, wc := range wcs {
				e.check(wc, uint64(i+1), transport.StatusWRFlushErr, 0, ep.qp.Num())
			}
			if err := ep.postSend(transport.SendWR{ID: 9, Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(0, 8)}, Signaled: true}); err != nil {
				t.Fatalf("post in ERROR state must be accepted: %v", err)
			}
			e.check(e.poll(ep.scq, 1)[0], 9, transport.StatusWRFlushErr, 0, ep.qp.Num())
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
	{
		name: "PeerDisconnectFlushes",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			for id := uint64(1); id <= 3; id++ {
				if err := ep.postRecv(id, ep.sge(int(id)*64, 64)); err != nil {
					t.Fatal(err)
				}
			}
			e.send("go")
			waitDisconnected(t, ep)
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if _, err := p.ctl.expect(ctx, "go"); err != nil {
				return err
			}
			if err := ep.qp.Disconnect(); err != nil {
				return err
			}
			return p.awaitBye(ctx)
		},
	},
	{
		name:      "PeerKilledFlushes",
		crossOnly: true,
		peerExits: true,
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			for id := uint64(1); id <= 3; id++ {
				if err := ep.postRecv(id, ep.sge(int(id)*64, 64)); err != nil {
					t.Fatal(err)
				}
			}
			e.send("die")
			waitDisconnected(t, ep)
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			if _, err := p.ctl.expect(ctx, "die"); err != nil {
				return err
			}
			_ = ep
			exitAbruptly() // no close, no disconnect: as if SIGKILLed
			return errors.New("unreachable")
		},
	},
	{
		name: "RNRRetryExceeded",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{qp: func(c *transport.QPConfig) { c.RNRRetry = 1 }}, nil)
			e.expect("ready") // the peer posted no receive
			if err := ep.postSend(transport.SendWR{ID: 6, Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(0, 8)}, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			e.check(e.poll(ep.scq, 1)[0], 6, transport.StatusRNRRetryExcErr, 0, ep.qp.Num())
			if s := ep.qp.State(); s != transport.QPSErr {
				t.Fatalf("QP in %v after RNR retry exceeded, want ERROR", s)
			}
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if err := p.ctl.sendf("ready"); err != nil {
				return err
			}
			return p.awaitBye(ctx)
		},
	},
	// QPConfig.InitialRecvs are there before the peer can send: a send
	// right after the connection is up, by a sender that may not retry on
	// RNR, lands in them, whichever side connected.
	{
		name: "InitialRecvsAccepter",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{qp: initialRecvs(41, 42)}, nil)
			for i, wc := range e.poll(ep.rcq, 2) {
				e.check(wc, uint64(41+i), transport.StatusSuccess, transport.WCRecv, ep.qp.Num())
				if !wc.HasImm || wc.Imm != uint32(7+i) {
					t.Fatalf("receive %d: immediate %v %d, want %d", i, wc.HasImm, wc.Imm, 7+i)
				}
			}
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{qp: func(c *transport.QPConfig) { c.RNRRetry = 0 }}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if err := sendImmediately(ctx, ep, 7, 8); err != nil {
				return err
			}
			return p.okThenBye(ctx)
		},
	},
	{
		name: "InitialRecvsConnecter",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{qp: func(c *transport.QPConfig) { c.RNRRetry = 0 }}, nil)
			if err := sendImmediately(e.ctx(), ep, 7, 8); err != nil {
				t.Fatal(err)
			}
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{qp: initialRecvs(41, 42)}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			wcs, err := poll(ctx, ep.rcq, 2)
			if err != nil {
				return err
			}
			for i, wc := range wcs {
				if err := check(wc, uint64(41+i), transport.StatusSuccess, transport.WCRecv, ep.qp.Num()); err != nil {
					return err
				}
			}
			return p.okThenBye(ctx)
		},
	},
	{
		name: "RNRThenReceivePosted",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{qp: func(c *transport.QPConfig) { c.RNRRetry = 7 }}, nil) // 7: retry for ever
			e.expect("ready")
			copy(ep.mem, "late")
			if err := ep.postSend(transport.SendWR{ID: 6, Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(0, 4)}, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			time.Sleep(30 * time.Millisecond) // the send is now being RNR-retried
			e.send("post")
			e.check(e.poll(ep.scq, 1)[0], 6, transport.StatusSuccess, transport.WCSend, ep.qp.Num())
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if err := p.ctl.sendf("ready"); err != nil {
				return err
			}
			if _, err := p.ctl.expect(ctx, "post"); err != nil {
				return err
			}
			if err := ep.postRecv(1, ep.sge(0, 64)); err != nil {
				return err
			}
			wcs, err := poll(ctx, ep.rcq, 1)
			if err != nil {
				return err
			}
			if wcs[0].Status != transport.StatusSuccess || string(ep.mem[:4]) != "late" {
				return fmt.Errorf("late receive: %+v %q", wcs[0], ep.mem[:4])
			}
			return p.okThenBye(ctx)
		},
	},
}

// waitDisconnected: the peer is gone; Disconnected fires, the QP is in
// ERROR and the three posted receives (ids 1–3) flush in order.
func waitDisconnected(t *testing.T, ep *endpoint) {
	t.Helper()
	select {
	case <-ep.qp.Disconnected():
	case <-time.After(30 * time.Second):
		t.Fatal("Disconnected() not closed 30 s after the peer left")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	wcs, err := poll(ctx, ep.rcq, 3)
	if err != nil {
		t.Fatal(err)
	}
	for i, wc := range wcs {
		if err := check(wc, uint64(i+1), transport.StatusWRFlushErr, 0, ep.qp.Num()); err != nil {
			t.Fatal(err)
		}
	}
	if s := ep.qp.State(); s != transport.QPSErr {
		t.Fatalf("QP in %v after the peer left, want ERROR", s)
	}
}

// initialRecvs has a QP posted receives with these ids (no buffers) as it
// is created.
func initialRecvs(ids ...uint64) func(*transport.QPConfig) {
	return func(c *transport.QPConfig) {
		for _, id := range ids {
			c.InitialRecvs = append(c.InitialRecvs, transport.RecvWR{ID: id})
		}
	}
}

// sendImmediately sends a zero-length SEND_WITH_IMM per immediate the
// moment ep is connected, and checks that each completed: with RNRRetry 0
// a send that finds no receive fails.
func sendImmediately(ctx context.Context, ep *endpoint, imms ...uint32) error {
	for i, imm := range imms {
		if err := ep.postSend(transport.SendWR{ID: uint64(i), Opcode: transport.OpSendWithImm, Imm: imm, Signaled: true}); err != nil {
			return err
		}
	}
	wcs, err := poll(ctx, ep.scq, len(imms))
	if err != nil {
		return err
	}
	for i, wc := range wcs {
		if err := check(wc, uint64(i), transport.StatusSuccess, transport.WCSend, ep.qp.Num()); err != nil {
			return fmt.Errorf("send %d right after connecting: %w", i, err)
		}
	}
	return nil
}
