package conn

import (
	"context"
	"errors"
	"io"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// tcpConn is a connection over TCP: a plain gRPC client accepted on a
// listener's TCP side, a dial that fell back, or a dial whose negotiation
// runs behind it (neg, lazy.go) and which hands every call to the RDMA
// connection the negotiation found, once it found one.
type tcpConn struct {
	connCore
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
	// closing: Close was called, calls fail at once (isClosed); closed:
	// the socket was closed, once (closeSocket).
	closing, closed atomic.Bool
	// provider and why are Stats' Provider and ProviderReason, set when
	// the connection carries on over TCP (openTCP).
	provider, why string
}

// errNotHTTP2 is a write on a fallen-back connection that does not start
// with the HTTP/2 client preface: the negotiation already sent it, so only
// an HTTP/2 (gRPC) stream can follow.
var errNotHTTP2 = errors.New("conn: this connection fell back to TCP after an HTTP/2 negotiation: it carries HTTP/2 (gRPC) only, and the first write was not the client preface")

func (t *tcpConn) read(b []byte) (int, error) {
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
func (t *tcpConn) writeLocked(b []byte) (int, error) {
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

// newTCPConn makes a connection over TCP of nc. why is the provider
// reason Stats and the connection span report.
func newTCPConn(role string, nc net.Conn, replay []byte, strip bool, why string, o *options) *tcpConn {
	c := &tcpConn{connCore: connCore{id: connIDs.Add(1), o: o}, nc: nc, replay: replay}
	if strip {
		c.strip = len(h2Preface)
	}
	c.openTCP(role, why)
	return c
}

// openTCP starts what a connection that carries on over TCP reports: its
// provider, span and marker.
func (c *tcpConn) openTCP(role, why string) {
	c.provider, c.why = telemetry.ProviderTCP, why
	c.tel = c.o.tel.StartConn(context.Background(), role, c.id, telemetry.ProviderTCP, why)
	c.tel.Connected(c.nc.LocalAddr(), c.nc.RemoteAddr(), func() telemetry.Snapshot { return telemetry.Snapshot{} })
	enlargementMarker(c.id, 0, 0, 0, outcomeOpenedTCP)
	c.track()
}

// upgraded is the connection a dial's negotiation found RDMA for, once
// every call can go to it; nil otherwise.
func (c *tcpConn) upgraded() *rdmaConn {
	if c.neg == nil {
		return nil
	}
	return c.neg.ready.Load()
}

func (c *tcpConn) isClosed() bool { return c.closing.Load() }

func (c *tcpConn) opErr(op string, err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.nc.LocalAddr(), Addr: c.nc.RemoteAddr(), Err: err}
}

func (c *tcpConn) WriteBuffers(v net.Buffers) (int64, error) {
	if r := c.upgraded(); r != nil {
		return r.WriteBuffers(v)
	}
	var total int64
	for _, b := range v {
		n, err := c.Write(b)
		total += int64(n)
		if err != nil {
			return total, c.opErr("write", err)
		}
	}
	return total, nil
}

func (c *tcpConn) CloseWrite() error {
	if c.neg != nil {
		r, err := c.settled(context.Background())
		if err != nil {
			return c.opErr("close write", err)
		}
		if r != nil {
			return r.CloseWrite()
		}
		// TCP carries on, and the held bytes are out (settled).
	}
	if cw, ok := c.nc.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.opErr("close write", errors.ErrUnsupported)
}

func (c *tcpConn) SetLinger(sec int) error {
	if n := c.neg; n != nil {
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
	if tc, ok := c.nc.(*net.TCPConn); ok {
		return tc.SetLinger(sec)
	}
	return nil
}

func (c *tcpConn) Close() error {
	if c.neg != nil {
		return c.closeBehind()
	}
	c.closing.Store(true)
	return c.closeSocket()
}

// closeSocket closes the TCP connection and ends what it reports.
func (c *tcpConn) closeSocket() error {
	if !c.closed.CompareAndSwap(false, true) {
		return c.opErr("close", net.ErrClosed)
	}
	err := c.nc.Close()
	c.untrack()
	c.tel.End()
	enlargementMarker(c.id, 0, 0, 0, outcomeClosed)
	return err
}

func (c *tcpConn) SetDeadline(t time.Time) error      { return c.setDeadline(t, true, true) }
func (c *tcpConn) SetReadDeadline(t time.Time) error  { return c.setDeadline(t, true, false) }
func (c *tcpConn) SetWriteDeadline(t time.Time) error { return c.setDeadline(t, false, true) }

// Stats of a connection over TCP has its provider and why; those of the
// RDMA connection a negotiation upgraded to once it did.
func (c *tcpConn) Stats() Stats {
	if c.neg != nil {
		if s, ok := c.statsBehind(); ok {
			return s
		}
	}
	return Stats{Provider: c.provider, ProviderReason: c.why}
}

// SetupSteps are the upgraded connection's, once the negotiation found
// one; nil over TCP.
func (c *tcpConn) SetupSteps() []transport.SetupStep {
	if c.neg == nil {
		return nil
	}
	if r, err := c.neg.wait(context.Background(), waitNoDeadline); err == nil && r != nil {
		return r.SetupSteps()
	}
	return nil
}
