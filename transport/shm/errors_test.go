package shm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

func waitState(t *testing.T, qp transport.QP, st transport.QPState) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, fmt.Sprintf("QP %d in state %v", qp.Num(), st), func() (bool, string) {
		got := qp.State()
		return got == st, got.String()
	})
}

func TestRemoteAccessErrors(t *testing.T) {
	cases := []struct {
		name string
		wr   func(cli, srv *side) transport.SendWR
	}{
		{"bad rkey", func(cli, srv *side) transport.SendWR {
			return transport.SendWR{Opcode: transport.OpWrite, SG: cli.sge(0, 8), RemoteAddr: srv.mr.Addr(), RKey: srv.mr.RKey() ^ 0x55}
		}},
		{"out of bounds", func(cli, srv *side) transport.SendWR {
			return transport.SendWR{Opcode: transport.OpWrite, SG: cli.sge(0, 8), RemoteAddr: srv.mr.Addr() + uint64(srv.mr.Len()) - 4, RKey: srv.mr.RKey()}
		}},
		{"read without remote read", func(cli, srv *side) transport.SendWR {
			mr, err := srv.pd.RegMR(srv.mem[:4096], transport.AccessLocalWrite)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { mr.Dereg() })
			return transport.SendWR{Opcode: transport.OpRead, SG: cli.sge(0, 8), RemoteAddr: mr.Addr(), RKey: mr.RKey()}
		}},
		{"deregistered", func(cli, srv *side) transport.SendWR {
			mr, err := srv.pd.RegMR(srv.mem[:4096], transport.AccessLocalWrite|transport.AccessRemoteWrite)
			if err != nil {
				t.Fatal(err)
			}
			if err := mr.Dereg(); err != nil {
				t.Fatal(err)
			}
			return transport.SendWR{Opcode: transport.OpWrite, SG: cli.sge(0, 8), RemoteAddr: mr.Addr(), RKey: mr.RKey()}
		}},
		{"other PD", func(cli, srv *side) transport.SendWR {
			pd2, _ := srv.dev.AllocPD()
			mr, err := pd2.RegMR(srv.mem[:4096], transport.AccessLocalWrite|transport.AccessRemoteWrite)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { mr.Dereg(); pd2.Close() })
			return transport.SendWR{Opcode: transport.OpWrite, SG: cli.sge(0, 8), RemoteAddr: mr.Addr(), RKey: mr.RKey()}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cli, srv := pair(t, nil)
			srv.qp.PostRecv(transport.RecvWR{ID: 1, SG: srv.sge(0, 8)})
			wr := tc.wr(cli, srv)
			wr.ID = 99
			if _, err := cli.qp.PostSend(wr); err != nil {
				t.Fatal(err)
			}
			wc := poll(t, cli.scq, 1)[0]
			wantStatus(t, wc, transport.StatusRemAccessErr)
			if wc.ID != 99 {
				t.Fatalf("%+v", wc)
			}
			waitState(t, cli.qp, transport.QPSErr)
			waitState(t, srv.qp, transport.QPSErr)
			// The responder's posted receive is flushed.
			wantStatus(t, poll(t, srv.rcq, 1)[0], transport.StatusWRFlushErr)
			// Later requests flush on the requester.
			cli.qp.PostSend(transport.SendWR{ID: 100, Opcode: transport.OpSend})
			wc = poll(t, cli.scq, 1)[0]
			if wc.ID != 100 || wc.Status != transport.StatusWRFlushErr {
				t.Fatalf("%+v", wc)
			}
		})
	}
}

func TestSendTooLong(t *testing.T) {
	cli, srv := pair(t, nil)
	srv.qp.PostRecv(transport.RecvWR{ID: 1, SG: srv.sge(0, 4)}, transport.RecvWR{ID: 2, SG: srv.sge(0, 4)})
	cli.qp.PostSend(transport.SendWR{ID: 5, Opcode: transport.OpSend, SG: cli.sge(0, 5)})
	wantStatus(t, poll(t, cli.scq, 1)[0], transport.StatusRemOpErr)
	rc := poll(t, srv.rcq, 2)
	if rc[0].ID != 1 || rc[0].Status != transport.StatusLocQPOpErr || rc[1].ID != 2 || rc[1].Status != transport.StatusWRFlushErr {
		t.Fatalf("%+v", rc)
	}
	waitState(t, cli.qp, transport.QPSErr)
	waitState(t, srv.qp, transport.QPSErr)
}

