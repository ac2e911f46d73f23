package indep

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
	"golang.org/x/sys/unix"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The encoders against the document's own vectors (section 6).
func TestVectors(t *testing.T) {
	if got, want := ClientStart("shm"), unhex(t, "505249202a20485454502f322e300d0a0d0a534d0d0a0d0a 00000c0400 00000000 f0d352444701 f0d4e12ded49"); !bytes.Equal(got, want) {
		t.Errorf("client-start-shm: %x, want %x", got, want)
	}
	if got := ProviderCode("verbs"); got != 0xbc961429 {
		t.Errorf("FNV-1a(verbs) = %#x", got)
	}
	r, _ := Reply('R', "127.0.0.1:50051")
	if want := unhex(t, "52444d47 01 52 000f 3132372e302e302e313a3530303531"); !bytes.Equal(r, want) {
		t.Errorf("reply-rdma: %x, want %x", r, want)
	}
	h := Hello{RingAddr: 0x00007f5a3c200000, RingRkey: 0x1a01, SlotSize: 1024, SlotCount: 4, Flags: 1}
	if got, want := h.Encode(), unhex(t, "52444d47 03 00007f5a3c200000 00001a01 00000400 00000004 01"); !bytes.Equal(got, want) {
		t.Errorf("hello-shm: %x, want %x", got, want)
	}
	connect := unhex(t, `01 03 07000000 03000000 2b000000 01000000 72000000
		0010000000000000 4020000000000000 0500000000000000 efcdab8967452301
		00000000000000000000ffff7f000001 0180
		1a 52444d470300007f5a3c20000000001a01000004000000000401 00 00`)
	q, err := DecodeQPInfo(connect)
	if err != nil {
		t.Fatalf("shm-connect: %v", err)
	}
	if q.Num != 7 || q.PD != 3 || q.RecvCap != 43 || q.CQCap != 114 || q.RingOff != 0x1000 || q.CQOff != 0x2040 ||
		q.CQID != 5 || q.Token != 0x0123456789abcdef || q.Addr().String() != "127.0.0.1:32769" || len(q.Private) != 26 {
		t.Errorf("shm-connect decoded as %+v (addr %v)", q, q.Addr())
	}
	if got := q.Encode(); !bytes.Equal(got, connect) {
		t.Errorf("shm-connect re-encoded: %x, want %x", got, connect)
	}
	named := unhex(t, `02 03 09000000 04000000 2b000000 01000000 72000000
		0030000000000000 4000000000000000 0200000000000000 1032547698badcfe
		00000000000000000000ffff7f000001 83c3
		1a 52444d470300007f5a3c20000000001a01000004000000000401
		03 00 0a00010000000000 0b00010000000000 0c00010000000000`)
	q, err = DecodeQPInfo(named)
	if err != nil || q.Flags != 3 || q.Ctl != [3]uint64{0x1000a, 0x1000b, 0x1000c} || q.Addr().Port() != 50051 {
		t.Errorf("shm-accept-named: %+v, %v", q, err)
	}
	imm := Imm{Kind: 0, Credits: 2, Length: 512}.Encode()
	if imm != 0x00200200 {
		t.Errorf("imm-data-small: %#x", imm)
	}
	if d := DecodeImm(0xf0200031); d != (Imm{Kind: 7, Ring: 1, Credits: 2, Length: 49}) {
		t.Errorf("imm-record-large: %+v", d)
	}
	names, _ := ShmNames("127.0.0.1:50051")
	if names[0] != "rdmagrpc-shm/127.0.0.1:50051" || names[1] != "rdmagrpc-shm/*:50051" {
		t.Errorf("names: %q", names)
	}
	names, _ = ShmNames("[::ffff:127.0.0.1]:7")
	if names[0] != "rdmagrpc-shm/127.0.0.1:7" {
		t.Errorf("mapped names: %q", names)
	}
}

