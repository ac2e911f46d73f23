//go:build cgo

package verbs

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// openOrSkip opens the default RDMA device, or skips the test naming what
// is missing. These tests run for real inside the Soft-RoCE guest
// (tests/rxe).
func openOrSkip(t *testing.T) transport.Device {
	t.Helper()
	p, err := transport.Get(Name)
	if err != nil {
		t.Fatal(err)
	}
	d, err := p.Open(os.Getenv("RDMAGRPC_VERBS_DEVICE"))
	if errors.Is(err, transport.ErrUnavailable) {
		t.Skipf("no usable RDMA device, skipping (run inside the tests/rxe guest): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("Device.Close: %v", err)
		}
	})
	return d
}

// hostIP is the address the tests listen on and connect to.
func hostIP(t *testing.T, d transport.Device) string {
	t.Helper()
	for _, env := range []string{"RDMAGRPC_VERBS_ADDR", "RXE_ADDR"} { // RXE_ADDR: set by tests/rxe
		if a := os.Getenv(env); a != "" {
			return a
		}
	}
	ip, ok := IPv4(d)
	if !ok {
		t.Skip("device has no IPv4 GID; set RDMAGRPC_VERBS_ADDR")
	}
	return ip.String()
}

// side is one end of a test connection with its resources.
type side struct {
	t      *testing.T
	dev    transport.Device
	pd     transport.PD
	cq     transport.CQ
	mem    []byte
	mr     transport.MR
	qp     transport.QP
	access transport.Access
	mod    func(*transport.QPConfig) // changes cfg's configuration
}

func newSide(t *testing.T, d transport.Device, access transport.Access) *side {
	t.Helper()
	s := &side{t: t, dev: d, access: access}
	var err error
	if s.pd, err = d.AllocPD(); err != nil {
		t.Fatal(err)
	}
	if s.cq, err = d.CreateCQ(64); err != nil {
		t.Fatal(err)
	}
	if s.mem, err = d.AllocMemory(1 << 16); err != nil {
		t.Fatal(err)
	}
	if s.mr, err = s.pd.RegMR(s.mem, access); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.close)
	return s
}

func (s *side) cfg() transport.QPConfig {
	c := transport.QPConfig{PD: s.pd, SendCQ: s.cq, RecvCQ: s.cq, MaxSendWR: 16, MaxRecvWR: 16,
		MaxSendSGE: 2, MaxRecvSGE: 2, MaxInline: 64}
	if s.mod != nil {
		s.mod(&c)
	}
	return c
}

func (s *side) close() {
	t := s.t
	if s.qp != nil {
		if err := s.qp.Close(); err != nil {
			t.Errorf("QP.Close: %v", err)
		}
	}
	if err := s.mr.Dereg(); err != nil {
		t.Errorf("Dereg: %v", err)
	}
	if err := s.dev.FreeMemory(s.mem); err != nil {
		t.Errorf("FreeMemory: %v", err)
	}
	if err := s.cq.Close(); err != nil {
		t.Errorf("CQ.Close: %v", err)
	}
	if err := s.pd.Close(); err != nil {
		t.Errorf("PD.Close: %v", err)
	}
}

func (s *side) sge(off, n int) []transport.SGE {
	return []transport.SGE{{Addr: s.mr.Addr() + uint64(off), Length: uint32(n), LKey: s.mr.LKey()}}
}

// next returns the next completion, sleeping on the completion channel.
func (s *side) next(ctx context.Context) transport.WorkCompletion {
	s.t.Helper()
	var wc [1]transport.WorkCompletion
	for {
		n, err := s.cq.Poll(wc[:])
		if err != nil {
			s.t.Fatalf("Poll: %v", err)
		}
		if n == 1 {
			return wc[0]
		}
		if err := s.cq.ReqNotify(); err != nil {
			s.t.Fatalf("ReqNotify: %v", err)
		}
		if n, _ = s.cq.Poll(wc[:]); n == 1 {
			return wc[0]
		}
		if err := s.cq.Wait(ctx); err != nil {
			s.t.Fatalf("Wait: %v", err)
		}
	}
}

// pair connects a client and a server on d and returns both sides.
func pair(t *testing.T, d transport.Device, cliPriv, srvPriv []byte) (cli, srv *side) {
	t.Helper()
	return pairWith(t, d, cliPriv, srvPriv, nil)
}