func TestLocalProtErr(t *testing.T) {
	cli, srv := pair(t, nil)
	srv.qp.PostRecv(transport.RecvWR{ID: 1, SG: srv.sge(0, 64)})
	sg := cli.sge(0, 8)
	sg[0].LKey ^= 0x11
	cli.qp.PostSend(transport.SendWR{ID: 3, Opcode: transport.OpSend, SG: sg})
	wc := poll(t, cli.scq, 1)[0]
	wantStatus(t, wc, transport.StatusLocQPOpErr)
	waitState(t, cli.qp, transport.QPSErr)
	if srv.qp.State() != transport.QPSRTS {
		t.Fatalf("responder state %v", srv.qp.State())
	}
}

func TestRNR(t *testing.T) {
	t.Run("exhausted", func(t *testing.T) {
		cli, _ := pair(t, func(c, s *transport.QPConfig) { c.RNRRetry = 2; c.MinRNRTimer = 2 * time.Millisecond })
		start := time.Now()
		cli.qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpSend, SG: cli.sge(0, 8)}, transport.SendWR{ID: 2, Opcode: transport.OpWrite, Signaled: true})
		wc := poll(t, cli.scq, 2)
		wantStatus(t, wc[0], transport.StatusRNRRetryExcErr)
		wantStatus(t, wc[1], transport.StatusWRFlushErr)
		if d := time.Since(start); d < 4*time.Millisecond {
			t.Fatalf("RNR retries took %v, want ≥ 2×2ms", d)
		}
		waitState(t, cli.qp, transport.QPSErr)
	})
	t.Run("infinite then posted", func(t *testing.T) {
		cli, srv := pair(t, nil) // RNRRetry 7
		cli.qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpSend, SG: cli.sge(0, 8), Signaled: true}, transport.SendWR{ID: 2, Opcode: transport.OpSend, Signaled: true})
		time.Sleep(20 * time.Millisecond) // fixed: nothing may complete while the retries go on
		pollNone(t, cli.scq)
		srv.qp.PostRecv(transport.RecvWR{ID: 10, SG: srv.sge(0, 8)}, transport.RecvWR{ID: 11})
		wc := poll(t, cli.scq, 2)
		if wc[0].ID != 1 || wc[1].ID != 2 || wc[0].Status != 0 || wc[1].Status != 0 {
			t.Fatalf("%+v", wc)
		}
		rc := poll(t, srv.rcq, 2)
		if rc[0].ID != 10 || rc[0].ByteLen != 8 || rc[1].ID != 11 || rc[1].ByteLen != 0 {
			t.Fatalf("%+v", rc)
		}
	})
}

func TestPostErrors(t *testing.T) {
	cli, srv := pair(t, func(c, s *transport.QPConfig) { c.MaxSendWR = 2; s.MaxRecvWR = 2 })
	_, err := cli.qp.PostSend(transport.SendWR{Opcode: transport.OpSend, SG: make([]transport.SGE, 5)})
	if !errors.Is(err, transport.ErrInvalidWR) {
		t.Fatalf("too many SGEs: %v", err)
	}
	_, err = cli.qp.PostSend(transport.SendWR{Opcode: transport.OpSend, SG: cli.sge(0, 65), Inline: true})
	if !errors.Is(err, transport.ErrInvalidWR) {
		t.Fatalf("inline too large: %v", err)
	}
	n, err := srv.qp.PostRecv(transport.RecvWR{ID: 1}, transport.RecvWR{ID: 2}, transport.RecvWR{ID: 3})
	if n != 2 || !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("recv queue full: %d %v", n, err)
	}
	// Unsignaled successful sends occupy the send queue until a later
	// signaled completion is polled.
	w := transport.SendWR{Opcode: transport.OpWrite}
	n, err = cli.qp.PostSend(w, w, w)
	if n != 2 || !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("send queue full: %d %v", n, err)
	}
	pollNone(t, cli.scq)
	if _, err := cli.qp.PostSend(w); !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("still full: %v", err)
	}
}

func TestSendQueueRetire(t *testing.T) {
	cli, _ := pair(t, func(c, s *transport.QPConfig) { c.MaxSendWR = 2 })
	w := transport.SendWR{Opcode: transport.OpWrite}
	sig := transport.SendWR{ID: 9, Opcode: transport.OpWrite, Signaled: true}
	if n, err := cli.qp.PostSend(w, sig); n != 2 || err != nil {
		t.Fatal(n, err)
	}
	if _, err := cli.qp.PostSend(w); !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("%v", err)
	}
	poll(t, cli.scq, 1)
	if n, err := cli.qp.PostSend(w, sig); n != 2 || err != nil {
		t.Fatalf("after retiring: %d %v", n, err)
	}
}

