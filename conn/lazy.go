package conn

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// The negotiation behind a dial. Dial returns once TCP is connected, as
// net.Dial does, and a goroutine of the Conn's, which lives for one round
// trip (or the RDMA dial an offer starts), runs the negotiation once the
// user's first bytes show an HTTP/2 client's start (anything else, such
// as TLS, is negotiated apart: see probe.go). Until
// its verdict the Conn holds what its user writes, up to maxHeld bytes,
// and its reads wait; at the verdict it carries on over TCP (the server's
// bytes replayed, the preface not sent twice) or hands every call to the
// upgraded connection, which the held bytes reach first. grpc-go's client
// writes its preface and SETTINGS, then waits for the server's SETTINGS:
// the negotiation's round trip runs beside that wait instead of before
// the dial's return.

// maxHeld bounds what a Conn holds before the verdict; a write that does
// not fit waits for it. grpc-go's first writes (preface, SETTINGS, window
// update) are under 100 bytes.
const maxHeld = 32 << 10

// behind is a dial's negotiation and its verdict.
type behind struct {
	done chan struct{} // closed at the verdict
	// out is closed once the held bytes went out (or never will): until
	// then writes wait, and the write deadline is kept here, since the
	// held bytes were taken by writes that returned and no later
	// deadline may cut them.
	out chan struct{}
	// Set under mu before done closes, fixed after.
	rdma *rdmaConn // the upgraded connection: every call goes to it
	err  error     // the negotiation failed: every call returns it
	open bool      // stays TCP: the Conn's own TCP side carries on
	// Set under mu before out closes, fixed after: why the held bytes
	// did not all go out (every later write returns it).
	flushErr error
	// ready is rdma once the held bytes went to it.
	ready atomic.Pointer[rdmaConn]

	// wrote (capacity 1) is signalled at each held write: the
	// negotiation waits for the first bytes before it sends anything.
	wrote chan struct{}

	mu       sync.Mutex
	held     []byte
	hasHeld  bool // a write was held: Close must deliver it
	hurried  bool // Handshake asked for the verdict: no wait for a first write
	flushed  bool // out is closed
	rdl, wdl time.Time
	closed   bool // Close was called: calls fail
	// discard: the negotiation's outcome is thrown away (Close with
	// nothing to deliver or linger 0, or the linger ran out).
	discard bool
	// closeLeft: Close left delivering the held bytes, and closing what
	// carries them, to the negotiation's goroutine.
	closeLeft bool
	// linger is SetLinger's before the verdict (lingerSet), applied to
	// the connection the verdict gives.
	linger    int
	lingerSet bool
	abortT    *time.Timer   // a background Close's linger
	changed   chan struct{} // closed and replaced on a deadline change or Close
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

// dialBehind makes the Conn of a dial whose negotiation on tc runs
// behind it.
func dialBehind(tc *net.TCPConn, addr string, o *options, name string) *tcpConn {
	c := &tcpConn{connCore: connCore{id: connIDs.Add(1), o: o}, nc: tc, strip: len(h2Preface)}
	ctx, cancel := context.WithCancel(context.WithValue(context.Background(), connIDKey{}, c.id))
	n := &behind{done: make(chan struct{}), out: make(chan struct{}), wrote: make(chan struct{}, 1), changed: make(chan struct{}), cancel: cancel}
	c.neg = n
	n.wg.Add(1)
	go c.negotiateBehind(ctx, addr, name)
	return c
}

func (c *tcpConn) negotiateBehind(ctx context.Context, addr, name string) {
	t, n := c, c.neg
	defer n.wg.Done()
	defer n.cancel()
	tc := t.nc.(*net.TCPConn)
	var v verdict
	preface, err := n.firstBytes(ctx)
	switch {
	case err != nil:
	case preface:
		v, err = settle(ctx, tc, addr, c.o, name)
	default:
		// Not an HTTP/2 client's start (a TLS ClientHello, say): the
		// negotiation's own preface must not come before it (probe.go).
		v, err = settleApart(ctx, tc, addr, c.o, name)
		if err == nil && v.untouched {
			t.wmu.Lock()
			t.strip = 0 // nothing was sent ahead of the user's bytes
			t.wmu.Unlock()
		}
	}
	n.mu.Lock()
	if n.discard {
		// Close ended it: what a waiting call returns says so, not the
		// failure Close caused.
		if v.rdma != nil {
			v.rdma.Close()
		}
		err = net.ErrClosed
	}
	held := n.held
	n.held = nil
	var r *rdmaConn
	switch {
	case err != nil:
		n.err = err
		tc.Close()
	case v.rdma != nil:
		r = v.rdma
		n.rdma = r
		// grpc-go knows this connection by our RemoteAddr, which stays
		// the TCP one: StatsHandler must find the upgraded one by it.
		r.trackAs(tc.RemoteAddr())
		r.SetReadDeadline(n.rdl)
		if n.lingerSet {
			r.SetLinger(n.linger)
		}
	default:
		n.open = true
		if n.lingerSet {
			tc.SetLinger(n.linger)
		}
		t.rmu.Lock()
		t.replay = v.replay
		t.rmu.Unlock()
		tc.SetReadDeadline(n.rdl)
		c.openTCP(telemetry.Client, v.why)
		if l := c.o.log(); l.Enabled(context.Background(), slog.LevelDebug) {
			l.Debug("rdmagrpc: connection over TCP", "remote", tc.RemoteAddr().String(), "why", v.why)
		}
	}
	close(n.done)
	n.mu.Unlock()

	// The held bytes go out with no deadline: Close ends a flush that
	// cannot.
	var ferr error
	switch {
	case err != nil:
		ferr = err
	case len(held) == 0:
	case r != nil:
		_, ferr = r.Write(held)
	default:
		t.wmu.Lock()
		_, ferr = t.writeLocked(held)
		t.wmu.Unlock()
	}
	n.mu.Lock()
	n.flushErr = ferr
	switch {
	case r != nil:
		r.SetWriteDeadline(n.wdl)
	case n.open:
		tc.SetWriteDeadline(n.wdl)
	}
	n.flushed = true
	if r != nil && ferr == nil {
		n.ready.Store(r)
	}
	close(n.out)
	closeLeft := n.closeLeft
	if n.abortT != nil {
		n.abortT.Stop()
	}
	n.mu.Unlock()
	if closeLeft {
		// What Write accepted went out: the connection closes now, as
		// Close would have closed it (an RDMA one delivers the rest in
		// the background, within its own linger).
		switch {
		case r != nil:
			r.Close()
		case n.open:
			c.closeSocket()
		}
	}
}

// firstWriteWait is how long a dial's negotiation waits for the user's
// first bytes before it sends its own. grpc-go writes its preface, or its
// TLS ClientHello, right after the dial; a protocol whose server speaks
// first writes nothing, and its first connection to a server learns the
// verdict this much later.
const firstWriteWait = 100 * time.Millisecond

// firstBytes waits until the held bytes tell whether the connection
// starts as an HTTP/2 client does (grpc-go's plaintext first write), or
// with something else (a TLS ClientHello), or ctx ends (Close). No bytes
// within firstWriteWait, or none when Handshake asks for the verdict,
// count as an HTTP/2 start: the negotiation goes first.
func (n *behind) firstBytes(ctx context.Context) (preface bool, err error) {
	t := time.NewTimer(firstWriteWait)
	defer t.Stop()
	for {
		n.mu.Lock()
		h := n.held
		switch {
		case len(h) >= len(h2Preface):
			n.mu.Unlock()
			return string(h[:len(h2Preface)]) == h2Preface, nil
		case len(h) > 0 && h2Preface[:len(h)] != string(h):
			n.mu.Unlock()
			return false, nil
		case len(h) == 0 && n.hurried:
			n.mu.Unlock()
			return true, nil
		}
		n.mu.Unlock()
		select {
		case <-n.wrote:
		case <-t.C:
			n.mu.Lock()
			none := len(n.held) == 0
			n.mu.Unlock()
			if none {
				return true, nil
			}
			// A start of the preface: wait for the rest.
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

// Kinds of wait for the verdict: whose deadline bounds it.
const (
	waitRead = iota
	waitWrite
	waitNoDeadline
)

// wait waits for the verdict, within the deadline of kind and ctx, and
// returns the upgraded connection (nil: TCP carries on) or why there is
// none.
func (n *behind) wait(ctx context.Context, kind int) (*rdmaConn, error) {
	if err := n.waitFor(ctx, kind, n.done); err != nil {
		return nil, err
	}
	return n.rdma, n.err
}

// waitFor waits until ch is closed, within the deadline of kind and ctx,
// or Close.
func (n *behind) waitFor(ctx context.Context, kind int, ch chan struct{}) error {
	for {
		select {
		case <-ch:
			return nil
		default:
		}
		n.mu.Lock()
		dl, changed, closed := time.Time{}, n.changed, n.closed
		switch kind {
		case waitRead:
			dl = n.rdl
		case waitWrite:
			dl = n.wdl
		}
		n.mu.Unlock()
		if closed {
			return net.ErrClosed
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if expired(dl) {
			return os.ErrDeadlineExceeded
		}
		var tm *time.Timer
		var timeout <-chan time.Time
		if !dl.IsZero() {
			tm = time.NewTimer(time.Until(dl))
			timeout = tm.C
		}
		select {
		case <-ch:
		case <-changed:
		case <-timeout:
		case <-ctx.Done():
		}
		if tm != nil {
			tm.Stop()
		}
	}
}

func (n *behind) broadcastLocked() {
	close(n.changed)
	n.changed = make(chan struct{})
}

// hold keeps b until the verdict if it fits and the verdict is not in;
// false: it waits for the held bytes to go out. flushed: they did.
func (n *behind) hold(b []byte) (ok, flushed bool, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.flushed {
		return false, true, nil
	}
	if n.closed {
		return false, false, net.ErrClosed
	}
	select {
	case <-n.done:
		return false, false, nil // going out now: wait for it
	default:
	}
	if expired(n.wdl) {
		return false, false, os.ErrDeadlineExceeded
	}
	if len(n.held)+len(b) > maxHeld {
		return false, false, nil
	}
	n.held = append(n.held, b...)
	n.hasHeld = true
	select {
	case n.wrote <- struct{}{}:
	default:
	}
	return true, false, nil
}

// readTarget is the connection a read goes to, once the verdict is in
// (within the read deadline): the upgraded one, or nil for the Conn's own
// TCP side.
func (c *tcpConn) readTarget() (*rdmaConn, error) {
	n := c.neg
	if n == nil {
		return nil, nil
	}
	if r := n.ready.Load(); r != nil {
		return r, nil
	}
	r, err := n.wait(context.Background(), waitRead)
	if err != nil {
		return nil, c.opErr("read", err)
	}
	return r, nil
}

func (c *tcpConn) Read(b []byte) (int, error) {
	if c.isClosed() {
		return 0, c.opErr("read", net.ErrClosed)
	}
	r, err := c.readTarget()
	switch {
	case err != nil:
		return 0, err
	case r != nil:
		return r.Read(b)
	}
	return c.read(b)
}

func (c *tcpConn) Write(b []byte) (int, error) {
	if c.isClosed() {
		return 0, c.opErr("write", net.ErrClosed)
	}
	t := c
	n := t.neg
	if n == nil {
		t.wmu.Lock()
		defer t.wmu.Unlock()
		return t.writeLocked(b)
	}
	if r := n.ready.Load(); r != nil {
		return r.Write(b)
	}
	for {
		ok, flushed, err := n.hold(b)
		if err != nil {
			return 0, c.opErr("write", err)
		}
		if ok {
			return len(b), nil
		}
		if flushed {
			break
		}
		if err := n.waitFor(context.Background(), waitWrite, n.out); err != nil {
			return 0, c.opErr("write", err)
		}
	}
	switch {
	case n.flushErr != nil:
		return 0, c.opErr("write", n.flushErr)
	case n.rdma != nil:
		return n.rdma.Write(b)
	}
	t.wmu.Lock()
	defer t.wmu.Unlock()
	return t.writeLocked(b)
}

// Handshake: see Conn.Handshake.
func (c *tcpConn) Handshake(ctx context.Context) error {
	if c.neg == nil {
		return nil
	}
	if _, err := c.settled(ctx); err != nil {
		return c.opErr("handshake", err)
	}
	return nil
}

// settled waits for the verdict with no deadline but ctx and Close, and
// for the held bytes to go out: what follows needs the final connection.
func (c *tcpConn) settled(ctx context.Context) (*rdmaConn, error) {
	n := c.neg
	// Whoever waits for the verdict before writing anything does not
	// wait for firstWriteWait too.
	n.mu.Lock()
	n.hurried = true
	n.mu.Unlock()
	select {
	case n.wrote <- struct{}{}:
	default:
	}
	if err := n.waitFor(ctx, waitNoDeadline, n.out); err != nil {
		return nil, err
	}
	if n.err != nil {
		return nil, n.err
	}
	return n.rdma, n.flushErr
}

func (c *tcpConn) setDeadline(t time.Time, read, write bool) error {
	if n := c.neg; n != nil {
		n.mu.Lock()
		defer n.mu.Unlock()
		if read {
			n.rdl = t
			switch {
			case n.rdma != nil:
				n.rdma.SetReadDeadline(t)
			case n.open:
				c.nc.SetReadDeadline(t)
			}
		}
		if write {
			// Kept until the held bytes are out (see behind.out).
			n.wdl = t
			switch {
			case !n.flushed:
			case n.rdma != nil:
				n.rdma.SetWriteDeadline(t)
			case n.open:
				c.nc.SetWriteDeadline(t)
			}
		}
		if !n.flushed {
			n.broadcastLocked() // a write or a read may wait on them
		}
		return nil
	}
	switch {
	case read && write:
		return c.nc.SetDeadline(t)
	case read:
		return c.nc.SetReadDeadline(t)
	}
	return c.nc.SetWriteDeadline(t)
}

// closeBehind is Close of a dial's Conn. Bytes a Write accepted while
// the negotiation was under way are delivered, as a TCP socket delivers
// what it accepted after close: the negotiation finishes, the held bytes
// go out, and the connection closes, in the background within
// DefaultLinger (or within SetLinger's seconds, Close waiting); linger 0
// discards them.
func (c *tcpConn) closeBehind() error {
	n := c.neg
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return c.opErr("close", net.ErrClosed)
	}
	n.closed = true
	c.closing.Store(true)
	n.broadcastLocked()
	r, open := n.rdma, n.open
	if !n.flushed && n.err == nil && n.hasHeld && !(n.lingerSet && n.linger == 0) {
		n.closeLeft = true
		linger, background := DefaultLinger, true
		if n.lingerSet && n.linger > 0 {
			linger, background = time.Duration(n.linger)*time.Second, false
		}
		if background {
			n.abortT = time.AfterFunc(linger, c.abortBehind)
			n.mu.Unlock()
			return nil
		}
		n.mu.Unlock()
		t := time.NewTimer(linger)
		select {
		case <-n.out:
		case <-t.C:
			c.abortBehind()
		}
		t.Stop()
		n.wg.Wait()
		return nil
	}
	n.discard = true
	n.mu.Unlock()
	n.cancel()
	var err error
	switch {
	case r != nil:
		err = r.Close() // also ends a write of the held bytes
	case open:
		err = c.closeSocket()
	default:
		// Ends the negotiation's reads and writes; it sees discard and
		// closes the socket (and an upgraded connection) itself.
		c.nc.SetDeadline(aLongTimeAgo)
	}
	n.wg.Wait()
	return err
}

// abortBehind ends a closed Conn's delivery of its held bytes when its
// linger ran out: the negotiation, or the flush, fails, and the
// negotiation's goroutine closes what is left.
func (c *tcpConn) abortBehind() {
	n := c.neg
	n.mu.Lock()
	n.discard = true
	r := n.rdma
	n.mu.Unlock()
	n.cancel()
	c.nc.SetDeadline(aLongTimeAgo)
	if r != nil {
		r.SetLinger(0)
		r.Close()
	}
}

// ProviderNegotiating is Stats.Provider of a connection that does not
// know yet what it runs on: the negotiation behind its dial, or an early
// dial's wait for the listener's answer, is under way. Stats never waits
// for a peer (as crypto/tls's ConnectionState does not wait for the
// handshake); Handshake does.
const ProviderNegotiating = "negotiating"

// statsBehind is Stats of a dial's Conn: ok false once TCP carries on.
func (c *tcpConn) statsBehind() (s Stats, ok bool) {
	n := c.neg
	select {
	case <-n.done:
	default:
		return Stats{Provider: ProviderNegotiating, ProviderReason: "the negotiation behind the dial has no verdict yet"}, true
	}
	switch {
	case n.err != nil:
		return Stats{ProviderReason: fmt.Sprintf("no connection: the negotiation failed: %v", n.err)}, true
	case n.rdma != nil:
		return n.rdma.Stats(), true
	}
	return Stats{}, false
}