// pairWith is pair with both QPs' configuration changed by mod.
func pairWith(t *testing.T, d transport.Device, cliPriv, srvPriv []byte, mod func(*transport.QPConfig)) (cli, srv *side) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	all := transport.AccessLocalWrite | transport.AccessRemoteWrite | transport.AccessRemoteRead
	cli, srv = newSide(t, d, all), newSide(t, d, all)
	cli.mod, srv.mod = mod, mod
	l, err := d.Listen(net.JoinHostPort(hostIP(t, d), "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	type res struct {
		qp  transport.QP
		err error
	}
	done := make(chan res, 1)
	go func() {
		req, err := l.Accept(ctx)
		if err != nil {
			done <- res{nil, err}
			return
		}
		if !bytes.HasPrefix(req.PeerPrivate(), cliPriv) {
			req.Reject(nil)
			done <- res{nil, errors.New("bad connect private data")}
			return
		}
		qp, err := req.Accept(ctx, srv.cfg(), srvPriv)
		done <- res{qp, err}
	}()
	cli.qp, err = d.Connect(ctx, l.Addr().String(), cli.cfg(), cliPriv)
	if err != nil {
		t.Fatalf("Connect: %v", err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("server side: %v", r.err)
	}
	srv.qp = r.qp
	return cli, srv
}

func TestVerbsSendRecvPrivateData(t *testing.T) {
	d := openOrSkip(t)
	cliPriv, srvPriv := []byte("hello from client"), []byte("welcome")
	cli, srv := pair(t, d, cliPriv, srvPriv)
	t.Logf("device %s attr %+v; client %v→%v QP %d, server QP %d", d.Name(), d.Attr(),
		cli.qp.LocalAddr(), cli.qp.RemoteAddr(), cli.qp.Num(), srv.qp.Num())

	// rdma_cm pads private data to the CM message size.
	if p := cli.qp.PeerPrivate(); !bytes.HasPrefix(p, srvPriv) || !allZero(p[len(srvPriv):]) {
		t.Errorf("client sees accept private data %q", p)
	}
	if p := srv.qp.PeerPrivate(); !bytes.HasPrefix(p, cliPriv) || !allZero(p[len(cliPriv):]) {
		t.Errorf("server sees connect private data %q", p)
	}
	t.Logf("private data lengths seen: connect %d, accept %d", len(srv.qp.PeerPrivate()), len(cli.qp.PeerPrivate()))
	if s := cli.qp.State(); s != transport.QPSRTS {
		t.Errorf("client QP state %v", s)
	}
	if got, want := srv.qp.RemoteAddr().String(), cli.qp.LocalAddr().String(); got != want {
		t.Errorf("server RemoteAddr %s, client LocalAddr %s", got, want)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := srv.qp.PostRecv(transport.RecvWR{ID: 7, SG: srv.sge(0, 4096)}); err != nil {
		t.Fatal(err)
	}
	msg := []byte("a message over Soft-RoCE")
	copy(cli.mem, msg)
	if _, err := cli.qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpSendWithImm, SG: cli.sge(0, len(msg)),
		Imm: 0x01020304, Signaled: true}); err != nil {
		t.Fatal(err)
	}
	if wc := cli.next(ctx); wc.Err() != nil || wc.ID != 1 || wc.Opcode != transport.WCSend {
		t.Fatalf("send completion %+v (%v)", wc, wc.Err())
	}
	wc := srv.next(ctx)
	if wc.Err() != nil || wc.ID != 7 || wc.Opcode != transport.WCRecv || wc.ByteLen != uint32(len(msg)) ||
		!wc.HasImm || wc.Imm != 0x01020304 || wc.QPNum != srv.qp.Num() {
		t.Fatalf("recv completion %+v (%v)", wc, wc.Err())
	}
	if !bytes.Equal(srv.mem[:len(msg)], msg) {
		t.Fatalf("received %q", srv.mem[:len(msg)])
	}

	// Inline send, unsignaled, followed by a signaled one.
	srv.qp.PostRecv(transport.RecvWR{ID: 8, SG: srv.sge(0, 64)}, transport.RecvWR{ID: 9, SG: srv.sge(64, 64)})
	copy(cli.mem[100:], "inline!")
	if n, err := cli.qp.PostSend(
		transport.SendWR{ID: 2, Opcode: transport.OpSend, SG: cli.sge(100, 7), Inline: true},
		transport.SendWR{ID: 3, Opcode: transport.OpSend, SG: cli.sge(100, 7), Signaled: true}); n != 2 || err != nil {
		t.Fatalf("PostSend = %d, %v", n, err)
	}
	if wc := cli.next(ctx); wc.ID != 3 || wc.Err() != nil {
		t.Fatalf("expected only the signaled completion, got %+v", wc)
	}
	for _, id := range []uint64{8, 9} {
		if wc := srv.next(ctx); wc.ID != id || wc.ByteLen != 7 || wc.HasImm || wc.Err() != nil {
			t.Fatalf("recv %d: %+v", id, wc)
		}
	}
}