func TestCQOverflow(t *testing.T) {
	cli, srv, l := listenSides(t, 2, 64)
	defer l.Close()
	ctx := context.Background()
	accepted := make(chan transport.QP, 1)
	go func() {
		r, err := l.Accept(ctx)
		if err != nil {
			accepted <- nil
			return
		}
		q, _ := r.Accept(ctx, srv.cfg(), nil)
		accepted <- q
	}()
	var err error
	cli.qp, err = cli.dev.Connect(ctx, l.Addr().String(), cli.cfg(), []byte("hello"))
	if err != nil {
		t.Fatal(err)
	}
	if srv.qp = <-accepted; srv.qp == nil {
		t.Fatal("accept failed")
	}
	w := transport.SendWR{Opcode: transport.OpWrite, Signaled: true}
	cli.qp.PostSend(w, w, w)
	wc := make([]transport.WorkCompletion, 4)
	if _, err := cli.scq.Poll(wc); !errors.Is(err, transport.ErrCQOverflow) {
		t.Fatalf("poll: %v", err)
	}
	waitState(t, cli.qp, transport.QPSErr)
}

func TestNotifyWait(t *testing.T) {
	cli, srv := pair(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	if err := srv.rcq.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait without notification: %v", err)
	}
	cancel()
	srv.qp.PostRecv(transport.RecvWR{ID: 1})
	if err := srv.rcq.ReqNotify(); err != nil {
		t.Fatal(err)
	}
	pollNone(t, srv.rcq)
	done := make(chan error, 1)
	go func() { done <- srv.rcq.Wait(context.Background()) }()
	time.Sleep(5 * time.Millisecond) // fixed: Wait must be asleep, a state it does not show
	cli.qp.PostSend(transport.SendWR{Opcode: transport.OpSend})
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Wait not woken by a completion from the peer")
	}
	poll(t, srv.rcq, 1)
	// Not armed: a completion does not wake.
	srv.qp.PostRecv(transport.RecvWR{ID: 2})
	cli.qp.PostSend(transport.SendWR{Opcode: transport.OpSend})
	poll(t, srv.rcq, 1)
	ctx, cancel = context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := srv.rcq.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait on unarmed CQ: %v", err)
	}
	// Close unblocks a waiter.
	go func() { time.Sleep(5 * time.Millisecond); cli.scq.Close() }() // while Wait sleeps
	if err := cli.scq.Wait(context.Background()); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("wait after close: %v", err)
	}
}

func TestDisconnectFlush(t *testing.T) {
	cli, srv := pair(t, nil)
	srv.qp.PostRecv(transport.RecvWR{ID: 1}, transport.RecvWR{ID: 2})
	cli.qp.PostRecv(transport.RecvWR{ID: 3})
	if err := cli.qp.Disconnect(); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*side{cli, srv} {
		select {
		case <-s.qp.Disconnected():
		case <-time.After(5 * time.Second):
			t.Fatal("Disconnected not closed")
		}
		if s.qp.State() != transport.QPSErr {
			t.Fatalf("state %v", s.qp.State())
		}
	}
	for _, wc := range poll(t, srv.rcq, 2) {
		wantStatus(t, wc, transport.StatusWRFlushErr)
	}
	wantStatus(t, poll(t, cli.rcq, 1)[0], transport.StatusWRFlushErr)
	// Posting in ERROR is accepted and flushed.
	if _, err := srv.qp.PostSend(transport.SendWR{ID: 4, Opcode: transport.OpSend}); err != nil {
		t.Fatal(err)
	}
	wc := poll(t, srv.scq, 1)[0]
	if wc.ID != 4 || wc.Status != transport.StatusWRFlushErr {
		t.Fatalf("%+v", wc)
	}
	srv.qp.PostRecv(transport.RecvWR{ID: 5})
	if wc := poll(t, srv.rcq, 1)[0]; wc.ID != 5 || wc.Status != transport.StatusWRFlushErr {
		t.Fatalf("%+v", wc)
	}
}

