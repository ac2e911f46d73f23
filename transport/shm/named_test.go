package shm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// namedPair is a listener and a dialing device set up as conn sets them
// up: each connection on the child device of the peer process.
type namedPair struct {
	t        *testing.T
	ctx      context.Context
	srv, cli *device
	l        transport.Listener
}

func newNamedPair(t *testing.T) *namedPair {
	p, _ := transport.Get(ProviderName)
	sd, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	cd, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	l, err := sd.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(func() {
		cancel()
		l.Close()
		sd.Close()
		cd.Close()
	})
	return &namedPair{t: t, ctx: ctx, srv: sd.(*device), cli: cd.(*device), l: l}
}

// connect sets up one connection and writes a word each way over it.
func (np *namedPair) connect() {
	t := np.t
	t.Helper()
	addr := np.l.Addr().String()
	type accepted struct {
		s   *isoSide
		q   transport.QP
		err error
	}
	done := make(chan accepted, 1)
	go func() {
		r, err := np.l.Accept(np.ctx)
		if err != nil {
			done <- accepted{err: err}
			return
		}
		s, err := newIsoSide(r.(transport.RequestDevice).Device())
		if err != nil {
			r.Reject(nil)
			done <- accepted{err: err}
			return
		}
		q, err := r.Accept(np.ctx, s.cfg(), s.private())
		done <- accepted{s, q, err}
	}()
	dev, err := np.cli.DeviceFor(np.ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := newIsoSide(dev)
	if err != nil {
		t.Fatal(err)
	}
	cq, err := dev.Connect(np.ctx, addr, cs.cfg(), cs.private())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cq.Close() })
	a := <-done
	if a.err != nil {
		t.Fatal(a.err)
	}
	t.Cleanup(func() { a.q.Close() })
	copy(cs.mem, "ping")
	raddr, rkey := remote(cq.PeerPrivate())
	if err := cs.write(cq, 0, 4, raddr+64, rkey); err != nil {
		t.Fatalf("client write: %v", err)
	}
	copy(a.s.mem, "pong")
	raddr, rkey = remote(a.q.PeerPrivate())
	if err := a.s.write(a.q, 0, 4, raddr+64, rkey); err != nil {
		t.Fatalf("server write: %v", err)
	}
	if string(a.s.mem[64:68]) != "ping" || string(cs.mem[64:68]) != "pong" {
		t.Fatalf("read %q and %q, want ping and pong", a.s.mem[64:68], cs.mem[64:68])
	}
}

type handshakeCounts struct{ fdsSent, named, resolved, asked int64 }

func countHandshakes(f func()) handshakeCounts {
	s, n, r, a := handshakes.fdsSent.Load(), handshakes.named.Load(), handshakes.resolved.Load(), handshakes.asked.Load()
	f()
	return handshakeCounts{handshakes.fdsSent.Load() - s, handshakes.named.Load() - n, handshakes.resolved.Load() - r, handshakes.asked.Load() - a}
}

// Once both processes hold each other's MR table and control arenas, a
// set-up names them instead of passing descriptors; a listener that let
// them go since asks for them, and the connection is set up all the same.
func TestControlFilesNamed(t *testing.T) {
	np := newNamedPair(t)
	if got := countHandshakes(np.connect); got != (handshakeCounts{fdsSent: 2}) {
		t.Fatalf("first connection: %+v, want descriptors both ways", got)
	}
	for i := range 3 {
		if got := countHandshakes(np.connect); got != (handshakeCounts{named: 2, resolved: 2}) {
			t.Fatalf("connection %d: %+v, want the files named both ways", i+2, got)
		}
	}
	// The listener lets go of the dialer's files (its device for the
	// dialer's process), as it does beyond maxKeptCtl of them.
	kd := np.srv.knownChild(np.cli.childPeer(t)) // both ends are this process
	if kd == nil {
		t.Fatal("the listener has no device for the dialer's process")
	}
	kd.releaseArenas()
	if got := countHandshakes(np.connect); got != (handshakeCounts{fdsSent: 1, named: 2, resolved: 1, asked: 1}) {
		t.Fatalf("after the listener let go: %+v, want the connect named, the dialer asked to send its files, the accept named", got)
	}
	if got := countHandshakes(np.connect); got != (handshakeCounts{named: 2, resolved: 2}) {
		t.Fatalf("next: %+v, want the files named both ways", got)
	}
}

// childPeer is the peer of the one child device d has (this process).
func (d *device) childPeer(t *testing.T) peerID {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	for id := range d.children {
		return id
	}
	t.Fatal("no child device")
	return peerID{}
}

// A connect that names files the listener does not hold from this process
// gets asked for them; one that then sends none is closed, and costs the
// listener nothing of what it holds: the next connection is named again.
func TestControlFilesNamedUnknown(t *testing.T) {
	np := newNamedPair(t)
	np.connect()
	np.connect() // both sides hold each other's files now
	held := np.srv.knownChild(np.cli.childPeer(t)).heldCtl()
	if len(held) == 0 {
		t.Fatal("the listener holds none of the dialer's files")
	}
	for _, tc := range []struct {
		name string
		ctl  [infoFDs]uint64
	}{
		{"unknown inodes", [infoFDs]uint64{1, 2, 3}},
		{"one unknown", [infoFDs]uint64{held[0], held[0], 1 << 60}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			info := qpInfo{num: 1, recvCap: 4, recvSGE: 1, cqCap: 8, addr: netip.MustParseAddrPort("127.0.0.1:1"), flags: ctlNamed, ctl: tc.ctl}
			c, _ := rawSocket(t, np.l, 0)
			if err := writeMsg(c, info.encode(msgConnect)); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			b, _, err := readMsg(c, make([]byte, maxMsg), nil)
			if err != nil || b[0] != msgNeedFDs {
				t.Fatalf("answer %v, %v; want msgNeedFDs", b, err)
			}
			if err := writeMsg(c, []byte{msgFDs}); err != nil {
				t.Fatal(err)
			}
			if b, _, err := readMsg(c, make([]byte, maxMsg), nil); !errors.Is(err, io.EOF) {
				t.Fatalf("answer %v, %v to a reply without descriptors; want the socket closed", b, err)
			}
		})
	}
	if got := countHandshakes(np.connect); got != (handshakeCounts{named: 2, resolved: 2}) {
		t.Fatalf("next connection: %+v, want the files named both ways", got)
	}
}