func listenShm(t *testing.T) (net.Listener, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ln, err := conn.Listen(ctx, "127.0.0.1:0", conn.WithProvider("shm"))
	if err != nil {
		t.Fatalf("conn.Listen: %v", err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln, ln.Addr().String()
}

type accepted struct {
	c   net.Conn
	err error
}

func acceptAsync(ln net.Listener) <-chan accepted {
	ch := make(chan accepted, 1)
	go func() {
		c, err := ln.Accept()
		ch <- accepted{c, err}
	}()
	return ch
}

// Our negotiation client against conn.Listen: an offer, parsed per 2.4.
func TestNegotiationClientGetsOffer(t *testing.T) {
	ln, addr := listenShm(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := Negotiate(ctx, addr, "shm")
	if err != nil {
		t.Fatalf("step negotiate against conn.Listen at %s: %v", addr, err)
	}
	defer n.Conn.Close()
	if n.Outcome != Offer {
		t.Fatalf("step reply: outcome %v payload %q, want an offer", n.Outcome, n.Payload)
	}
	host, port, err := net.SplitHostPort(n.Payload)
	if err != nil || host != "127.0.0.1" {
		t.Fatalf("step offer address: %q (host %q, %v), want the local IP 127.0.0.1 we reached", n.Payload, host, err)
	}
	if _, err := strconv.Atoi(port); err != nil {
		t.Fatalf("offer port %q: %v", port, err)
	}
	_, lnPort, _ := net.SplitHostPort(addr)
	t.Logf("offer %q (TCP side port %s)", n.Payload, lnPort)

	// A failed upgrade: send 'T'; the listener hands the connection to its
	// application (Accept returns a TCP connection).
	acc := acceptAsync(ln)
	if err := n.SendStayTCP(); err != nil {
		t.Fatalf("send T: %v", err)
	}
	select {
	case a := <-acc:
		if a.err != nil {
			t.Fatalf("Accept after T: %v", a.err)
		}
		defer a.c.Close()
		cc, ok := a.c.(*conn.Conn)
		if !ok {
			t.Fatalf("Accept returned %T", a.c)
		}
		if p := cc.Stats().Provider; p != "tcp" {
			t.Fatalf("after T, provider %q, want tcp", p)
		}
		// Section 2.5: the server's application receives the client start
		// as the start of the stream, then what follows the T byte.
		if _, err := n.Conn.Write([]byte("after-T")); err != nil {
			t.Fatal(err)
		}
		a.c.SetReadDeadline(time.Now().Add(5 * time.Second))
		want := append(ClientStart("shm"), "after-T"...)
		got := make([]byte, len(want))
		if _, err := io.ReadFull(a.c, got); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("stream after T: %q, %v; want %q", got, err, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Accept did not return after T")
	}
}

// Provider codes differ: the listener replies 'T' (2.6 step 4).
func TestNegotiationClientOtherProvider(t *testing.T) {
	_, addr := listenShm(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := Negotiate(ctx, addr, "verbs")
	if err != nil {
		t.Fatalf("negotiate: %v", err)
	}
	defer n.Conn.Close()
	if n.Outcome != StayTCP {
		t.Fatalf("outcome %v payload %q, want stay-tcp", n.Outcome, n.Payload)
	}
	t.Logf("reason: %q", n.Payload)
}

// Plain servers (2.5 case 2 and 3).
func TestNegotiationClientPlainServer(t *testing.T) {
	serve := func(t *testing.T, greeting []byte, closeAfter bool) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			c.Write(greeting)
			if closeAfter {
				return
			}
			io.Copy(io.Discard, c)
		}()
		return ln.Addr().String()
	}
	ctx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), 2*time.Second)
	}

	t.Run("http2-settings", func(t *testing.T) {
		settings := []byte{0, 0, 0, 4, 0, 0, 0, 0, 0}
		c, cancel := ctx()
		defer cancel()
		n, err := Negotiate(c, serve(t, settings, false), "shm")
		if err != nil {
			t.Fatalf("negotiate: %v", err)
		}
		defer n.Conn.Close()
		if n.Outcome != PlainServer || !bytes.Equal(n.Leftover, settings[:4]) {
			t.Fatalf("outcome %v leftover %x, want plain-server with %x", n.Outcome, n.Leftover, settings[:4])
		}
		rest := make([]byte, 5)
		if _, err := io.ReadFull(n.Conn, rest); err != nil || !bytes.Equal(rest, settings[4:]) {
			t.Fatalf("rest of the server stream: %x %v", rest, err)
		}
	})
	t.Run("other-protocol", func(t *testing.T) {
		c, cancel := ctx()
		defer cancel()
		n, err := Negotiate(c, serve(t, []byte("SSH-2.0-x\r\n"), false), "shm")
		if err != nil {
			t.Fatalf("negotiate: %v", err)
		}
		defer n.Conn.Close()
		if n.Outcome != PlainServer || string(n.Leftover) != "SSH-" {
			t.Fatalf("outcome %v leftover %q", n.Outcome, n.Leftover)
		}
	})
	// A server that accepts and says nothing: the document gives no
	// time-out but the dial's context, and the dial then fails (2.5, 2.6
	// timing table); it does not stay on TCP.
	t.Run("silent", func(t *testing.T) {
		c, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		n, err := Negotiate(c, serve(t, nil, false), "shm")
		if err == nil {
			n.Conn.Close()
			t.Fatalf("silent server: outcome %v, want the dial to fail at the context's end", n.Outcome)
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("silent server: %v, want a context deadline error", err)
		}
	})
	t.Run("closes-silently", func(t *testing.T) {
		c, cancel := ctx()
		defer cancel()
		n, err := Negotiate(c, serve(t, nil, true), "shm")
		if err == nil {
			n.Conn.Close()
			t.Fatalf("closing server: outcome %v, want failure (2.5 case 3)", n.Outcome)
		}
	})
	t.Run("closes-inside-RDMG", func(t *testing.T) {
		c, cancel := ctx()
		defer cancel()
		n, err := Negotiate(c, serve(t, []byte("RD"), true), "shm")
		if err == nil {
			n.Conn.Close()
			t.Fatalf("\"RD\" then close: outcome %v, want failure (2.5 case 3)", n.Outcome)
		}
	})
	t.Run("bad-version", func(t *testing.T) {
		c, cancel := ctx()
		defer cancel()
		n, err := Negotiate(c, serve(t, []byte("RDMG\x02R\x00\x00"), false), "shm")
		if err == nil {
			n.Conn.Close()
			t.Fatalf("version 2: outcome %v, want failure (2.5, W1)", n.Outcome)
		}
	})
}

// Our shm set-up against conn.Listen: Accept returns an shm connection.
func TestShmSetupAgainstListener(t *testing.T) {
	ln, addr := listenShm(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := Negotiate(ctx, addr, "shm")
	if err != nil || n.Outcome != Offer {
		t.Fatalf("step negotiate: %v %+v", err, n)
	}
	acc := acceptAsync(ln)
	sc, err := DialShm(ctx, n.Payload, ShmConfig{})
	if err != nil {
		n.SendStayTCP()
		n.Conn.Close()
		t.Fatalf("step shm dial of offered %q: %v", n.Payload, err)
	}
	defer sc.Close()
	CloseReset(n.Conn)
	t.Logf("connected to %q; listener QP info %+v; hello %+v; accept flags %#x, sent ready %v",
		sc.SocketName(), sc.Peer, sc.PeerHello, sc.AcceptFlag, sc.SentReady)
	select {
	case a := <-acc:
		if a.err != nil {
			t.Fatalf("step Accept: %v", a.err)
		}
		defer a.c.Close()
		cc, ok := a.c.(*conn.Conn)
		if !ok {
			t.Fatalf("step Accept: %T", a.c)
		}
		if p := cc.Stats().Provider; p != "shm" {
			t.Fatalf("step Accept: provider %q, want shm", p)
		}
		t.Logf("accepted: local %v remote %v", a.c.LocalAddr(), a.c.RemoteAddr())
	case <-time.After(5 * time.Second):
		mr, w, e, closed := sc.Counters()
		t.Fatalf("step Accept: nothing within 5 s (memreqs %d wakes %d errnotes %d peer closed %v)", mr, w, e, closed)
	}
}

// One message each way over the data path (section 4) with conn.Listen's
// accepted connection, then close (4.8) seen as end of file.
func TestShmDataPath(t *testing.T) {
	ln, addr := listenShm(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	acc := acceptAsync(ln)
	sc, err := DialShm(ctx, addr, ShmConfig{})
	if err != nil {
		t.Fatalf("step shm dial %s: %v", addr, err)
	}
	defer sc.Close()
	var peer net.Conn
	select {
	case a := <-acc:
		if a.err != nil {
			t.Fatalf("step Accept: %v", a.err)
		}
		peer = a.c
		defer peer.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("step Accept: nothing within 5 s")
	}
	if err := sc.Send(ctx, []byte("ping")); err != nil {
		mr, w, e, closed := sc.Counters()
		t.Fatalf("step send ping: %v (memreqs %d wakes %d errnotes %d peer closed %v)", err, mr, w, e, closed)
	}
	peer.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 16)
	n, err := peer.Read(buf)
	if err != nil || string(buf[:n]) != "ping" {
		t.Fatalf("step listener reads ping: %q, %v", buf[:n], err)
	}
	if _, err := peer.Write([]byte("pong!")); err != nil {
		t.Fatalf("step listener writes pong: %v", err)
	}
	var got []byte
	for got == nil {
		r, err := sc.Recv(ctx)
		if err != nil {
			t.Fatalf("step receive pong: %+v, %v", r, err)
		}
		t.Logf("received imm %+v status %d opcode %d byte_len %d payload %q", r.Imm, r.Status, r.Opcode, r.ByteLen, r.Payload)
		if r.Opcode != 4 {
			t.Fatalf("step receive pong: opcode %d, want 4 (RECV_RDMA_WITH_IMM)", r.Opcode)
		}
		switch r.Imm.Kind {
		case kindSmall:
			if r.ByteLen != r.Imm.Length {
				t.Errorf("byte_len %d, immediate length %d", r.ByteLen, r.Imm.Length)
			}
			got = r.Payload
		case kindCredit:
		default:
			t.Fatalf("step receive pong: unexpected kind %d", r.Imm.Kind)
		}
	}
	if string(got) != "pong!" {
		t.Fatalf("step receive pong: %q", got)
	}
	// Close (kind 6) carrying the credit we owe: the listener's reader
	// sees end of file.
	if err := sc.SendZero(ctx, kindClose, 0); err != nil {
		t.Fatalf("step send close: %v", err)
	}
	n, err = peer.Read(buf)
	if n != 0 || err != io.EOF {
		t.Fatalf("step listener read after close: %q, %v; want EOF", buf[:n], err)
	}
}

type sniffed struct {
	res *SniffResult
	err error
}

// sniffServer runs our negotiation listener (section 2.6) on a fresh TCP
// port: every accepted connection goes through Sniff.
func sniffServer(t *testing.T, ownProvider string, rdmaPort func(tcpPort int) int) (string, <-chan sniffed) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	port := ln.Addr().(*net.TCPAddr).Port
	ch := make(chan sniffed, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				r, err := Sniff(c, ProviderCode(ownProvider), rdmaPort(port))
				if r != nil && r.Conn != nil {
					t.Cleanup(func() { r.Conn.Close() })
				}
				ch <- sniffed{r, err}
			}()
		}
	}()
	return ln.Addr().String(), ch
}