func TestSetError(t *testing.T) {
	cli, srv := pair(t, func(c, s *transport.QPConfig) { c.RetryCount = 1; c.Timeout = 5 * time.Millisecond })
	srv.qp.PostRecv(transport.RecvWR{ID: 1})
	srv.qp.SetError()
	wantStatus(t, poll(t, srv.rcq, 1)[0], transport.StatusWRFlushErr)
	// The peer is not told: its requests time out as if dropped.
	cli.qp.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpWrite, SG: cli.sge(0, 1), RemoteAddr: srv.mr.Addr(), RKey: srv.mr.RKey()})
	wantStatus(t, poll(t, cli.scq, 1)[0], transport.StatusRetryExcErr)
}

func TestConnectErrors(t *testing.T) {
	s := openSide(t, 4)
	ctx := context.Background()
	if _, err := s.dev.Connect(ctx, "127.0.0.1:1", s.cfg(), nil); !errors.Is(err, transport.ErrConnRefused) {
		t.Fatalf("nothing listening: %v", err)
	}
	l, err := s.dev.Listen(":0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	a := l.Addr()
	if a.Network() != "rdma" {
		t.Fatalf("network %q", a.Network())
	}
	_, port, _ := net.SplitHostPort(a.String())
	if port == "0" {
		t.Fatalf("port not chosen: %v", a)
	}
	go func() {
		r, err := l.Accept(ctx)
		if err == nil {
			r.Reject([]byte("go away"))
		}
	}()
	// A wildcard listener is reachable through 127.0.0.1.
	_, err = s.dev.Connect(ctx, "127.0.0.1:"+port, s.cfg(), nil)
	var rej *transport.RejectError
	if !errors.As(err, &rej) || string(bytes.TrimRight(rej.Private, "\x00")) != "go away" || len(rej.Private) != transport.PrivateLenReject {
		t.Fatalf("reject: %v", err)
	}
	if _, err := s.dev.Connect(ctx, "127.0.0.1:2", s.cfg(), make([]byte, transport.MaxPrivateData+1)); err == nil {
		t.Fatal("oversized private data accepted")
	}
	l.Close()
	if _, err := l.Accept(ctx); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("accept after close: %v", err)
	}
}

func TestRegMRNotAllocMemory(t *testing.T) {
	s := openSide(t, 4)
	if _, err := s.pd.RegMR(make([]byte, 4096), transport.AccessLocalWrite); err == nil {
		t.Fatal("registered Go heap memory")
	}
	if _, err := s.pd.RegMR(s.mem, transport.AccessRemoteWrite); err == nil {
		t.Fatal("remote write without local write accepted")
	}
	sub, err := s.pd.RegMR(s.mem[4096:8192], transport.AccessLocalWrite)
	if err != nil {
		t.Fatalf("sub-slice of AllocMemory: %v", err)
	}
	if sub.Addr() != s.mr.Addr()+4096 || sub.Len() != 4096 {
		t.Fatalf("sub MR %#x %d", sub.Addr(), sub.Len())
	}
	sub.Dereg()
	if err := sub.Dereg(); err == nil {
		t.Fatal("double dereg")
	}
}

func TestPeerMappingSweep(t *testing.T) {
	cli, srv := pair(t, nil)
	for i := range 3 * sweepAt {
		mem, err := srv.dev.AllocMemory(4096)
		if err != nil {
			t.Fatal(err)
		}
		mr, err := srv.pd.RegMR(mem, transport.AccessLocalWrite|transport.AccessRemoteWrite)
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.dev.FreeMemory(mem); err == nil {
			t.Fatal("freed memory with a registered MR")
		}
		cli.qp.PostSend(transport.SendWR{ID: uint64(i), Opcode: transport.OpWrite, SG: cli.sge(0, 8), RemoteAddr: mr.Addr(), RKey: mr.RKey(), Signaled: true})
		wantStatus(t, poll(t, cli.scq, 1)[0], transport.StatusSuccess)
		mr.Dereg()
		if err := srv.dev.FreeMemory(mem); err != nil {
			t.Fatal(err)
		}
	}
	q := cli.qp.(*qp)
	q.sendMu.Lock()
	n := len(q.peer.maps)
	q.sendMu.Unlock()
	if n > sweepAt+1 {
		t.Fatalf("%d peer mappings cached after the peer freed them", n)
	}
}

