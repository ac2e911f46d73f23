package fault_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
)

const allAccess = transport.AccessLocalWrite | transport.AccessRemoteWrite | transport.AccessRemoteRead

func newInjector(t testing.TB, rules ...fault.Rule) *fault.Injector {
	t.Helper()
	shm, err := transport.Get("shm")
	if err != nil {
		t.Fatal(err)
	}
	return fault.Wrap(shm, "fault", rules...)
}

// side is one end of a connection opened through the injector.
type side struct {
	dev      transport.Device
	pd       transport.PD
	scq, rcq transport.CQ
	qp       transport.QP
	mem      []byte
	mr       transport.MR
}

func openSide(t testing.TB, p transport.Provider) *side {
	t.Helper()
	d, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	s := &side{dev: d}
	if s.pd, err = d.AllocPD(); err != nil {
		t.Fatal(err)
	}
	if s.scq, err = d.CreateCQ(64); err != nil {
		t.Fatal(err)
	}
	if s.rcq, err = d.CreateCQ(64); err != nil {
		t.Fatal(err)
	}
	if s.mem, err = d.AllocMemory(1 << 16); err != nil {
		t.Fatal(err)
	}
	if s.mr, err = s.pd.RegMR(s.mem, allAccess); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if s.qp != nil {
			s.qp.Close()
		}
		if err := s.mr.Dereg(); err != nil {
			t.Errorf("dereg: %v", err)
		}
		s.scq.Close()
		s.rcq.Close()
		// The shm PD refuses to close with registrations left, so this
		// also checks that the injector's staging memory was released.
		if err := s.pd.Close(); err != nil {
			t.Errorf("PD close: %v", err)
		}
		if err := d.FreeMemory(s.mem); err != nil {
			t.Errorf("free: %v", err)
		}
		d.Close()
	})
	return s
}

func (s *side) cfg() transport.QPConfig {
	return transport.QPConfig{
		PD: s.pd, SendCQ: s.scq, RecvCQ: s.rcq,
		MaxSendWR: 32, MaxRecvWR: 32, MaxSendSGE: 4, MaxRecvSGE: 4, MaxInline: 64,
		RetryCount: 1, RNRRetry: 7, MinRNRTimer: time.Millisecond, Timeout: 20 * time.Millisecond,
	}
}

// pair connects a client and a server, both opened through p.
func pair(t testing.TB, p transport.Provider) (cli, srv *side) {
	t.Helper()
	cli, srv = openSide(t, p), openSide(t, p)
	l, err := srv.dev.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// Closed at the end of the test, not now: closing a shm listener
	// right after Accept can race the handshake goroutine's clean-up and
	// cut the new connection (reported; see the package report).
	t.Cleanup(func() { l.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		r, err := l.Accept(ctx)
		if err != nil {
			errc <- err
			return
		}
		srv.qp, err = r.Accept(ctx, srv.cfg(), []byte("srv"))
		errc <- err
	}()
	cli.qp, err = cli.dev.Connect(ctx, l.Addr().String(), cli.cfg(), []byte("cli"))
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	// rdma_cm pads private data (56 bytes on REQ, 196 on REP); shm does too.
	if !bytes.HasPrefix(cli.qp.PeerPrivate(), []byte("srv")) || !bytes.HasPrefix(srv.qp.PeerPrivate(), []byte("cli")) {
		t.Fatalf("private data %q %q", cli.qp.PeerPrivate(), srv.qp.PeerPrivate())
	}
	return cli, srv
}

func (s *side) sge(off, n int) []transport.SGE {
	return []transport.SGE{{Addr: s.mr.Addr() + uint64(off), Length: uint32(n), LKey: s.mr.LKey()}}
}

// poll collects n completions with the canonical verbs loop (poll, arm,
// poll again, wait), so every test also exercises the wrapper's
// arm/notify path.
func poll(t testing.TB, cq transport.CQ, n int) []transport.WorkCompletion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var out []transport.WorkCompletion
	wc := make([]transport.WorkCompletion, 8)
	for len(out) < n {
		k, err := cq.Poll(wc)
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		out = append(out, wc[:k]...)
		if k > 0 {
			continue
		}
		if err := cq.ReqNotify(); err != nil {
			t.Fatal(err)
		}
		if k, err = cq.Poll(wc); err != nil {
			t.Fatal(err)
		}
		out = append(out, wc[:k]...)
		if k > 0 {
			continue
		}
		if err := cq.Wait(ctx); err != nil {
			t.Fatalf("wait with %d of %d completions: %v (%+v)", len(out), n, err, out)
		}
	}
	return out
}

func pollNone(t testing.TB, cq transport.CQ) {
	t.Helper()
	wc := make([]transport.WorkCompletion, 4)
	if n, err := cq.Poll(wc); n != 0 || err != nil {
		t.Fatalf("unexpected completions %d %v: %+v", n, err, wc[:n])
	}
}

func wantWC(t testing.TB, wc transport.WorkCompletion, id uint64, st transport.Status) {
	t.Helper()
	if wc.ID != id || wc.Status != st {
		t.Fatalf("completion %+v: want id %d status %v", wc, id, st)
	}
}

func post(t testing.TB, q transport.QP, wrs ...transport.SendWR) {
	t.Helper()
	if n, err := q.PostSend(wrs...); err != nil || n != len(wrs) {
		t.Fatalf("post send: %d, %v", n, err)
	}
}

func postRecv(t testing.TB, q transport.QP, wrs ...transport.RecvWR) {
	t.Helper()
	if n, err := q.PostRecv(wrs...); err != nil || n != len(wrs) {
		t.Fatalf("post recv: %d, %v", n, err)
	}
}