func nextSniff(t *testing.T, ch <-chan sniffed, step string) *SniffResult {
	t.Helper()
	select {
	case s := <-ch:
		if s.err != nil {
			t.Fatalf("step %s: Sniff: %v", step, s.err)
		}
		return s.res
	case <-time.After(12 * time.Second):
		t.Fatalf("step %s: no connection sniffed within 12 s", step)
	}
	return nil
}

func dialRdmagrpc(t *testing.T, addr string) net.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := conn.Dial(ctx, addr, conn.WithProvider("shm"))
	if err != nil {
		t.Fatalf("conn.Dial %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func readN(t *testing.T, c net.Conn, n int, step string) []byte {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, n)
	k, err := io.ReadFull(c, b)
	if err != nil {
		t.Fatalf("step %s: read %d of %d bytes %q: %v", step, k, n, b[:k], err)
	}
	return b
}

// readStartThen reads a client start replayed ahead of the stream (the
// preface and a SETTINGS frame of any length, whose first two parameters
// say rdmagrpc and provider), then the stream's tail.
func readStartThen(t *testing.T, c net.Conn, provider, tail, step string) {
	t.Helper()
	h := readN(t, c, len(http2Preface)+9, step)
	if string(h[:len(http2Preface)]) != http2Preface || h[len(http2Preface)+3] != 4 {
		t.Fatalf("%s: %q is not the preface and a SETTINGS frame", step, h)
	}
	n := int(h[len(http2Preface)])<<16 | int(h[len(http2Preface)+1])<<8 | int(h[len(http2Preface)+2])
	params := readN(t, c, n, step)
	want := ClientStart(provider)[len(http2Preface)+9:]
	if n < len(want) || !bytes.Equal(params[:len(want)], want) {
		t.Fatalf("%s: SETTINGS parameters %x, want them to begin %x", step, params, want)
	}
	if got := readN(t, c, len(tail), step); string(got) != tail {
		t.Fatalf("%s: %q after the client start, want %q", step, got, tail)
	}
}

// conn.Dial against our listener: the offer names a port where no shm
// listener is, the upgrade fails, the client sends 'T' and stays on TCP.
func TestNegotiationListenerOfferFallsBack(t *testing.T) {
	var dead int
	{
		l, _ := net.Listen("tcp", "127.0.0.1:0")
		dead = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	addr, ch := sniffServer(t, "shm", func(int) int { return dead })
	c := dialRdmagrpc(t, addr)
	app := []byte(http2Preface + "after-preface")
	if _, err := c.Write(app); err != nil {
		t.Fatalf("write: %v", err)
	}
	r := nextSniff(t, ch, "offer")
	if r.ClientCode != ProviderCode("shm") {
		t.Errorf("client provider code %#x", r.ClientCode)
	}
	if r.Kind != ClientStayed {
		t.Fatalf("step after offer: %v (byte %q, err %v), want client-stayed ('T')", r.Kind, r.AfterOffer, r.AfterOfferErr)
	}
	readStartThen(t, r.Conn, "shm", "after-preface", "stream after T")
	if st := c.(*conn.Conn).Stats(); st.Provider != "tcp" {
		t.Errorf("client provider %q, want tcp", st.Provider)
	}
}

// conn.Dial against our listener offering conn.Listen's shm listener: the
// client upgrades, closes the TCP connection, and its stream arrives over
// shm.
func TestNegotiationListenerOfferUpgrades(t *testing.T) {
	shmLn, shmAddr := listenShm(t)
	_, p, _ := net.SplitHostPort(shmAddr)
	shmPort, _ := strconv.Atoi(p)
	addr, ch := sniffServer(t, "shm", func(int) int { return shmPort })
	acc := acceptAsync(shmLn)
	c := dialRdmagrpc(t, addr)
	if _, err := c.Write([]byte(http2Preface + "over-shm")); err != nil {
		t.Fatalf("write: %v", err)
	}
	r := nextSniff(t, ch, "offer")
	if r.Kind != Upgraded {
		t.Fatalf("step after offer: %v (byte %q, err %v), want upgraded", r.Kind, r.AfterOffer, r.AfterOfferErr)
	}
	t.Logf("after the offer the listener read %q, %v", r.AfterOffer, r.AfterOfferErr)
	var a accepted
	select {
	case a = <-acc:
	case <-time.After(10 * time.Second):
		t.Fatal("step shm accept: nothing within 10 s")
	}
	if a.err != nil {
		t.Fatalf("step shm accept: %v", a.err)
	}
	defer a.c.Close()
	if st := a.c.(*conn.Conn).Stats(); st.Provider != "shm" {
		t.Fatalf("accepted provider %q", st.Provider)
	}
	want := http2Preface + "over-shm"
	if got := readN(t, a.c, len(want), "stream over shm"); string(got) != want {
		t.Fatalf("stream over shm: %q, want %q", got, want)
	}
	if st := c.(*conn.Conn).Stats(); st.Provider != "shm" {
		t.Errorf("client provider %q, want shm", st.Provider)
	}
}

// Provider codes differ: our listener replies 'T'; conn.Dial stays on TCP
// and its stream follows the replayed client start.
func TestNegotiationListenerOtherProvider(t *testing.T) {
	addr, ch := sniffServer(t, "verbs", func(p int) int { return p })
	c := dialRdmagrpc(t, addr)
	if _, err := c.Write([]byte(http2Preface + "tcp-stream")); err != nil {
		t.Fatalf("write: %v", err)
	}
	r := nextSniff(t, ch, "reply T")
	if r.Kind != RepliedTCP {
		t.Fatalf("sniffed %v, want replied-tcp", r.Kind)
	}
	readStartThen(t, r.Conn, "shm", "tcp-stream", "stream after reply T")
}

// Section 2.7: the application's first bytes are not HTTP/2; conn.Dial
// probes on a second connection, our listener offers conn.Listen's shm
// listener, and the bytes go over shm.
func TestNegotiationListenerProbe(t *testing.T) {
	shmLn, shmAddr := listenShm(t)
	_, p, _ := net.SplitHostPort(shmAddr)
	shmPort, _ := strconv.Atoi(p)
	addr, ch := sniffServer(t, "shm", func(int) int { return shmPort })
	acc := acceptAsync(shmLn)
	c := dialRdmagrpc(t, addr)
	if _, err := c.Write([]byte("\x16\x03\x01not-h2")); err != nil {
		t.Fatalf("write: %v", err)
	}
	var a accepted
	select {
	case a = <-acc:
	case <-time.After(10 * time.Second):
		t.Fatal("step shm accept after the probe: nothing within 10 s")
	}
	if a.err != nil {
		t.Fatalf("step shm accept: %v", a.err)
	}
	defer a.c.Close()
	if got := readN(t, a.c, 9, "stream over shm"); string(got) != "\x16\x03\x01not-h2" {
		t.Fatalf("stream over shm: %q", got)
	}
	// Two TCP connections reached our listener: the probe (offer, then
	// reset) and the original one (nothing sent, then reset).
	kinds := map[Sniffed]int{}
	for i := 0; i < 2; i++ {
		r := nextSniff(t, ch, "probe/original")
		kinds[r.Kind]++
		if r.Kind == PlainClient && len(r.Replayed) != 0 {
			t.Errorf("original connection carried %q, want nothing", r.Replayed)
		}
	}
	if kinds[Upgraded] != 1 || kinds[PlainClient] != 1 {
		t.Fatalf("sniffed %v, want one upgraded probe and one empty original", kinds)
	}
}

// The listener's checks of a connect (sections 3.1, 3.3.4, 3.3.5, 5),
// driven by changing our otherwise valid connect message.
func TestShmListenerChecks(t *testing.T) {
	ln, addr := listenShm(t)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	const pOff = 73 // private data
	memfd := func(t *testing.T, size int64, seal bool) int {
		fd, err := unix.MemfdCreate("indep-test", unix.MFD_ALLOW_SEALING|unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		if err := unix.Ftruncate(fd, size); err != nil {
			t.Fatal(err)
		}
		if seal {
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
				t.Fatal(err)
			}
		}
		return fd
	}
	type mut = func(msg []byte, fds []int) ([]byte, []int)
	cases := []struct {
		name string
		// "accept", "reject:<hex>", "closed"; "refused": anything but
		// accept, the document not saying how; "": not specified at all.
		want string
		mut  func(t *testing.T) mut
	}{
		{"valid", "accept", func(*testing.T) mut { return nil }},
		{"hello-version-2", "reject:", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[pOff+4] = 2; return m, f }
		}},
		{"hello-bad-magic", "reject:", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[pOff] = 'X'; return m, f }
		}},
		{"hello-slot-count-1", "reject:", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[pOff+24] = 1; return m, f }
		}},
		{"hello-slot-size-63", "reject:", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[pOff+19], m[pOff+20] = 0, 63; return m, f }
		}},
		{"hello-25-bytes", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) {
				out := append([]byte(nil), m[:72]...)
				out = append(out, 25)
				out = append(out, m[pOff:pOff+25]...)
				return append(out, 0, 0), f
			}
		}},
		{"hello-padded-to-56", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) {
				out := append([]byte(nil), m[:72]...)
				out = append(out, 56)
				out = append(out, m[pOff:pOff+26]...)
				out = append(out, make([]byte, 30)...)
				return append(out, 0, 0), f
			}
		}},
		{"hello-unknown-flag-bits", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[pOff+25] = 0xfe; return m, f }
		}},
		{"qp-version-2", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[1] = 2; return m, f }
		}},
		{"no-descriptors", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return m, nil }
		}},
		{"two-descriptors", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return m, f[:2] }
		}},
		{"recv-cap-16385", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[10], m[11] = 0x01, 0x40; return m, f }
		}},
		{"recv-cap-0", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[10], m[11] = 0, 0; return m, f }
		}},
		{"recv-cap-5-below-slot-count-plus-7", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[10], m[11] = 5, 0; return m, f }
		}},
		{"recv-sge-0", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[14] = 0; return m, f }
		}},
		{"same-file-for-ring-and-cq", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return m, []int{f[0], f[1], f[1]} }
		}},
		{"recv-sge-33", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[14] = 33; return m, f }
		}},
		{"cq-cap-0", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[18], m[19] = 0, 0; return m, f }
		}},
		{"private-len-57", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) {
				out := append([]byte(nil), m[:72]...)
				out = append(out, 57)
				out = append(out, m[pOff:pOff+26]...)
				out = append(out, make([]byte, 31)...)
				return append(out, 0, 0), f
			}
		}},
		{"truncated-private", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return m[:pOff+20], f }
		}},
		{"held-count-9", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) {
				m = m[:pOff+26]
				m = append(m, 0, 9)
				return append(m, make([]byte, 72)...), f
			}
		}},
		{"held-count-1-missing", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[pOff+27] = 1; return m, f }
		}},
		{"no-flags-no-held", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return m[:pOff+26], f }
		}},
		{"flags-without-held-count", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return m[:pOff+27], f }
		}},
		{"trailing-bytes", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return append(m, 1, 2, 3, 4, 5, 6, 7, 8), f }
		}},
		{"unknown-qp-flag-bits", "accept", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[pOff+26] = 0xfc; return m, f }
		}},
		{"first-message-ready", "closed", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { return []byte{msgReady}, nil }
		}},
		// Checked when the files are mapped: 3.3.5 says the listener
		// answers with the "listener failed" reject (W4 in section 7).
		{"ring-off-not-multiple-of-8", "fail", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[22] = 4; return m, f }
		}},
		{"ring-window-outside-file", "fail", func(*testing.T) mut {
			return func(m []byte, f []int) ([]byte, []int) { m[22], m[23], m[24] = 0, 0, 0x10; return m, f }
		}},
		{"mr-table-too-small", "fail", func(t *testing.T) mut {
			small := memfd(t, 4096, true)
			return func(m []byte, f []int) ([]byte, []int) { return m, []int{small, f[1], f[2]} }
		}},
		{"mr-table-unsealed", "fail", func(t *testing.T) mut {
			un := memfd(t, mrTableSize, false)
			return func(m []byte, f []int) ([]byte, []int) { return m, []int{un, f[1], f[2]} }
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 12*time.Second)
			defer cancel()
			sc, err := DialShm(ctx, addr, ShmConfig{Mutate: tc.mut(t)})
			var got string
			var rej *RejectError
			switch {
			case err == nil:
				got = "accept"
				sc.Close()
			case errors.As(err, &rej):
				got = "reject:" + hex.EncodeToString(rej.Private)
			case errors.Is(err, ErrClosedWithoutAnswer):
				got = "closed"
			default:
				got = "error: " + err.Error()
			}
			if tc.want == "fail" {
				if !strings.HasPrefix(got, "reject:"+hex.EncodeToString([]byte("RDMG\xfffail:"))) {
					t.Errorf("%s: %s, want a reject \"RDMG\\xfffail:\" + reason (3.3.5)", tc.name, got)
				}
				return
			}
			if got != tc.want {
				t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
			}
		})
	}
}