// A connect request whose descriptors the kernel cut off because the
// listener's process is out of them is refused with a reason, not
// answered by a bare close that the dialer would read as an end of file.
// Here the descriptor limit is lowered to the lowest free number while
// the request is read, so that not one of its three can be installed.
func TestConnectRequestOutOfDescriptorsRefused(t *testing.T) {
	_, _, l := listenSides(t, 8, 8)
	defer l.Close()
	c, fds := rawSocket(t, l, infoFDs)
	awaitPending(t, l.(*listener))
	restore := outOfDescriptors(t)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	werr := writeMsg(c, []byte{msgConnect}, fds...)
	b, _, rerr := readMsg(c, make([]byte, maxMsg), nil)
	restore()
	if werr != nil || rerr != nil {
		t.Fatalf("request: %v; answer: %v", werr, rerr)
	}
	wantListenerFailed(t, b, "out of file descriptors")
}

// A request with more descriptors than a request carries is malformed,
// closed without an answer, as any other.
func TestConnectRequestTooManyDescriptorsClosed(t *testing.T) {
	_, _, l := listenSides(t, 8, 8)
	defer l.Close()
	c, fds := rawSocket(t, l, 8) // the listener's buffer holds a request's 3 and a little more
	if err := writeMsg(c, []byte{msgConnect}, fds...); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if b, _, err := readMsg(c, make([]byte, maxMsg), nil); !errors.Is(err, io.EOF) {
		t.Fatalf("answer %q, %v; want the socket closed", b, err)
	}
}

// A request the listener cannot set up once Accept takes it is refused
// with a reason too: here its descriptors are not memfds.
func TestConnectRequestAcceptFailureRefused(t *testing.T) {
	_, srv, l := listenSides(t, 8, 8)
	defer l.Close()
	info := qpInfo{num: 1, recvCap: 4, recvSGE: 1, cqCap: 8, addr: netip.MustParseAddrPort("127.0.0.1:1"), private: []byte("hello")}
	c, fds := rawSocket(t, l, infoFDs)
	if err := writeMsg(c, info.encode(msgConnect), fds...); err != nil {
		t.Fatal(err)
	}
	r, err := l.Accept(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if qp, err := r.Accept(t.Context(), srv.cfg(), nil); err == nil {
		qp.Close()
		t.Fatal("accepted a request whose descriptors are not memfds")
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, _, err := readMsg(c, make([]byte, maxMsg), nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	wantListenerFailed(t, b, "map peer memory") // a reject carries 56 bytes: the reason is cut
}

// A request that was not in the socket yet is waited for in Go's
// netpoller; the socket leaves it again before the request is handed on,
// so that a live connection's wake-ups wake the socket poller alone (in
// the netpoller, every message each way would wake its thread too).
func TestWaitedRequestLeavesNetpoller(t *testing.T) {
	_, _, l := listenSides(t, 8, 8)
	defer l.Close()
	c, fds := rawSocket(t, l, infoFDs)
	sl := l.(*listener)
	awaitPending(t, sl)
	info := qpInfo{num: 1, recvCap: 4, recvSGE: 1, cqCap: 8, addr: netip.MustParseAddrPort("127.0.0.1:1")}
	if err := writeMsg(c, info.encode(msgConnect), fds...); err != nil {
		t.Fatal(err)
	}
	r, err := l.Accept(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer r.Reject(nil)
	if s, ok := r.(*connReq).s.(*rawSock); !ok {
		t.Fatalf("the request's socket is a %T, want a *rawSock (outside Go's netpoller)", r.(*connReq).s)
	} else if s.fd < 0 {
		t.Fatal("the request's socket is closed")
	}
	sl.mu.Lock()
	n := len(sl.pending)
	sl.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d sockets still pending after the request was read", n)
	}
}

// awaitPending waits until l has accepted one socket and waits for its
// request (the pending set).
func awaitPending(t *testing.T, l *listener) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "the listener to take the socket", func() (bool, string) {
		l.mu.Lock()
		n := len(l.pending)
		l.mu.Unlock()
		return n == 1, fmt.Sprintf("%d pending", n) // accepted, its request not read yet
	})
}

// rawSocket connects to l over a socket of its own and returns it with n
// descriptors (of standard input) to send, closed at the test's end.
func rawSocket(t *testing.T, l transport.Listener, n int) (*net.UnixConn, []int) {
	t.Helper()
	a := l.Addr().(*Addr)
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: sockName(a.IP, a.Port), Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	var fds []int
	t.Cleanup(func() { closeFDs(fds) })
	for range n {
		fd, err := unix.Dup(int(os.Stdin.Fd()))
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, fd)
	}
	return c, fds
}

