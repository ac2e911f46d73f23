package conn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// tcpSide is what a Conn over TCP holds instead of a queue pair: a plain
// gRPC client accepted on a listener's TCP side, or a dial that fell back
// (negotiate.go). Every Conn method hands over to it when c.tcp is set.
type tcpSide struct {
	nc net.Conn
	// replay is what the negotiation read and the next reader must still
	// see (the client's HTTP/2 preface and SETTINGS on a server, the
	// server's first bytes on a client); strip is how much of the HTTP/2
	// client preface, already sent by the negotiation, is still to be
	// dropped from our user's first writes.
	rmu    sync.Mutex
	replay []byte
	// probing is set on a probe's connection until the first read has
	// taken the server's answer (negotiate.go).
	probing *probing
	wmu     sync.Mutex
	strip   int
	// start, when set, goes out in place of the client preface (a
	// probe's, which the dial did not send: negotiate.go).
	start []byte
}

// errNotHTTP2 is a write on a fallen-back connection that does not start
// with the HTTP/2 client preface: the negotiation already sent it, so only
// an HTTP/2 (gRPC) stream can follow.
var errNotHTTP2 = errors.New("conn: this connection fell back to TCP after an HTTP/2 negotiation: it carries HTTP/2 (gRPC) only, and the first write was not the client preface")

// probing is the dialed address and provider of a probe, whose cache
// entry the answer may end.
type probing struct{ addr, provider string }

func (t *tcpSide) read(b []byte) (int, error) {
	t.rmu.Lock()
	if p := t.probing; p != nil {
		t.probing = nil
		if err := t.takeAnswer(p); err != nil {
			t.rmu.Unlock()
			return 0, err
		}
	}
	if len(t.replay) > 0 {
		n := copy(b, t.replay)
		t.replay = t.replay[n:]
		t.rmu.Unlock()
		return n, nil
	}
	t.rmu.Unlock()
	return t.nc.Read(b)
}

// takeAnswer reads a probed server's first bytes: an rdmagrpc listener's
// verdict, dropped (and an offer makes the next dial negotiate), or a
// plain server's HTTP/2, kept for the reader.
func (t *tcpSide) takeAnswer(p *probing) error {
	var magic [len(replyMagic)]byte
	n, err := io.ReadFull(t.nc, magic[:])
	if err != nil && n > 0 && replyMagic[:n] == string(magic[:n]) {
		// Cut inside what may be our reply's magic: neither HTTP/2 to
		// hand on nor an answer. The next dial negotiates in full.
		forgetServer(p.addr, p.provider)
		return fmt.Errorf("conn: the answer to our probe: %w", err)
	}
	if string(magic[:n]) != replyMagic {
		t.replay = append(t.replay, magic[:n]...)
		if n > 0 {
			return nil // the error, if any, comes again at the next read
		}
		return err
	}
	verdict, _, err := readReply(t.nc)
	if err != nil {
		forgetServer(p.addr, p.provider)
		return fmt.Errorf("conn: the answer to our probe: %w", err)
	}
	if verdict == verdictRDMA {
		forgetServer(p.addr, p.provider)
	}
	return nil
}

func (t *tcpSide) write(b []byte) (int, error) {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	skipped := 0
	if t.strip > 0 {
		want := h2Preface[len(h2Preface)-t.strip:]
		n := min(len(want), len(b))
		if string(b[:n]) != want[:n] {
			return 0, errNotHTTP2
		}
		t.strip -= n
		b, skipped = b[n:], n
		if t.strip == 0 && t.start != nil {
			start := t.start
			t.start = nil
			// One writev: the start and what followed the preface.
			bufs := net.Buffers{start, b}
			n, err := bufs.WriteTo(t.nc)
			if n < int64(len(start)) {
				return 0, err // the stream is broken: nothing of b went
			}
			return skipped + int(n) - len(start), err
		}
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
	c := &Conn{id: connIDs.Add(1), provider: telemetry.ProviderTCP, providerWhy: why, o: o, changed: make(chan struct{})}
	c.tcp = &tcpSide{nc: nc, replay: replay}
	if strip {
		c.tcp.strip = len(h2Preface)
	}
	c.tel = o.tel.StartConn(context.Background(), role, c.id, telemetry.ProviderTCP, why)
	c.tel.Connected(nc.LocalAddr(), nc.RemoteAddr(), func() telemetry.Snapshot { return telemetry.Snapshot{} })
	enlargementMarker(c.id, 0, 0, 0, outcomeOpenedTCP)
	c.track()
	return c
}

func (c *Conn) tcpWriteBuffers(v net.Buffers) (int64, error) {
	var total int64
	for _, b := range v {
		n, err := c.tcp.write(b)
		total += int64(n)
		if err != nil {
			return total, c.opErr("write", err)
		}
	}
	return total, nil
}

func (c *Conn) tcpCloseWrite() error {
	if cw, ok := c.tcp.nc.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.opErr("close write", errors.ErrUnsupported)
}

func (c *Conn) tcpSetLinger(sec int) error {
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
