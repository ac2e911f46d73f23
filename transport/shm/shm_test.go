package shm

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// side is one end of a test connection.
type side struct {
	dev transport.Device
	pd  transport.PD
	scq transport.CQ
	rcq transport.CQ
	qp  transport.QP
	mem []byte
	mr  transport.MR
}

func openSide(t testing.TB, cqSize int) *side {
	t.Helper()
	p, err := transport.Get("shm")
	if err != nil {
		t.Fatal(err)
	}
	d, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	s := &side{dev: d}
	if s.pd, err = d.AllocPD(); err != nil {
		t.Fatal(err)
	}
	if s.scq, err = d.CreateCQ(cqSize); err != nil {
		t.Fatal(err)
	}
	if s.rcq, err = d.CreateCQ(cqSize); err != nil {
		t.Fatal(err)
	}
	if s.mem, err = d.AllocMemory(1 << 16); err != nil {
		t.Fatal(err)
	}
	if s.mr, err = s.pd.RegMR(s.mem, transport.AccessLocalWrite|transport.AccessRemoteWrite|transport.AccessRemoteRead); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if s.qp != nil {
			s.qp.Close()
		}
		s.mr.Dereg()
		s.scq.Close()
		s.rcq.Close()
		s.pd.Close()
		d.FreeMemory(s.mem)
		d.Close()
	})
	return s
}

func (s *side) cfg() transport.QPConfig {
	return transport.QPConfig{
		PD: s.pd, SendCQ: s.scq, RecvCQ: s.rcq,
		MaxSendWR: 16, MaxRecvWR: 16, MaxSendSGE: 4, MaxRecvSGE: 4, MaxInline: 64,
		RetryCount: 1, RNRRetry: 7, MinRNRTimer: time.Millisecond, Timeout: 20 * time.Millisecond,
	}
}

// listenSides opens a client side and a server side with completion
// queues of the given sizes, and a listener on the server's device; the
// caller closes it.
func listenSides(t testing.TB, cliCQ, srvCQ int) (cli, srv *side, l transport.Listener) {
	t.Helper()
	cli, srv = openSide(t, cliCQ), openSide(t, srvCQ)
	l, err := srv.dev.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return cli, srv, l
}

// pair connects two sides in this process; mod adjusts the configs.
func pair(t testing.TB, mod func(c, s *transport.QPConfig)) (cli, srv *side) {
	t.Helper()
	cli, srv, l := listenSides(t, 64, 64)
	defer l.Close()
	cc, sc := cli.cfg(), srv.cfg()
	if mod != nil {
		mod(&cc, &sc)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		r, err := l.Accept(ctx)
		if err != nil {
			errc <- err
			return
		}
		if string(bytes.TrimRight(r.PeerPrivate(), "\x00")) != "hello" || len(r.PeerPrivate()) != transport.PrivateLenConnect {
			errc <- errors.New("wrong connect private data " + string(r.PeerPrivate()))
			return
		}
		srv.qp, err = r.Accept(ctx, sc, []byte("welcome"))
		errc <- err
	}()
	var err error
	cli.qp, err = cli.dev.Connect(ctx, l.Addr().String(), cc, []byte("hello"))
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if string(bytes.TrimRight(cli.qp.PeerPrivate(), "\x00")) != "welcome" || len(cli.qp.PeerPrivate()) != transport.PrivateLenAccept {
		t.Fatalf("accept private data %q", cli.qp.PeerPrivate())
	}
	return cli, srv
}

// poll waits up to 5 s for n completions on cq.
func poll(t *testing.T, cq transport.CQ, n int) []transport.WorkCompletion {
	t.Helper()
	var out []transport.WorkCompletion
	wc := make([]transport.WorkCompletion, 16)
	deadline := time.Now().Add(5 * time.Second)
	for len(out) < n {
		k, err := cq.Poll(wc)
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		out = append(out, wc[:k]...)
		if k == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("got %d of %d completions: %+v", len(out), n, out)
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	return out
}

func pollNone(t *testing.T, cq transport.CQ) {
	t.Helper()
	wc := make([]transport.WorkCompletion, 4)
	if n, err := cq.Poll(wc); n != 0 || err != nil {
		t.Fatalf("unexpected completions %d %v: %+v", n, err, wc[:n])
	}
}

func (s *side) sge(off, n int) []transport.SGE {
	return []transport.SGE{{Addr: s.mr.Addr() + uint64(off), Length: uint32(n), LKey: s.mr.LKey()}}
}

func wantStatus(t *testing.T, wc transport.WorkCompletion, st transport.Status) {
	t.Helper()
	if wc.Status != st {
		t.Fatalf("completion %+v: status %v, want %v", wc, wc.Status, st)
	}
}

func TestSendRecv(t *testing.T) {
	cli, srv := pair(t, nil)
	if _, err := srv.qp.PostRecv(transport.RecvWR{ID: 7, SG: append(srv.sge(0, 3), srv.sge(100, 100)...)}); err != nil {
		t.Fatal(err)
	}
	copy(cli.mem, "hello, world")
	if _, err := cli.qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpSendWithImm, SG: cli.sge(0, 12), Imm: 42, Signaled: true}); err != nil {
		t.Fatal(err)
	}
	sc := poll(t, cli.scq, 1)[0]
	wantStatus(t, sc, transport.StatusSuccess)
	if sc.ID != 1 || sc.Opcode != transport.WCSend || sc.QPNum != cli.qp.Num() {
		t.Fatalf("send completion %+v", sc)
	}
	rc := poll(t, srv.rcq, 1)[0]
	wantStatus(t, rc, transport.StatusSuccess)
	if rc.ID != 7 || rc.Opcode != transport.WCRecv || rc.ByteLen != 12 || !rc.HasImm || rc.Imm != 42 || rc.QPNum != srv.qp.Num() {
		t.Fatalf("recv completion %+v", rc)
	}
	if got := string(srv.mem[0:3]) + string(srv.mem[100:109]); got != "hello, world" {
		t.Fatalf("scattered %q", got)
	}
	// Inline, unsignaled: no send completion, data delivered.
	srv.qp.PostRecv(transport.RecvWR{ID: 8, SG: srv.sge(0, 64)})
	msg := []byte("inline!")
	copy(cli.mem[200:], msg)
	if _, err := cli.qp.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpSend, SG: cli.sge(200, len(msg)), Inline: true}); err != nil {
		t.Fatal(err)
	}
	rc = poll(t, srv.rcq, 1)[0]
	if rc.ID != 8 || rc.ByteLen != uint32(len(msg)) || rc.HasImm || !bytes.Equal(srv.mem[:len(msg)], msg) {
		t.Fatalf("inline recv %+v %q", rc, srv.mem[:len(msg)])
	}
	pollNone(t, cli.scq)
	if cli.qp.State() != transport.QPSRTS || srv.qp.State() != transport.QPSRTS {
		t.Fatalf("states %v %v", cli.qp.State(), srv.qp.State())
	}
}

