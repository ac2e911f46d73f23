//go:build cgo

package verbs

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// pairPort is where guest a listens in the two-guest run of tests/rxe.
const pairPort = "7471"

// pairRole is this guest's side in the two-guest mode of tests/rxe;
// elsewhere the test is skipped.
func pairRole(t *testing.T) string {
	t.Helper()
	role := os.Getenv("RXE_ROLE")
	if role != "a" && role != "b" {
		t.Skip("runs only in the two-guest mode of tests/rxe (RXE_ROLE=a|b)")
	}
	return role
}

// TestRXEPairTransfer runs across two Soft-RoCE guests (tests/rxe pair
// mode): guest a accepts, guest b connects; SEND_WITH_IMM, WRITE_WITH_IMM
// and READ cross the emulated link, then b disconnects.
func TestRXEPairTransfer(t *testing.T) {
	role := pairRole(t)
	d := openOrSkip(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	all := transport.AccessLocalWrite | transport.AccessRemoteWrite | transport.AccessRemoteRead
	s := newSide(t, d, all)
	payload := bytes.Repeat([]byte("rxe pair "), 1000)

	if role == "a" {
		l, err := d.Listen(net.JoinHostPort(os.Getenv("RXE_ADDR"), pairPort))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		req, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(req.PeerPrivate(), []byte("from b")) {
			t.Fatalf("connect private data %q", req.PeerPrivate())
		}
		// Grant b our region: address and rkey travel in the accept.
		grant := make([]byte, 12)
		putU64(grant, s.mr.Addr())
		putU32(grant[8:], s.mr.RKey())
		copy(s.mem[32768:], payload) // what b will READ
		s.qp, err = req.Accept(ctx, s.cfg(), grant)
		if err != nil {
			t.Fatal(err)
		}
		s.qp.PostRecv(transport.RecvWR{ID: 1, SG: s.sge(0, 4096)}, transport.RecvWR{ID: 2})
		wc := s.next(ctx)
		if wc.Err() != nil || wc.Opcode != transport.WCRecv || wc.Imm != 7 || !bytes.Equal(s.mem[:wc.ByteLen], []byte("hello a")) {
			t.Fatalf("send from b: %+v %q", wc, s.mem[:wc.ByteLen])
		}
		wc = s.next(ctx)
		if wc.Err() != nil || wc.Opcode != transport.WCRecvRDMAWithImm || wc.Imm != 8 ||
			!bytes.Equal(s.mem[8192:8192+len(payload)], payload) {
			t.Fatalf("write from b: %+v", wc)
		}
		select {
		case <-s.qp.Disconnected():
		case <-ctx.Done():
			t.Fatal("b never disconnected")
		}
		return
	}

	// Guest b: dial until a is up.
	var err error
	for {
		s.qp, err = d.Connect(ctx, net.JoinHostPort(os.Getenv("RXE_PEER"), pairPort), s.cfg(), []byte("from b"))
		if err == nil {
			break
		}
		if ctx.Err() != nil || !(errors.Is(err, transport.ErrConnRefused) || isTimeout(err)) {
			t.Fatalf("Connect: %v", err)
		}
		time.Sleep(500 * time.Millisecond) // the peer's listener may not be up yet: retry
	}
	grant := s.qp.PeerPrivate()
	raddr, rkey := getU64(grant), getU32(grant[8:])
	copy(s.mem, "hello a")
	s.qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpSendWithImm, Imm: 7, SG: s.sge(0, 7), Signaled: true})
	if wc := s.next(ctx); wc.Err() != nil {
		t.Fatal(wc.Err())
	}
	copy(s.mem[4096:], payload)
	s.qp.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpWriteWithImm, Imm: 8, SG: s.sge(4096, len(payload)),
		RemoteAddr: raddr + 8192, RKey: rkey, Signaled: true})
	if wc := s.next(ctx); wc.Err() != nil {
		t.Fatal(wc.Err())
	}
	s.qp.PostSend(transport.SendWR{ID: 3, Opcode: transport.OpRead, SG: s.sge(16384, len(payload)),
		RemoteAddr: raddr + 32768, RKey: rkey, Signaled: true})
	if wc := s.next(ctx); wc.Err() != nil || !bytes.Equal(s.mem[16384:16384+len(payload)], payload) {
		t.Fatalf("READ: %+v", wc)
	}
	if err := s.qp.Disconnect(); err != nil {
		t.Fatal(err)
	}
}

func isTimeout(err error) bool {
	var ne interface{ Timeout() bool }
	return errors.As(err, &ne) && ne.Timeout()
}

func putU64(b []byte, v uint64) {
	for i := range 8 {
		b[i] = byte(v >> (8 * i))
	}
}

func putU32(b []byte, v uint32) {
	for i := range 4 {
		b[i] = byte(v >> (8 * i))
	}
}

func getU64(b []byte) (v uint64) {
	for i := range 8 {
		v |= uint64(b[i]) << (8 * i)
	}
	return v
}

func getU32(b []byte) (v uint32) {
	for i := range 4 {
		v |= uint32(b[i]) << (8 * i)
	}
	return v
}
