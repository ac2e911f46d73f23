//go:build cgo

package verbs

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func TestVerbsPostErrors(t *testing.T) {
	d := openOrSkip(t)
	cli, _ := pair(t, d, nil, nil)
	// Too many SGEs in the second request: the first is posted, the
	// rest is not. (The device may grant more SGEs than asked for —
	// rxe does — so exceed the device limit.)
	var many []transport.SGE
	for i := 0; i <= d.Attr().MaxSGE; i++ {
		many = append(many, cli.sge(i, 1)...)
	}
	n, err := cli.qp.PostSend(
		transport.SendWR{ID: 1, Opcode: transport.OpWrite, SG: cli.sge(0, 8), RemoteAddr: cli.mr.Addr(), RKey: cli.mr.RKey()},
		transport.SendWR{ID: 2, Opcode: transport.OpWrite, SG: many, RemoteAddr: cli.mr.Addr(), RKey: cli.mr.RKey()})
	if n != 1 || !errors.Is(err, transport.ErrInvalidWR) {
		t.Fatalf("%d SGEs: n=%d err=%v", len(many), n, err)
	}
	n, err = cli.qp.PostSend(transport.SendWR{ID: 3, Opcode: transport.OpSend, SG: cli.sge(0, 1000), Inline: true})
	if n != 0 || !errors.Is(err, transport.ErrInvalidWR) {
		t.Fatalf("1000 inline bytes on a 64-byte-inline QP: n=%d err=%v", n, err)
	}
	// Fill the receive queue beyond its depth in one call.
	var wrs []transport.RecvWR
	for i := range 200 {
		wrs = append(wrs, transport.RecvWR{ID: uint64(i), SG: cli.sge(0, 8)})
	}
	n, err = cli.qp.PostRecv(wrs...)
	if !errors.Is(err, transport.ErrQueueFull) || n < 16 || n >= 200 {
		t.Fatalf("200 receives on a 16-deep queue: n=%d err=%v", n, err)
	}
	t.Logf("receive queue took %d of 200 (asked for 16)", n)
}

func TestVerbsRNRRetryExceeded(t *testing.T) {
	d := openOrSkip(t)
	cli, _ := pair(t, d, nil, nil) // default RNR policy: 6 retries × 1.28 ms
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	cli.qp.PostSend(transport.SendWR{ID: 41, Opcode: transport.OpSend, SG: cli.sge(0, 8), Signaled: true})
	wc := cli.next(ctx)
	if wc.ID != 41 || wc.Status != transport.StatusRNRRetryExcErr {
		t.Fatalf("send with no receive posted: %+v", wc)
	}
	t.Logf("RNR retry exceeded after %v", time.Since(start))
}

func TestVerbsCQOverflow(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pair(t, d, nil, nil)
	// The server never polls its CQ; each round delivers 16 receives.
	capacity := srv.cq.Cap()
	var recvs []transport.RecvWR
	var sends []transport.SendWR
	for i := range 16 {
		recvs = append(recvs, transport.RecvWR{ID: uint64(i), SG: srv.sge(i*64, 64)})
		sends = append(sends, transport.SendWR{ID: uint64(i), Opcode: transport.OpSend, SG: cli.sge(0, 8), Signaled: true})
	}
	var wc [16]transport.WorkCompletion
	var senderErr error
	total := 0
	for total <= capacity+16 {
		if _, err := srv.qp.PostRecv(recvs...); err != nil {
			t.Fatalf("PostRecv after %d: %v", total, err)
		}
		if _, err := cli.qp.PostSend(sends...); err != nil {
			t.Fatalf("PostSend after %d: %v", total, err)
		}
		total += 16
		// Free the sender's queue without waiting on it: once the
		// receiver's CQ is full the sends may never complete.
		time.Sleep(20 * time.Millisecond) // fixed: a completion to wait for may never come
		n, _ := cli.cq.Poll(wc[:])
		for _, c := range wc[:n] {
			if c.Err() != nil && senderErr == nil {
				senderErr = c.Err()
			}
		}
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		_, err := srv.cq.Poll(wc[:1])
		if errors.Is(err, transport.ErrCQOverflow) {
			t.Logf("ErrCQOverflow after %d receives into a %d-entry CQ; sender saw %v", total, capacity, senderErr)
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no ErrCQOverflow after %d receives into a %d-entry CQ (sender: %v)", total, capacity, senderErr)
		}
		time.Sleep(10 * time.Millisecond) // then the next round of receives
	}
}

func TestVerbsDeviceCloseDisconnectsPeer(t *testing.T) {
	d := openOrSkip(t)
	p, _ := transport.Get(Name)
	d2, err := p.Open(d.Name())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s2 := &side{t: t, dev: d2}
	if s2.pd, err = d2.AllocPD(); err != nil {
		t.Fatal(err)
	}
	if s2.cq, err = d2.CreateCQ(8); err != nil {
		t.Fatal(err)
	}
	l, err := d2.Listen(hostIP(t, d) + ":0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		if req, err := l.Accept(ctx); err == nil {
			req.Accept(ctx, transport.QPConfig{PD: s2.pd, SendCQ: s2.cq, RecvCQ: s2.cq}, nil)
		}
	}()
	cli := newSide(t, d, transport.AccessLocalWrite)
	if cli.qp, err = d.Connect(ctx, l.Addr().String(), cli.cfg(), nil); err != nil {
		t.Fatal(err)
	}
	// Close the server's device with its listener and QP still open:
	// Device.Close tears them down and the client learns of it.
	time.Sleep(50 * time.Millisecond) // let the server's Accept return
	if err := d2.Close(); err != nil {
		t.Logf("Device.Close with live objects: %v", err)
	}
	select {
	case <-cli.qp.Disconnected():
	case <-ctx.Done():
		t.Fatal("client never saw the server's device close")
	}
	if _, err := l.Accept(ctx); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Device.Close: %v", err)
	}
}