func TestWriteRead(t *testing.T) {
	cli, srv := pair(t, nil)
	copy(cli.mem, "0123456789")
	_, err := cli.qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpWrite, SG: cli.sge(0, 10), RemoteAddr: srv.mr.Addr() + 500, RKey: srv.mr.RKey(), Signaled: true})
	if err != nil {
		t.Fatal(err)
	}
	wc := poll(t, cli.scq, 1)[0]
	if wc.Status != transport.StatusSuccess || wc.Opcode != transport.WCRDMAWrite {
		t.Fatalf("%+v", wc)
	}
	if string(srv.mem[500:510]) != "0123456789" {
		t.Fatalf("written %q", srv.mem[500:510])
	}
	pollNone(t, srv.rcq) // plain WRITE consumes no receive
	copy(srv.mem[1000:], "remote data")
	cli.qp.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpRead, SG: append(cli.sge(2000, 6), cli.sge(3000, 5)...), RemoteAddr: srv.mr.Addr() + 1000, RKey: srv.mr.RKey(), Signaled: true})
	wc = poll(t, cli.scq, 1)[0]
	if wc.Status != transport.StatusSuccess || wc.Opcode != transport.WCRDMARead || wc.ByteLen != 11 {
		t.Fatalf("%+v", wc)
	}
	if got := string(cli.mem[2000:2006]) + string(cli.mem[3000:3005]); got != "remote data" {
		t.Fatalf("read %q", got)
	}
	srv.qp.PostRecv(transport.RecvWR{ID: 9})
	cli.qp.PostSend(transport.SendWR{ID: 3, Opcode: transport.OpWriteWithImm, SG: cli.sge(0, 4), Imm: 5, RemoteAddr: srv.mr.Addr(), RKey: srv.mr.RKey()})
	rc := poll(t, srv.rcq, 1)[0]
	if rc.Status != transport.StatusSuccess || rc.Opcode != transport.WCRecvRDMAWithImm || rc.ByteLen != 4 || rc.Imm != 5 || rc.ID != 9 {
		t.Fatalf("%+v", rc)
	}
}

// Closing the listener right after Accept must not cut the connection it
// just handed over (its socket used to get the listener's unblocking
// deadline).
func TestListenerCloseAfterAccept(t *testing.T) {
	for i := range 40 {
		cli, srv := pair(t, nil)         // pair closes its listener as soon as Accept returns
		time.Sleep(2 * time.Millisecond) // fixed: the listener's Close must not cut it meanwhile
		if cs, ss := cli.qp.State(), srv.qp.State(); cs == transport.QPSErr || ss == transport.QPSErr {
			t.Fatalf("iteration %d: connection cut by listener Close: client %v, server %v", i, cs, ss)
		}
		cli.qp.Close()
		srv.qp.Close()
		cli.qp, srv.qp = nil, nil
	}
}

// TestHandleRequests checks that a listener with a RequestHandler hands
// every request to it, the one read before the handler was set too, and
// that Accept then returns none.
func TestHandleRequests(t *testing.T) {
	cli, srv, tl := listenSides(t, 64, 64)
	defer tl.Close()
	l := tl.(*listener)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dial := func(name string) <-chan error {
		errc := make(chan error, 1)
		go func() {
			qp, err := cli.dev.Connect(ctx, l.Addr().String(), cli.cfg(), []byte(name))
			if err == nil {
				defer qp.Close()
			}
			errc <- err
		}()
		return errc
	}
	// The first request is read with no handler: its handshake waits to
	// hand it to Accept, out of the pending set.
	first := dial("first")
	testutil.Eventually(t, 5*time.Second, "the first request to be read", testutil.Bool(func() bool { return l.requestsRead.Load() == 1 }))
	got := make(chan string, 2)
	l.HandleRequests(func(r transport.ConnRequest) {
		got <- string(bytes.TrimRight(r.PeerPrivate(), "\x00"))
		qp, err := r.Accept(ctx, srv.cfg(), []byte("welcome"))
		if err == nil {
			qp.Close()
		}
	})
	second := dial("second")
	for _, errc := range []<-chan error{first, second} {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]bool{<-got: true, <-got: true}
	if !seen["first"] || !seen["second"] {
		t.Fatalf("the handler saw %v, want first and second", seen)
	}
	actx, acancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer acancel()
	if r, err := l.Accept(actx); err == nil {
		t.Fatalf("Accept returned a request (%q) the handler should have had", r.PeerPrivate())
	}
}
