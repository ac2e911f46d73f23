package conn

import (
	"context"
	"errors"
	"math"
	"net"
	"sync"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// tcpSide is what a Conn over TCP holds instead of a queue pair: a plain
// gRPC client accepted on a listener's TCP side, or a dial (negotiate.go).
// Every Conn method hands over to it when c.tcp is set, and it to the
// upgraded connection when the negotiation behind a dial found RDMA
// (lazy.go).
type tcpSide struct {
	nc net.Conn
	// neg is set on a dial's Conn: the negotiation that runs behind it.
	neg *behind
	// replay is what the negotiation read and the next reader must still
	// see (the client's HTTP/2 preface and SETTINGS on a server, the
	// server's first bytes on a client); strip is how much of the HTTP/2
	// client preface, already sent by the negotiation, is still to be
	// dropped from our user's first writes.
	rmu    sync.Mutex
	replay []byte
	wmu    sync.Mutex
	strip  int
}

// errNotHTTP2 is a write on a fallen-back connection that does not start
// with the HTTP/2 client preface: the negotiation already sent it, so only
// an HTTP/2 (gRPC) stream can follow.
var errNotHTTP2 = errors.New("conn: this connection fell back to TCP after an HTTP/2 negotiation: it carries HTTP/2 (gRPC) only, and the first write was not the client preface")

func (t *tcpSide) read(b []byte) (int, error) {
	t.rmu.Lock()
	if len(t.replay) > 0 {
		n := copy(b, t.replay)
		t.replay = t.replay[n:]
		t.rmu.Unlock()
		return n, nil
	}
	t.rmu.Unlock()
	return t.nc.Read(b)
}

// writeLocked writes b to the TCP connection, t.wmu held.
func (t *tcpSide) writeLocked(b []byte) (int, error) {
	skipped := 0
	if t.strip > 0 {
		want := h2Preface[len(h2Preface)-t.strip:]
		n := min(len(want), len(b))
		if string(b[:n]) != want[:n] {
			return 0, errNotHTTP2
		}
		t.strip -= n
		b, skipped = b[n:], n
		if len(b) == 0 {
			return skipped, nil
		}
	}
	n, err := t.nc.Write(b)
	return skipped + n, err
}

// newTCPConn makes a Conn of nc. why is the provider reason Stats and the
// connection span report.
func newTCPConn(role string, nc net.Conn, replay []byte, strip bool, why string, o *options) *Conn {
	c := &Conn{id: connIDs.Add(1), o: o, changed: make(chan struct{})}
	c.tcp = &tcpSide{nc: nc, replay: replay}
	if strip {
		c.tcp.strip = len(h2Preface)
	}
	c.openTCP(role, why)
	return c
}

// openTCP starts what a Conn that carries on over TCP reports: its
// provider, span and marker.
func (c *Conn) openTCP(role, why string) {
	nc := c.tcp.nc
	c.st.Provider, c.st.ProviderReason = telemetry.ProviderTCP, why
	c.tel = c.o.tel.StartConn(context.Background(), role, c.id, telemetry.ProviderTCP, why)
	c.tel.Connected(nc.LocalAddr(), nc.RemoteAddr(), func() telemetry.Snapshot { return telemetry.Snapshot{} })
	enlargementMarker(c.id, 0, 0, 0, outcomeOpenedTCP)
	c.track()
}

// upgraded is the connection a dial's negotiation found RDMA for, once
// every call can go to it; nil otherwise.
func (t *tcpSide) upgraded() *Conn {
	if t.neg == nil {
		return nil
	}
	return t.neg.ready.Load()
}

func (c *Conn) tcpWriteBuffers(v net.Buffers) (int64, error) {
	var total int64
	for _, b := range v {
		n, err := c.tcpWrite(b)
		total += int64(n)
		if err != nil {
			return total, c.opErr("write", err)
		}
	}
	return total, nil
}

func (c *Conn) tcpCloseWrite() error {
	if c.tcp.neg != nil {
		r, err := c.settled(context.Background())
		if err != nil {
			return c.opErr("close write", err)
		}
		if r != nil {
			return r.CloseWrite()
		}
		// TCP carries on, and the held bytes are out (settled).
	}
	if cw, ok := c.tcp.nc.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.opErr("close write", errors.ErrUnsupported)
}

func (c *Conn) tcpSetLinger(sec int) error {
	if n := c.tcp.neg; n != nil {
		// Before the verdict it is kept for the connection the verdict
		// gives (and for Close's delivery of held bytes): a user sets
		// it right before Close, and must not wait for a peer here.
		n.mu.Lock()
		if n.closed {
			n.mu.Unlock()
			return c.opErr("set", net.ErrClosed)
		}
		select {
		case <-n.done:
		default:
			n.linger, n.lingerSet = min(max(sec, -1), math.MaxInt32), true
			n.mu.Unlock()
			return nil
		}
		r, err := n.rdma, n.err
		n.mu.Unlock()
		if err != nil {
			return c.opErr("set", err)
		}
		if r != nil {
			return r.SetLinger(sec)
		}
	}
	if tc, ok := c.tcp.nc.(*net.TCPConn); ok {
		return tc.SetLinger(sec)
	}
	return nil
}

func (c *Conn) tcpClose() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return c.opErr("close", net.ErrClosed)
	}
	c.closed = true
	c.mu.Unlock()
	err := c.tcp.nc.Close()
	c.untrack()
	c.endTelemetry()
	enlargementMarker(c.id, 0, 0, 0, outcomeClosed)
	return err
}