// wantListenerFailed checks the listener's answer b: a reject saying it
// could not take the connection, and why.
func wantListenerFailed(t *testing.T, b []byte, why string) {
	t.Helper()
	if len(b) < 2 || b[0] != msgReject || !bytes.HasPrefix(b[2:], transport.RejectListenerFailed) {
		t.Fatalf("answer %q, want a reject that says the listener failed", b)
	}
	if !bytes.Contains(b, []byte(why)) {
		t.Errorf("the reject does not say %q: %q", why, b)
	}
}

// A dialer sends msgReady only to a listener whose accept lacks
// acceptNoReady: a listener with the flag starts the connection when it
// accepts, and the message would only wake it.
func TestReadyOnlyForEarlierListeners(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags byte
		want  uint64
	}{
		{"this version", acceptNoReady, 0},
		{"earlier version", 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			saved := acceptFlags
			acceptFlags = tc.flags
			t.Cleanup(func() { acceptFlags = saved })
			before := readies.Load()
			cli, srv := pair(t, nil)
			// The dialer sent msgReady, if at all, on the connection's
			// socket before Connect returned; the listener reads what
			// comes on it in order, so once it has read the disconnect
			// sent after, it has read that too.
			if err := cli.qp.Disconnect(); err != nil {
				t.Fatal(err)
			}
			select {
			case <-srv.qp.Disconnected():
			case <-time.After(5 * time.Second):
				t.Fatal("the listener's side never saw the disconnect")
			}
			if got := readies.Load() - before; got != tc.want {
				t.Fatalf("the listener read %d msgReady, want %d", got, tc.want)
			}
		})
	}
}

// A listener whose process is out of descriptors cannot accept a
// connection's socket: it warns, waits and tries again, and takes the
// socket once descriptors are free, rather than end its accept loop.
func TestListenerAcceptsAgainAfterOutOfDescriptors(t *testing.T) {
	_, _, l := listenSides(t, 8, 8)
	defer l.Close()
	a := l.Addr().(*Addr)
	// The socket is made before the limit is lowered: connect needs no
	// descriptor of its own.
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	restore := outOfDescriptors(t)
	defer restore()
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: sockName(a.IP, a.Port)}); err != nil {
		t.Fatal(err)
	}
	sl := l.(*listener)
	testutil.Eventually(t, 5*time.Second, "the listener to try to take the socket", testutil.Bool(func() bool { return sl.lastWarn.Load() != 0 }))
	restore()
	// Not a request: the listener, once it has the socket, closes it.
	if err := unix.Sendmsg(fd, []byte{0xee}, nil, nil, 0); err != nil {
		t.Fatal(err)
	}
	tv := unix.NsecToTimeval(int64(5 * time.Second))
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	if n, _, _, _, err := unix.Recvmsg(fd, make([]byte, 16), nil, 0); n != 0 || err != nil {
		t.Fatalf("read %d bytes, %v; want the socket closed by the listener", n, err)
	}
}

// outOfDescriptors lowers the descriptor limit to the lowest free number,
// so that no descriptor can be made, and returns what restores it (once,
// however often it is called).
func outOfDescriptors(t *testing.T) (restore func()) {
	t.Helper()
	var saved unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &saved); err != nil {
		t.Fatal(err)
	}
	free, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(free)
	low := saved
	low.Cur = uint64(free)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Skipf("cannot lower the descriptor limit: %v", err)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &saved); err != nil {
				t.Error(err)
			}
		})
	}
}

// A misplaced QP ring or CQ header is refused with a reason that says
// what is wrong, and none ends in a "<nil>" of an absent error: the
// reason goes to the dialer in the reject.
func TestPeerPlacementReasons(t *testing.T) {
	for _, tc := range []struct {
		ringOff, cqOff uint64
		want           string
	}{
		{4, 0, "QP ring: offset 4 is not a multiple of 8"},
		{4096, 0, "QP ring: peer placed"},
		{0, 12, "CQ header: offset 12 is not a multiple of 8"},
		{0, 4096, "CQ header: peer placed"},
	} {
		maps := []peerMapping{{mem: make([]byte, mrTableSize)}, {mem: make([]byte, 4096)}, {mem: make([]byte, 4096)}}
		info := qpInfo{recvCap: 4, recvSGE: 1, cqCap: 8, ringOff: tc.ringOff, cqOff: tc.cqOff}
		_, err := newPeerOf(info, maps, false)
		if err == nil {
			t.Fatalf("ring at %d, CQ at %d: accepted", tc.ringOff, tc.cqOff)
		}
		if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "<nil>") {
			t.Errorf("ring at %d, CQ at %d: %q, want it to say %q", tc.ringOff, tc.cqOff, err, tc.want)
		}
	}
}