// shmPair dials conn.Listen's listener with our shm dialer and returns
// both ends.
func shmPair(t *testing.T) (context.Context, *ShmConn, net.Conn) {
	t.Helper()
	ln, addr := listenShm(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	acc := acceptAsync(ln)
	sc, err := DialShm(ctx, addr, ShmConfig{})
	if err != nil {
		t.Fatalf("step shm dial %s: %v", addr, err)
	}
	t.Cleanup(func() { sc.Close() })
	select {
	case a := <-acc:
		if a.err != nil {
			t.Fatalf("step Accept: %v", a.err)
		}
		t.Cleanup(func() { a.c.Close() })
		return ctx, sc, a.c
	case <-time.After(5 * time.Second):
		t.Fatal("step Accept: nothing within 5 s")
	}
	return nil, nil, nil
}

// recvUntil takes messages until one satisfies stop or the time runs out.
func recvUntil(t *testing.T, ctx context.Context, sc *ShmConn, step string, d time.Duration, stop func(*Received) bool) []*Received {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var all []*Received
	for {
		r, err := sc.Recv(ctx)
		if err != nil {
			t.Fatalf("step %s: receive: %v (received so far %s)", step, err, describe(all))
		}
		all = append(all, r)
		if stop(r) {
			return all
		}
	}
}

func describe(rs []*Received) string {
	var b strings.Builder
	for _, r := range rs {
		b.WriteString("[")
		b.WriteString(strconv.Itoa(int(r.Imm.Kind)) + " ring " + strconv.Itoa(int(r.Imm.Ring)) + " credits " + strconv.Itoa(int(r.Imm.Credits)) + " len " + strconv.Itoa(int(r.Imm.Length)))
		b.WriteString("]")
	}
	return b.String()
}

func readExactly(t *testing.T, c net.Conn, want []byte, step string) {
	t.Helper()
	if got := readN(t, c, len(want), step); !bytes.Equal(got, want) {
		t.Fatalf("step %s: read %q, want %q", step, got, want)
	}
}

// Enlargement (4.3, 4.6): request record, ack into our small ring, a data
// message into the large ring, shrink record, back to the small ring.
func TestShmEnlargement(t *testing.T) {
	ctx, sc, peer := shmPair(t)
	if err := sc.SendRecord(ctx, Record{Type: recRequest, Seq: 1, Size: 32768, Count: 16}, false); err != nil {
		t.Fatalf("step send request: %v", err)
	}
	var ack Record
	rs := recvUntil(t, ctx, sc, "ack", 5*time.Second, func(r *Received) bool {
		if r.Imm.Kind != kindControl {
			return false
		}
		rec, err := DecodeRecord(r.Payload)
		if err != nil {
			t.Fatalf("step ack: %v", err)
		}
		ack = rec
		return true
	})
	t.Logf("after the request: %s; ack %+v; credits %v", describe(rs), ack, func() []int { s, l := sc.Credits(); return []int{s, l} }())
	if ack.Type != recAck || ack.Seq != 1 || ack.Size != 32768 || ack.Count != 16 || ack.Addr == 0 || ack.Rkey == 0 {
		t.Fatalf("step ack: %+v, want an ack of seq 1 for 32768 x 16", ack)
	}
	if ack.Addr2 != 1 {
		t.Fatalf("step ack: addr2 %d, want 1 (keeps the small ring; default)", ack.Addr2)
	}
	// Return the ack's credit at once (urgent, 4.4).
	if err := sc.SendZero(ctx, kindCredit, 0); err != nil {
		t.Fatalf("step return the ack's credit: %v", err)
	}
	sc.UseLargeRing(ack)
	big := bytes.Repeat([]byte("0123456789abcdef"), 125) // 2000 bytes > the small slot
	if err := sc.SendLarge(ctx, big); err != nil {
		t.Fatalf("step large data: %v", err)
	}
	readExactly(t, peer, big, "listener reads the large message")
	// Shrink: the last message into the large ring (kind 7).
	if err := sc.SendRecord(ctx, Record{Type: recShrink, Seq: 1}, true); err != nil {
		t.Fatalf("step shrink: %v", err)
	}
	if err := sc.Send(ctx, []byte("small again")); err != nil {
		t.Fatalf("step small data after shrink: %v", err)
	}
	readExactly(t, peer, []byte("small again"), "listener reads after the shrink")
	if _, err := peer.Write([]byte("still-alive")); err != nil {
		t.Fatalf("step listener writes: %v", err)
	}
	var got []byte
	recvUntil(t, ctx, sc, "reply", 5*time.Second, func(r *Received) bool {
		if r.Imm.Kind == kindSmall {
			got = r.Payload
			return true
		}
		return false
	})
	if string(got) != "still-alive" {
		t.Fatalf("step reply: %q", got)
	}
}

// Park (4.6): the listener's hello offers parking; after everything was
// read a park is answered with resume carrying the credits not yet
// returned; with a slot unread, decline.
func TestShmPark(t *testing.T) {
	ctx, sc, peer := shmPair(t)
	if sc.PeerHello.Flags&helloParks == 0 {
		t.Fatalf("listener hello flags %#x: no helloParks", sc.PeerHello.Flags)
	}
	// A slot still unread: decline.
	if err := sc.Send(ctx, []byte("unread")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if err := sc.SendZero(ctx, kindCredit, 1); err != nil {
		t.Fatalf("step park 1: %v", err)
	}
	rs := recvUntil(t, ctx, sc, "answer to park 1", 5*time.Second, func(r *Received) bool {
		return r.Imm.Kind == kindCredit && r.Imm.Length != 0
	})
	if last := rs[len(rs)-1]; last.Imm.Length != 3 {
		t.Fatalf("step answer to park 1 with a slot unread: %s, want decline (length 3)", describe(rs))
	}
	readExactly(t, peer, []byte("unread"), "listener reads")
	time.Sleep(50 * time.Millisecond)
	small, _ := sc.Credits()
	if err := sc.SendZero(ctx, kindCredit, 1); err != nil {
		t.Fatalf("step park 2: %v", err)
	}
	rs = recvUntil(t, ctx, sc, "answer to park 2", 5*time.Second, func(r *Received) bool {
		return r.Imm.Kind == kindCredit && r.Imm.Length != 0
	})
	if last := rs[len(rs)-1]; last.Imm.Length != 2 {
		t.Fatalf("step answer to park 2, all read: %s, want resume (length 2)", describe(rs))
	}
	after, _ := sc.Credits()
	t.Logf("park 2 answered %s; small credits %d -> %d", describe(rs), small, after)
	if after != int(sc.PeerHello.SlotCount) {
		t.Fatalf("after resume: %d small credits, want all %d back", after, sc.PeerHello.SlotCount)
	}
	if err := sc.Send(ctx, []byte("after-park")); err != nil {
		t.Fatal(err)
	}
	readExactly(t, peer, []byte("after-park"), "listener reads after the park")
}

// The reserve rule (4.4): a data message after which the writer holds no
// credit is a protocol error; the listener aborts.
func TestShmReserveRuleEnforced(t *testing.T) {
	ctx, sc, peer := shmPair(t)
	for i := 0; i < 3; i++ {
		if err := sc.Send(ctx, []byte{'a' + byte(i)}); err != nil {
			t.Fatalf("step data %d: %v", i, err)
		}
	}
	if small, _ := sc.Credits(); small != 1 {
		t.Fatalf("credits after 3 messages without reads: %d, want 1", small)
	}
	// The fourth message leaves no credit.
	if err := sc.SendRaw(ctx, kindSmall, []byte("d"), false); err != nil {
		t.Fatalf("step fourth message: %v", err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if _, _, _, closed := sc.Counters(); closed {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, _, errnotes, closed := sc.Counters()
	peer.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 16)
	var reads []string
	var rerr error
	for rerr == nil {
		var n int
		n, rerr = peer.Read(buf)
		if n > 0 {
			reads = append(reads, string(buf[:n]))
		}
	}
	t.Logf("after the fourth message: peer closed %v, errnotes %d, listener reads %q then %v", closed, errnotes, reads, rerr)
	if !closed {
		t.Fatalf("step abort: the listener did not disconnect within 3 s")
	}
	if errors.Is(rerr, os.ErrDeadlineExceeded) {
		t.Fatalf("step abort: the listener's reads did not fail")
	}
}

// A torn record (4.3) counts as not received; the connection goes on.
func TestShmTornRecord(t *testing.T) {
	ctx, sc, peer := shmPair(t)
	rec := Record{Type: recRequest, Seq: 1, Size: 32768, Count: 16}.Encode()
	rec[41] ^= 0xff // crc
	if err := sc.SendRaw(ctx, kindControl, rec, false); err != nil {
		t.Fatalf("step torn record: %v", err)
	}
	if err := sc.Send(ctx, []byte("after-torn")); err != nil {
		t.Fatalf("step data: %v", err)
	}
	readExactly(t, peer, []byte("after-torn"), "listener reads after a torn record")
	if _, err := peer.Write([]byte("ok")); err != nil {
		t.Fatal(err)
	}
	rs := recvUntil(t, ctx, sc, "reply", 5*time.Second, func(r *Received) bool { return r.Imm.Kind == kindSmall })
	for _, r := range rs {
		if r.Imm.Kind == kindControl {
			t.Errorf("the torn request was answered: %s", describe(rs))
		}
	}
	if got := string(rs[len(rs)-1].Payload); got != "ok" {
		t.Fatalf("reply %q", got)
	}
}

// TestMain lets the test binary act as a separate dialer process.
func TestMain(m *testing.M) {
	if addr := os.Getenv("INDEP_CHILD_DIAL"); addr != "" {
		os.Exit(childDial(addr))
	}
	os.Exit(m.Run())
}

func childDial(addr string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sc, err := DialShm(ctx, addr, ShmConfig{})
	if err != nil {
		var rej *RejectError
		if errors.As(err, &rej) {
			fmt.Printf("REJECT %x\n", rej.Private)
		} else {
			fmt.Println("DIAL-ERROR", err)
		}
		return 0
	}
	defer sc.Close()
	if err := sc.Send(ctx, []byte("from-child")); err != nil {
		fmt.Println("SEND-ERROR", err)
		return 0
	}
	for {
		r, err := sc.Recv(ctx)
		if err != nil {
			fmt.Println("RECV-ERROR", err)
			return 0
		}
		if r.Imm.Kind == kindSmall {
			fmt.Printf("REPLY %s\n", r.Payload)
			return 0
		}
	}
}

func runChild(t *testing.T, addr string, cred *syscall.Credential) string {
	t.Helper()
	bin := os.Args[0]
	if cred != nil {
		dir, err := os.MkdirTemp("", "indep")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		os.Chmod(dir, 0o755)
		data, err := os.ReadFile(bin)
		if err != nil {
			t.Fatal(err)
		}
		bin = filepath.Join(dir, "child")
		if err := os.WriteFile(bin, data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), "INDEP_CHILD_DIAL="+addr)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// Our dialer in another process: set-up, a message each way.
func TestShmOtherProcess(t *testing.T) {
	ln, addr := listenShm(t)
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		if p := c.(*conn.Conn).Stats().Provider; p != "shm" {
			done <- fmt.Errorf("provider %q", p)
			return
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 10)
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "from-child" {
			done <- fmt.Errorf("read %q: %v", buf, err)
			return
		}
		_, err = c.Write([]byte("to-child"))
		done <- err
		io.Copy(io.Discard, c)
	}()
	out := runChild(t, addr, nil)
	if out != "REPLY to-child" {
		t.Fatalf("child said %q", out)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("listener side: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("listener side did not finish")
	}
}

// 3.3.2: a dialer of another uid gets a reject "RDMG\xffpeer:…".
func TestShmPeerCheckOtherUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a child under another uid")
	}
	ln, addr := listenShm(t)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	out := runChild(t, addr, &syscall.Credential{Uid: 65534, Gid: 65534})
	hexPrefix := hex.EncodeToString([]byte("RDMG\xffpeer:"))
	if !strings.HasPrefix(out, "REJECT "+hexPrefix) {
		t.Fatalf("child of uid 65534: %q, want a reject starting %s", out, hexPrefix)
	}
	raw, _ := hex.DecodeString(strings.TrimPrefix(out, "REJECT "))
	t.Logf("reject private data (%d bytes): %q", len(raw), raw)
	if len(raw) > 56 {
		t.Errorf("reject private data of %d bytes > 56", len(raw))
	}
}

// 3.3.1: a listener on the unspecified address binds the wildcard name; a
// dialer of 127.0.0.1:port finds it after the specific name is refused.
func TestShmWildcardName(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ln, err := conn.Listen(ctx, "0.0.0.0:0", conn.WithProvider("shm"))
	if err != nil {
		t.Fatalf("conn.Listen: %v", err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	acc := acceptAsync(ln)
	sc, err := DialShm(ctx, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), ShmConfig{})
	if err != nil {
		t.Fatalf("dial 127.0.0.1:%d: %v", port, err)
	}
	defer sc.Close()
	if want := "rdmagrpc-shm/*:" + strconv.Itoa(port); sc.SocketName() != want {
		t.Fatalf("connected to %q, want %q", sc.SocketName(), want)
	}
	a := <-acc
	if a.err != nil {
		t.Fatalf("Accept: %v", a.err)
	}
	a.c.Close()
}

// 2.7: "or after 100 ms without any": what the client sends when the
// application writes nothing. The document does not say; record it.
func TestNegotiationClientSilentApplication(t *testing.T) {
	var dead int
	{
		l, _ := net.Listen("tcp", "127.0.0.1:0")
		dead = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	addr, ch := sniffServer(t, "shm", func(int) int { return dead })
	dialRdmagrpc(t, addr)
	r := nextSniff(t, ch, "silent application")
	t.Logf("with a silent application our listener sniffed %v, replayed %q, after offer %q %v", r.Kind, r.Replayed, r.AfterOffer, r.AfterOfferErr)
	if r.Kind == PlainClient && len(r.Replayed) == 0 {
		t.Fatalf("the client sent nothing: no negotiation after 100 ms")
	}
}

// Named control files (3.3.5): a second connection from this process lists
// the listener's files it keeps mapped (held) and names its own files
// instead of passing them; data flows on both connections.
func TestShmNamedControlFiles(t *testing.T) {
	ln, addr := listenShm(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	acc := acceptAsync(ln)
	sc1, err := DialShm(ctx, addr, ShmConfig{})
	if err != nil {
		t.Fatalf("step first dial: %v", err)
	}
	defer sc1.Close()
	a1 := <-acc
	if a1.err != nil {
		t.Fatalf("step first accept: %v", a1.err)
	}
	defer a1.c.Close()
	own := []uint64{sc1.mr.ino, sc1.qpRing.ino, sc1.cq.ino}
	t.Logf("first accept: held %v (our files %v), flags %#x", sc1.Peer.Held, own, sc1.Peer.Flags)
	if !heldAll(sc1.Peer.Held, own...) {
		t.Fatalf("step first accept: held %v does not list our files %v", sc1.Peer.Held, own)
	}

	acc = acceptAsync(ln)
	sc2, err := DialShm(ctx, addr, ShmConfig{Reuse: sc1, NameOwnFiles: true})
	if err != nil {
		t.Fatalf("step second dial (named: %v, needfds: %v): %v", sc2 != nil && sc2.ConnectNamed, sc2 != nil && sc2.GotNeedfds, err)
	}
	defer sc2.Close()
	t.Logf("second connect named %v (held %v, ctl %v); needfds %v; accept named %v (ctl %v, held %v); ring_off %d cq_off %d",
		sc2.ConnectNamed, sc2.qp.Held, sc2.qp.Ctl, sc2.GotNeedfds, sc2.AcceptNamed, sc2.Peer.Ctl, sc2.Peer.Held, sc2.Peer.RingOff, sc2.Peer.CQOff)
	if !sc2.ConnectNamed {
		t.Fatalf("second connect was not named")
	}
	a2 := <-acc
	if a2.err != nil {
		t.Fatalf("step second accept: %v", a2.err)
	}
	defer a2.c.Close()
	if p := a2.c.(*conn.Conn).Stats().Provider; p != "shm" {
		t.Fatalf("second accept provider %q", p)
	}
	if err := sc2.Send(ctx, []byte("two")); err != nil {
		t.Fatalf("step send on the second connection: %v", err)
	}
	readExactly(t, a2.c, []byte("two"), "listener reads on the second connection")
	if _, err := a2.c.Write([]byte("back")); err != nil {
		t.Fatal(err)
	}
	rs := recvUntil(t, ctx, sc2, "reply on the second connection", 5*time.Second, func(r *Received) bool { return r.Imm.Kind == kindSmall })
	if got := string(rs[len(rs)-1].Payload); got != "back" {
		t.Fatalf("reply on the second connection: %q", got)
	}
	if err := sc1.Send(ctx, []byte("one")); err != nil {
		t.Fatalf("step send on the first connection: %v", err)
	}
	readExactly(t, a1.c, []byte("one"), "listener reads on the first connection")
}

// Named control files after the first connection closed: the listener may
// have dropped our files (then it answers needfds and we send fds, 3.3.5).
func TestShmNamedAfterClose(t *testing.T) {
	ln, addr := listenShm(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	acc := acceptAsync(ln)
	sc1, err := DialShm(ctx, addr, ShmConfig{})
	if err != nil {
		t.Fatalf("step first dial: %v", err)
	}
	defer sc1.Release()
	a1 := <-acc
	if a1.err != nil {
		t.Fatalf("step first accept: %v", a1.err)
	}
	sc1.CloseKeepFiles()
	a1.c.Close()
	time.Sleep(100 * time.Millisecond)

	acc = acceptAsync(ln)
	sc2, err := DialShm(ctx, addr, ShmConfig{Reuse: sc1, NameOwnFiles: true})
	if err != nil {
		t.Fatalf("step second dial: %v", err)
	}
	defer sc2.Close()
	t.Logf("second connect named %v; needfds %v; accept named %v", sc2.ConnectNamed, sc2.GotNeedfds, sc2.AcceptNamed)
	a2 := <-acc
	if a2.err != nil {
		t.Fatalf("step second accept: %v", a2.err)
	}
	defer a2.c.Close()
	if err := sc2.Send(ctx, []byte("again")); err != nil {
		t.Fatalf("step send: %v", err)
	}
	readExactly(t, a2.c, []byte("again"), "listener reads")
}

// Protocol errors of 4.4, 4.6, 4.8, 4.10: the listener aborts (disconnect).
// "none" is the control: a valid message, no abort.
func TestShmProtocolErrors(t *testing.T) {
	cases := []struct {
		name  string
		abort bool
		do    func(ctx context.Context, sc *ShmConn) error
	}{
		{"none", false, func(ctx context.Context, sc *ShmConn) error { return sc.SendZero(ctx, kindCredit, 0) }},
		{"eof-then-data", true, func(ctx context.Context, sc *ShmConn) error {
			if err := sc.SendZero(ctx, kindEOF, 0); err != nil {
				return err
			}
			return sc.Send(ctx, []byte("late"))
		}},
		{"credits-above-slot-count", true, func(ctx context.Context, sc *ShmConn) error {
			sc.owed = 1
			return sc.SendZero(ctx, kindCredit, 0)
		}},
		{"credits-for-large-ring", true, func(ctx context.Context, sc *ShmConn) error {
			imm := Imm{Kind: kindCredit, Ring: 1, Credits: 1}
			return sc.writeImm(ctx, sc.PeerHello.RingAddr, sc.PeerHello.RingRkey, nil, imm.Encode())
		}},
		{"credit-length-4", true, func(ctx context.Context, sc *ShmConn) error { return sc.SendZero(ctx, kindCredit, 4) }},
		{"resume-without-park", true, func(ctx context.Context, sc *ShmConn) error { return sc.SendZero(ctx, kindCredit, 2) }},
		{"data-length-0", true, func(ctx context.Context, sc *ShmConn) error { return sc.SendRaw(ctx, kindSmall, nil, false) }},
		{"record-length-48", true, func(ctx context.Context, sc *ShmConn) error {
			return sc.SendRaw(ctx, kindControl, Record{Type: recRequest, Seq: 1, Size: 32768, Count: 16}.Encode()[:48], false)
		}},
		{"record-unknown-type", true, func(ctx context.Context, sc *ShmConn) error {
			return sc.SendRecord(ctx, Record{Type: 9, Seq: 1}, false)
		}},
		{"shrink-in-small-ring", true, func(ctx context.Context, sc *ShmConn) error {
			return sc.SendRecord(ctx, Record{Type: recShrink, Seq: 1}, false)
		}},
		{"read-end-none-outstanding", true, func(ctx context.Context, sc *ShmConn) error {
			return sc.SendZero(ctx, kindReadEnd, 1)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, sc, peer := shmPair(t)
			if err := tc.do(ctx, sc); err != nil {
				t.Fatalf("step send: %v", err)
			}
			wait := 3 * time.Second
			if !tc.abort {
				wait = 300 * time.Millisecond
			}
			deadline := time.Now().Add(wait)
			for time.Now().Before(deadline) {
				if _, _, _, closed := sc.Counters(); closed {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			_, _, _, closed := sc.Counters()
			peer.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			buf := make([]byte, 16)
			n, rerr := peer.Read(buf)
			t.Logf("%s: listener disconnected %v; its read %q, %v", tc.name, closed, buf[:n], rerr)
			if closed != tc.abort {
				t.Fatalf("%s: listener disconnected %v, want %v", tc.name, closed, tc.abort)
			}
		})
	}
}

// 2.8: an offered address whose port equals the dialed port is remembered;
// the next dial goes to it directly, without a TCP connection to us.
func TestNegotiationRememberedOffer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	shmLn, err := conn.Listen(ctx, "127.0.0.2:0", conn.WithProvider("shm"))
	if err != nil {
		t.Skipf("no 127.0.0.2 here: %v", err)
	}
	defer shmLn.Close()
	port := shmLn.Addr().(*net.TCPAddr).Port
	tcpLn, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		t.Skipf("port %d not free on 127.0.0.1: %v", port, err)
	}
	defer tcpLn.Close()
	ch := make(chan *SniffResult, 4)
	go func() {
		for {
			c, err := tcpLn.Accept()
			if err != nil {
				return
			}
			go func() {
				// Offer 127.0.0.2:port, the same port as dialed.
				r, err := Sniff(&fakeLocal{c, "127.0.0.2"}, ProviderCode("shm"), port)
				if err == nil {
					ch <- r
				}
			}()
		}
	}()
	addr := tcpLn.Addr().String()
	for i := 0; i < 2; i++ {
		acc := acceptAsync(shmLn)
		c, err := conn.Dial(ctx, addr, conn.WithProvider("shm"))
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		if _, err := c.Write([]byte(http2Preface + "x")); err != nil {
			t.Fatal(err)
		}
		a := <-acc
		if a.err != nil {
			t.Fatalf("dial %d: accept: %v", i, a.err)
		}
		readExactly(t, a.c, []byte(http2Preface+"x"), "stream over shm")
		a.c.Close()
		c.Close()
	}
	n := 0
	for done := false; !done; {
		select {
		case r := <-ch:
			n++
			t.Logf("negotiation %d: %v", n, r.Kind)
		case <-time.After(200 * time.Millisecond):
			done = true
		}
	}
	if n != 1 {
		t.Fatalf("%d negotiations for two dials, want 1 (the second dial goes to the remembered address)", n)
	}
}

// fakeLocal reports another local IP so that the offer names it.
type fakeLocal struct {
	net.Conn
	ip string
}

func (f *fakeLocal) LocalAddr() net.Addr {
	a := *f.Conn.LocalAddr().(*net.TCPAddr)
	a.IP = net.ParseIP(f.ip).To4()
	return &a
}