func TestVerbsWriteWithImmAndRead(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pair(t, d, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	payload := bytes.Repeat([]byte("0123456789abcdef"), 1024) // 16 KiB
	copy(cli.mem, payload)
	srv.qp.PostRecv(transport.RecvWR{ID: 11}) // WRITE_WITH_IMM consumes a receive; no SGE needed
	if _, err := cli.qp.PostSend(transport.SendWR{ID: 12, Opcode: transport.OpWriteWithImm, SG: cli.sge(0, len(payload)),
		RemoteAddr: srv.mr.Addr() + 4096, RKey: srv.mr.RKey(), Imm: 0xdeadbeef, Signaled: true}); err != nil {
		t.Fatal(err)
	}
	if wc := cli.next(ctx); wc.Err() != nil || wc.Opcode != transport.WCRDMAWrite {
		t.Fatalf("write completion %+v (%v)", wc, wc.Err())
	}
	wc := srv.next(ctx)
	if wc.Err() != nil || wc.ID != 11 || wc.Opcode != transport.WCRecvRDMAWithImm || !wc.HasImm || wc.Imm != 0xdeadbeef ||
		wc.ByteLen != uint32(len(payload)) {
		t.Fatalf("write-with-imm receive %+v (%v)", wc, wc.Err())
	}
	if !bytes.Equal(srv.mem[4096:4096+len(payload)], payload) {
		t.Fatal("written data differs")
	}

	// READ it back into another part of the client's memory, two SGEs.
	sg := []transport.SGE{
		{Addr: cli.mr.Addr() + 32768, Length: 1000, LKey: cli.mr.LKey()},
		{Addr: cli.mr.Addr() + 40000, Length: uint32(len(payload) - 1000), LKey: cli.mr.LKey()},
	}
	if _, err := cli.qp.PostSend(transport.SendWR{ID: 13, Opcode: transport.OpRead, SG: sg,
		RemoteAddr: srv.mr.Addr() + 4096, RKey: srv.mr.RKey(), Signaled: true}); err != nil {
		t.Fatal(err)
	}
	if wc := cli.next(ctx); wc.Err() != nil || wc.ID != 13 || wc.Opcode != transport.WCRDMARead || wc.ByteLen != uint32(len(payload)) {
		t.Fatalf("read completion %+v (%v)", wc, wc.Err())
	}
	got := append(append([]byte{}, cli.mem[32768:32768+1000]...), cli.mem[40000:40000+len(payload)-1000]...)
	if !bytes.Equal(got, payload) {
		t.Fatal("read data differs")
	}
}

func TestVerbsRemoteAccessError(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pair(t, d, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ro, err := srv.pd.RegMR(srv.mem[:4096], transport.AccessLocalWrite|transport.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Dereg()
	cli.qp.PostSend(transport.SendWR{ID: 21, Opcode: transport.OpWrite, SG: cli.sge(0, 8),
		RemoteAddr: ro.Addr(), RKey: ro.RKey(), Signaled: true})
	wc := cli.next(ctx)
	if wc.Status != transport.StatusRemAccessErr {
		t.Fatalf("write to read-only MR: %+v, want %v", wc, transport.StatusRemAccessErr)
	}
	var ce *transport.CompletionError
	if !errors.As(wc.Err(), &ce) || ce.ID != 21 {
		t.Fatalf("Err() = %v", wc.Err())
	}
	// The QP is in ERROR now: further work is flushed.
	if s := cli.qp.State(); s != transport.QPSErr {
		t.Errorf("state after remote access error: %v", s)
	}
	n, err := cli.qp.PostSend(transport.SendWR{ID: 22, Opcode: transport.OpSend, SG: cli.sge(0, 8), Signaled: true})
	t.Logf("PostSend in ERROR: n=%d err=%v", n, err)
	if err == nil {
		wc := cli.next(ctx)
		if wc.ID != 22 || wc.Status != transport.StatusWRFlushErr {
			t.Fatalf("post after error: %+v", wc)
		}
	}
}

func TestVerbsRejectAndRefused(t *testing.T) {
	d := openOrSkip(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := newSide(t, d, transport.AccessLocalWrite)
	host := hostIP(t, d)

	l, err := d.Listen(net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		req, err := l.Accept(ctx)
		if err == nil {
			req.Reject([]byte("go away"))
		}
	}()
	_, err = d.Connect(ctx, l.Addr().String(), s.cfg(), []byte("knock"))
	var rej *transport.RejectError
	if !errors.As(err, &rej) {
		t.Fatalf("Connect to rejecting listener: %v, want *transport.RejectError", err)
	}
	if !bytes.HasPrefix(rej.Private, []byte("go away")) || !allZero(rej.Private[7:]) {
		t.Fatalf("reject private data %q", rej.Private)
	}
	t.Logf("reject private data length %d", len(rej.Private))
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Accept(ctx); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Close: %v", err)
	}

	addr := netip.AddrPortFrom(netip.MustParseAddr(host), uint16(port)).String()
	_, err = d.Connect(ctx, addr, s.cfg(), nil)
	if !errors.Is(err, transport.ErrConnRefused) {
		t.Fatalf("Connect with no listener: %v, want ErrConnRefused", err)
	}
	t.Logf("no listener: %v", err)
}

func TestVerbsDisconnectFlushes(t *testing.T) {
	d := openOrSkip(t)
	cli, srv := pair(t, d, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := srv.qp.PostRecv(transport.RecvWR{ID: 31, SG: srv.sge(0, 64)}); err != nil {
		t.Fatal(err)
	}
	if err := cli.qp.Disconnect(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-srv.qp.Disconnected():
	case <-ctx.Done():
		t.Fatal("server never saw the disconnect")
	}
	if s := srv.qp.State(); s != transport.QPSErr {
		t.Errorf("server QP state after peer disconnect: %v", s)
	}
	wc := srv.next(ctx)
	if wc.ID != 31 || wc.Status != transport.StatusWRFlushErr {
		t.Fatalf("outstanding receive after disconnect: %+v", wc)
	}
}

func TestVerbsWaitHonoursContext(t *testing.T) {
	d := openOrSkip(t)
	cq, err := d.CreateCQ(4)
	if err != nil {
		t.Fatal(err)
	}
	if err := cq.ReqNotify(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := cq.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait with deadline: %v", err)
	}
	ctx2, cancel2 := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel2)
	if err := cq.Wait(ctx2); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait with cancel: %v", err)
	}
	errc := make(chan error, 1)
	go func() { errc <- cq.Wait(context.Background()) }()
	time.Sleep(20 * time.Millisecond) // fixed: Wait must be asleep, a state it does not show
	if err := cq.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Wait across Close: %v", err)
	}
}

func TestVerbsMemoryRules(t *testing.T) {
	d := openOrSkip(t)
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	if _, err := pd.RegMR(make([]byte, 4096), transport.AccessLocalWrite); err == nil {
		t.Fatal("RegMR accepted Go heap memory")
	}
	mem, err := d.AllocMemory(10000)
	if err != nil {
		t.Fatal(err)
	}
	if len(mem) != 10000 || uintptrOf(mem)%uintptr(os.Getpagesize()) != 0 {
		t.Fatalf("AllocMemory: len %d at %#x", len(mem), uintptrOf(mem))
	}
	m, err := pd.RegMR(mem[4096:], transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	if m.Addr() != uint64(uintptrOf(mem))+4096 || m.Len() != 10000-4096 {
		t.Fatalf("MR addr %#x len %d", m.Addr(), m.Len())
	}
	if err := d.FreeMemory(mem); err == nil {
		t.Fatal("FreeMemory with a live MR succeeded")
	}
	if err := m.Dereg(); err != nil {
		t.Fatal(err)
	}
	if err := d.FreeMemory(mem); err != nil {
		t.Fatal(err)
	}
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// RDMAGRPC_VERBS_TC puts the traffic class on the connection's path: the
// dialing QP's address vector carries it, as the device reports it.
func TestVerbsTrafficClass(t *testing.T) {
	t.Setenv(TrafficClassEnv, "104")
	d := openOrSkip(t)
	cli, srv := pair(t, d, []byte("tc"), nil)
	if got := trafficClassOf(cli.qp); got != 104 {
		t.Fatalf("dialing QP traffic class %d, want 104", got)
	}
	t.Logf("traffic class: dialer %d, acceptor %d", trafficClassOf(cli.qp), trafficClassOf(srv.qp))
}

// The environment's RC attributes reach the queue pair: the device
// reports the local ACK timeout, retry count and RNR retry we set.
func TestVerbsRCAttrsFromEnv(t *testing.T) {
	t.Setenv(TimeoutEnv, "18")
	t.Setenv(RetryCountEnv, "5")
	t.Setenv(RNRRetryEnv, "3")
	d := openOrSkip(t)
	cli, srv := pair(t, d, []byte("rc"), nil)
	for _, q := range []struct {
		who string
		qp  transport.QP
	}{{"dialer", cli.qp}, {"acceptor", srv.qp}} {
		timeout, retry, rnr, ok := rcAttrsOf(q.qp)
		if !ok {
			t.Fatalf("%s: ibv_query_qp failed", q.who)
		}
		t.Logf("%s: timeout %d, retry count %d, RNR retry %d", q.who, timeout, retry, rnr)
		if timeout != 18 || retry != 5 || rnr != 3 {
			t.Errorf("%s: timeout %d, retry %d, RNR retry %d; want 18, 5, 3", q.who, timeout, retry, rnr)
		}
	}
}

// eachPath calls check with the path of each end's QP.
func eachPath(t *testing.T, cli, srv *side, check func(who string, q transport.QP, p transport.Path)) {
	t.Helper()
	for _, e := range []struct {
		who string
		qp  transport.QP
	}{{"dialer", cli.qp}, {"acceptor", srv.qp}} {
		p, err := e.qp.(transport.PathQP).Path()
		if err != nil {
			t.Fatalf("%s: %v", e.who, err)
		}
		check(e.who, e.qp, p)
	}
}

// sendOne sends a message from a to b and checks it arrives: the path the
// QPs were programmed with carries traffic.
func sendOne(t *testing.T, a, b *side) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.qp.PostRecv(transport.RecvWR{ID: 70, SG: b.sge(0, 64)}); err != nil {
		t.Fatal(err)
	}
	copy(a.mem, "path")
	if _, err := a.qp.PostSend(transport.SendWR{ID: 71, Opcode: transport.OpSend, SG: a.sge(0, 4), Signaled: true}); err != nil {
		t.Fatal(err)
	}
	if wc := a.next(ctx); wc.Err() != nil || wc.ID != 71 {
		t.Fatalf("send: %+v (%v)", wc, wc.Err())
	}
	if wc := b.next(ctx); wc.Err() != nil || wc.ID != 70 || string(b.mem[:4]) != "path" {
		t.Fatalf("receive: %+v (%v) %q", wc, wc.Err(), b.mem[:4])
	}
}

// A connected QP reports its path: port, source GID with its RoCE
// version, path MTU, traffic class; on rxe over a 1500-byte device, port
// 1, a RoCE v2 GID and a 1024-byte MTU.
func TestVerbsPath(t *testing.T) {
	t.Setenv(TrafficClassEnv, "104")
	d := openOrSkip(t)
	cli, srv := pair(t, d, []byte("path"), nil)
	eachPath(t, cli, srv, func(who string, qp transport.QP, p transport.Path) {
		t.Logf("%s: %+v", who, p)
		if p.Port != 1 || p.GIDType != "RoCE v2" || p.MTU < 1024 || (who == "dialer" && p.TrafficClass != 104) {
			t.Errorf("%s: path %+v, want port 1, a RoCE v2 GID, MTU ≥ 1024, traffic class 104", who, p)
		}
	})
}

// The environment's service level and source GID index reach the address
// vector of both ends, and the connection carries traffic with them; the
// RoCE version preference picks the v2 entry of rdma_cm's address. Each
// step opens its device anew: the environment is read at Open.
func TestVerbsPathFromEnv(t *testing.T) {
	var base transport.Path
	t.Run("default", func(t *testing.T) {
		d := openOrSkip(t)
		cli, srv := pair(t, d, []byte("path"), nil)
		var err error
		if base, err = cli.qp.(transport.PathQP).Path(); err != nil {
			t.Fatal(err)
		}
		sendOne(t, cli, srv)
	})
	if t.Failed() || base.Port == 0 {
		return // skipped or failed: nothing to override
	}
	t.Run("SL and GID index", func(t *testing.T) {
		t.Setenv(ServiceLevelEnv, "5")
		t.Setenv(GIDIndexEnv, strconv.Itoa(base.GIDIndex))
		d := openOrSkip(t)
		cli, srv := pair(t, d, []byte("path"), nil)
		eachPath(t, cli, srv, func(who string, q transport.QP, p transport.Path) {
			t.Logf("%s with SL 5, GID index %d: %+v", who, base.GIDIndex, p)
			if p.GIDIndex != base.GIDIndex {
				t.Errorf("%s: path %+v, want GID index %d", who, p, base.GIDIndex)
			}
			// What modify_qp was given at RTR. A RoCE device maps the SL
			// to a priority on the wire and may not report it back: rxe
			// keeps none (its address vector has no SL field).
			if sl := q.(*qp).cfgC.sl; sl != 5 {
				t.Errorf("%s: RTR service level %d, want 5", who, sl)
			}
			if p.ServiceLevel != 5 {
				t.Logf("%s: the device reports service level %d (rxe does not keep one)", who, p.ServiceLevel)
			}
		})
		sendOne(t, cli, srv)
	})
	t.Run("RoCE v2 preferred", func(t *testing.T) {
		t.Setenv(RoCEVersionEnv, "2")
		d := openOrSkip(t)
		cli, srv := pair(t, d, []byte("path"), nil)
		p, err := cli.qp.(transport.PathQP).Path()
		if err != nil {
			t.Fatal(err)
		}
		if p.GIDType != "RoCE v2" {
			t.Errorf("RoCE version 2 preferred: path %+v", p)
		}
		sendOne(t, cli, srv)
	})
}

// On a real device (the Soft-RoCE guest): sysfs shows it with an ACTIVE
// Ethernet port, the network device behind it with its MTU, and a RoCE v2
// GID for the address the tests use, as rdmatrace doctor prints them.
func TestSysfsShowsDevice(t *testing.T) {
	d := openOrSkip(t)
	ip, err := netip.ParseAddr(hostIP(t, d))
	if err != nil {
		t.Fatal(err)
	}
	var dev *DeviceInfo
	devs := Sysfs("/sys")
	for i := range devs {
		if devs[i].Name == d.Name() {
			dev = &devs[i]
		}
	}
	if dev == nil {
		t.Fatalf("device %s not in sysfs's %+v", d.Name(), devs)
	}
	if len(dev.Ports) == 0 {
		t.Fatalf("%s: no ports", dev.Name)
	}
	p := dev.Ports[0]
	if !strings.Contains(p.State, "ACTIVE") || p.LinkLayer != "Ethernet" {
		t.Errorf("%s port %d: state %q link layer %q, want ACTIVE Ethernet (rxe)", dev.Name, p.Num, p.State, p.LinkLayer)
	}
	found := false
	for _, g := range p.GIDs {
		if g.Addr.Unmap() == ip && g.Type == "RoCE v2" {
			found = true
			if mtu := p.NetdevMTU[g.Netdev]; mtu < 1024 {
				t.Errorf("GID %d's network device %q: MTU %d", g.Index, g.Netdev, mtu)
			}
		}
	}
	if !found {
		t.Errorf("%s port %d: no RoCE v2 GID for %v among %+v", dev.Name, p.Num, ip, p.GIDs)
	}
}

// RDMAGRPC_VERBS_DEVICES: excluding every device leaves none to open,
// with an error that names the setting; allowing only a port the route
// does not take refuses the connection, saying why.
func TestVerbsDevicesEnv(t *testing.T) {
	names := Devices()
	if len(names) == 0 {
		t.Skip("no RDMA device (run inside the tests/rxe guest)")
	}
	t.Run("all excluded", func(t *testing.T) {
		t.Setenv(DevicesEnv, "^"+strings.Join(names, ","))
		p, err := transport.Get(Name)
		if err != nil {
			t.Fatal(err)
		}
		d, err := p.Open("")
		if err == nil {
			d.Close()
			t.Fatalf("Open with every device excluded succeeded")
		}
		if !strings.Contains(err.Error(), DevicesEnv) || !errors.Is(err, transport.ErrUnusable) {
			t.Fatalf("Open with every device excluded: %v", err)
		}
		t.Log(err)
	})
	t.Run("port not allowed", func(t *testing.T) {
		t.Setenv(DevicesEnv, names[0]+":2") // rxe has port 1 only
		d := openOrSkip(t)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cli, srv := newSide(t, d, transport.AccessLocalWrite), newSide(t, d, transport.AccessLocalWrite)
		l, err := d.Listen(net.JoinHostPort(hostIP(t, d), "0"))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		accepted := make(chan error, 1)
		go func() {
			req, err := l.Accept(ctx)
			if err != nil {
				accepted <- err
				return
			}
			qp, err := req.Accept(ctx, srv.cfg(), nil)
			if err == nil {
				qp.Close()
			}
			accepted <- err
		}()
		qp, err := d.Connect(ctx, l.Addr().String(), cli.cfg(), nil)
		if err == nil {
			qp.Close()
			t.Fatal("Connect through a port the setting does not allow succeeded")
		}
		t.Logf("dialer: %v", err)
		aerr := <-accepted
		t.Logf("acceptor: %v", aerr)
		if aerr == nil || !strings.Contains(aerr.Error(), "does not allow") || !strings.Contains(aerr.Error(), DevicesEnv) {
			t.Errorf("acceptor's error %v, want one naming %s", aerr, DevicesEnv)
		}
	})
}

// memlockChildEnv runs TestVerbsMemlockHelper as the registering process.
const memlockChildEnv = "RDMAGRPC_VERBS_MEMLOCK_CHILD"

// A process without CAP_IPC_LOCK whose memlock limit is below what it
// registers gets the explanatory error, not a crash or a silent success:
// run as uid 65534 with a 64 KiB limit, a 1 MiB registration fails and
// says why. Root is not bound by the limit, so the helper runs as
// nobody; in the tests/rxe guest only, where the device nodes may be
// opened to it.
func TestVerbsMemlockAsUser(t *testing.T) {
	openOrSkip(t)
	if os.Getenv("RXE_ADDR") == "" || os.Geteuid() != 0 {
		t.Skip("runs in the tests/rxe guest, as root (it opens the RDMA device nodes to another user)")
	}
	nodes, _ := filepath.Glob("/dev/infiniband/*")
	for _, n := range nodes {
		if err := os.Chmod(n, 0o666); err != nil {
			t.Fatal(err)
		}
	}
	dir, err := os.MkdirTemp("", "memlock")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "verbs.test")
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	const nobody = 65534
	cmd := exec.Command(bin, "-test.run=^TestVerbsMemlockHelper$", "-test.v")
	cmd.Env = append(os.Environ(), memlockChildEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, err := cmd.CombinedOutput()
	t.Logf("helper as uid %d: %v\n%s", nobody, err, out)
	if err != nil {
		t.Fatalf("helper failed")
	}
	if !strings.Contains(string(out), "the memlock limit (ulimit -l) is 64 KiB") {
		t.Fatalf("the refused registration does not explain the memlock limit")
	}
}

func TestVerbsMemlockHelper(t *testing.T) {
	if os.Getenv(memlockChildEnv) == "" {
		t.Skip("the registering process of TestVerbsMemlockAsUser")
	}
	if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: 64 << 10, Max: 64 << 10}); err != nil {
		t.Fatal(err)
	}
	d := openOrSkip(t)
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	mem, err := d.AllocMemory(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer d.FreeMemory(mem)
	mr, err := pd.RegMR(mem, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err == nil {
		mr.Dereg()
		t.Fatal("registered 1 MiB under a 64 KiB memlock limit without CAP_IPC_LOCK")
	}
	t.Logf("refused: %v", err)
}