// An accept that names files the dialer did not list as held sets up
// nothing: the dialer maps only what it already held of that process.
func TestAcceptNamingUnlistedFilesRefused(t *testing.T) {
	np := newNamedPair(t)
	var ul *net.UnixListener
	var port int
	for port = 47000; port < 47100; port++ {
		var err error
		if ul, err = listenUnix(sockName(netip.MustParseAddr("127.0.0.1"), port)); err == nil {
			break
		}
	}
	if ul == nil {
		t.Skip("no free port for a fake listener")
	}
	defer ul.Close()
	go func() {
		c, err := ul.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		_, fds, err := readMsg(c, make([]byte, maxMsg), make([]byte, unix.CmsgSpace(4*infoFDs)))
		closeFDs(fds)
		if err != nil {
			return
		}
		info := qpInfo{num: 1, recvCap: 4, recvSGE: 1, cqCap: 8, addr: netip.MustParseAddrPort("127.0.0.1:1"),
			flags: acceptNoReady | ctlNamed, ctl: [infoFDs]uint64{1, 2, 3}}
		writeMsg(c, info.encode(msgAccept))
		c.Read(make([]byte, 1)) // until the dialer goes
	}()
	addr := "127.0.0.1:" + strconv.Itoa(port)
	dev, err := np.cli.DeviceFor(np.ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	s, err := newIsoSide(dev)
	if err != nil {
		t.Fatal(err)
	}
	q, err := dev.Connect(np.ctx, addr, s.cfg(), s.private())
	if err == nil {
		q.Close()
		t.Fatal("connected on an accept that named files the dialer does not hold")
	}
	if !strings.Contains(err.Error(), "did not list as held") {
		t.Fatalf("error %v, want the accept's names refused", err)
	}
}

// The largest connect or accept fits one message, and what follows the
// private data decodes as it was encoded.
func TestInfoWithNamesFitsOneMessage(t *testing.T) {
	m := qpInfo{num: 7, recvCap: 4, recvSGE: 1, cqCap: 8, addr: netip.MustParseAddrPort("[::1]:9"), private: make([]byte, maxPrivate),
		flags: acceptNoReady | ctlNamed, ctl: [infoFDs]uint64{11, 12, 1 << 63}}
	for i := range maxHeld {
		m.held = append(m.held, uint64(100+i))
	}
	b := m.encode(msgAccept)
	if len(b) > maxMsg {
		t.Fatalf("%d bytes, a message holds %d", len(b), maxMsg)
	}
	got, err := decodeInfo(b)
	if err != nil {
		t.Fatal(err)
	}
	if got.flags != m.flags || got.ctl != m.ctl || !slices.Equal(got.held, m.held) {
		t.Fatalf("decoded flags %#x ctl %v held %v, want %#x %v %v", got.flags, got.ctl, got.held, m.flags, m.ctl, m.held)
	}
	m.held = append(m.held, 1)
	if _, err := decodeInfo(m.encode(msgAccept)); err == nil {
		t.Fatalf("decoded a message listing %d held files, more than %d", len(m.held), maxHeld)
	}
	if _, err := decodeInfo(b[:len(b)-1]); err == nil {
		t.Fatal("decoded a message whose names were cut")
	}
}

// Across two processes as within one: the second and later connections
// to a listener name the control files both ways, and data flows over
// them both ways (the MR tables found by name check every key).
func TestControlFilesNamedAcrossProcesses(t *testing.T) {
	_, addr := startPeerMode(t, "named")
	p, _ := transport.Get(ProviderName)
	d, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() }) // after the QPs' (cleanups run last first)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	connect := func() {
		dev, err := d.(*device).DeviceFor(ctx, addr)
		if err != nil {
			t.Fatal(err)
		}
		s, err := newIsoSide(dev)
		if err != nil {
			t.Fatal(err)
		}
		q, err := dev.Connect(ctx, addr, s.cfg(), s.private())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { q.Close() })
		copy(s.mem, "ping")
		raddr, rkey := remote(q.PeerPrivate())
		if err := s.write(q, 0, 4, raddr+64, rkey); err != nil {
			t.Fatalf("write to the peer: %v", err)
		}
		testutil.Eventually(t, 5*time.Second, "the peer's write", func() (bool, string) {
			got := string(s.mem[64:68])
			return got == "pong", fmt.Sprintf("%q", got)
		})
	}
	if got := countHandshakes(connect); got != (handshakeCounts{fdsSent: 1}) {
		t.Fatalf("first connection: %+v, want our descriptors sent and the peer's received", got)
	}
	for i := range 3 {
		if got := countHandshakes(connect); got != (handshakeCounts{named: 1, resolved: 1}) {
			t.Fatalf("connection %d: %+v, want our files named and the peer's found by name", i+2, got)
		}
	}
}
