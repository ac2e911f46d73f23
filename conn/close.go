package conn

import (
	"context"
	"math"
	"net"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
)

// discardLocked drops everything received and not read, after Close,
// and has everything that arrives later dropped on arrival: the slots are
// freed and their credits returned at once.
func (c *rdmaConn) discardLocked() {
	c.discarding = true
	for _, e := range c.recvQ {
		if e.ring == rdvRing || e.spill != nil {
			continue
		}
		c.rx[e.ring].consumeNow(int(e.slot))
	}
	c.recvQ, c.readOff, c.spilled = nil, 0, 0
	c.rdv.in = nil // adverts we will not fetch; the peer knows (kindClose)
	c.returnCreditsLocked()
	c.ringsConsumedLocked()
}

// isClosed lets calls after Close fail at once instead of queueing behind
// a teardown that holds c.wmu while it delivers in the background.
func (c *rdmaConn) isClosed() bool { return c.closedFast.Load() }

// CloseWrite sends kindEOF once what was written is posted.
func (c *rdmaConn) CloseWrite() error {
	if c.isClosed() {
		return c.opErr("close", net.ErrClosed)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.awaitOpenLocked(context.Background(), c.wdl); err != nil {
		return c.opErr("close", err)
	}
	if c.closed {
		return c.opErr("close", net.ErrClosed)
	}
	return c.sendEOFLocked()
}

func (c *rdmaConn) sendEOFLocked() error {
	if c.wclosed || c.err != nil {
		return nil
	}
	c.wclosed = true
	if c.pendingLocked() {
		c.pend.eof = true // posted behind the pending message (pack.go)
		return nil
	}
	return c.postCtlLocked(kindEOF, small, 0)
}

// sendCloseLocked tells the peer we read no more, so that it stops
// holding rendezvous data for us (and its Close does not wait for us).
func (c *rdmaConn) sendCloseLocked() {
	if c.err != nil {
		return
	}
	if c.pendingLocked() {
		c.pend.close = true // it ends the stream too: after the pending message
		return
	}
	if err := c.postCtlLocked(kindClose, small, 0); err != nil {
		c.failLocked(err)
	}
}

// DefaultLinger bounds how long a closed connection keeps serving its
// peer the data written before Close (rendezvous messages the peer has
// not fetched yet), in the background, as a TCP socket keeps sending
// after close. SetLinger changes it per connection.
const DefaultLinger = 30 * time.Second

// lingering counts closed connections still delivering in the background.
var lingering atomic.Int64

// sentLocked: every message posted has completed (it is in the peer's
// memory, or the connection failed).
func (c *rdmaConn) sentLocked() bool {
	return c.tx[small].seq == c.tx[small].done && c.tx[large].seq == c.tx[large].done && c.ctlPending == 0 && !c.recordOut
}

// drainedLocked: the peer has everything written, rendezvous messages
// included, or reads no more (a peer that closed: waiting is pointless).
func (c *rdmaConn) drainedLocked() bool {
	return c.rdv.peerClosed || c.sentLocked() && len(c.rdv.out) == 0 && !c.pendingLocked()
}

// closeWait bounds how long Close itself waits for what it posted last
// (the end of stream) and for writes in flight to complete: microseconds
// with a live peer. What the peer must still fetch is delivered in the
// background.
const closeWait = 100 * time.Millisecond

// SetLinger: see Conn.SetLinger; what it bounds is teardown's wait.
func (c *rdmaConn) SetLinger(sec int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return c.opErr("set", net.ErrClosed)
	}
	c.linger, c.lingerSet = int32(min(max(sec, -1), math.MaxInt32)), true
	return nil
}

// Close ends both directions: the peer reads what was written, then
// io.EOF. It returns at once (see SetLinger); every resource of the
// connection is released once the peer has what was written, or the
// linger ran out.
func (c *rdmaConn) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return c.opErr("close", net.ErrClosed)
	}
	c.closed = true
	c.closedFast.Store(true)
	if c.enl.idleTimer != nil {
		c.enl.idleTimer.Stop()
	}
	c.broadcastLocked()
	opened := c.opened.Load()
	c.mu.Unlock()
	if !opened {
		// A dial that returned early and never opened: its wait for the
		// answer ends (establish), and nothing was ever sent.
		c.qp.Disconnect()
		c.wg.Wait()
		c.rmu.Lock()
		defer c.rmu.Unlock()
		c.release()
		return nil
	}

	// Blocked writers have seen closed and left; later ones see closed
	// once they hold c.wmu, which the teardown keeps until the memory
	// they would write into is gone.
	c.wmu.Lock()
	c.mu.Lock()
	c.confirmLocked()
	c.sendEOFLocked()
	c.sendCloseLocked()
	linger := DefaultLinger
	background := true
	if c.lingerSet && c.linger >= 0 {
		linger, background = time.Duration(c.linger)*time.Second, false
	}
	if background {
		wait := time.Now().Add(closeWait)
		for c.err == nil && !c.drainedLocked() && !(c.sentLocked() && len(c.rdv.out) > 0) && time.Now().Before(wait) {
			c.waitLocked(c.changed, wait)
		}
	}
	drained := c.err != nil || c.drainedLocked()
	c.mu.Unlock()
	if background && !drained {
		lingering.Add(1)
		go func() {
			defer lingering.Add(-1)
			c.teardown(time.Now().Add(linger))
		}()
		return nil
	}
	c.teardown(time.Now().Add(linger))
	return nil
}

// teardown waits until the peer has what was written, or deadline, then
// disconnects and releases everything; c.wmu is held on entry (by Close,
// maybe in another goroutine) and released on return.
func (c *rdmaConn) teardown(deadline time.Time) {
	defer c.wmu.Unlock()
	// Readers have seen closed and left (later ones leave at once): what
	// the peer sent is nobody's any more. Its slots go back, so that the
	// peer can still send the read requests that fetch what we wrote.
	c.rmu.Lock()
	c.mu.Lock()
	c.discardLocked()
	c.mu.Unlock()
	c.rmu.Unlock()
	c.mu.Lock()
	for c.err == nil && !c.drainedLocked() && time.Now().Before(deadline) {
		c.waitLocked(c.changed, deadline)
	}
	c.mu.Unlock()

	c.qp.Disconnect()
	c.wg.Wait()
	c.stopPolling()
	// A reader copies out of a ring slot or a rendezvous destination
	// without c.mu: that memory must outlive its copy. Readers woken by
	// the broadcast, and any later one, see closed and leave.
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.release()
}

// release frees what newConn, start, the enlargements and the
// rendezvous transfers created.
func (c *rdmaConn) release() {
	c.holdingLarge(false)
	if c.opened.Load() {
		enlargementMarker(c.id, 0, 0, 0, outcomeClosed)
	}
	if c.qp != nil {
		c.untrack() // tracked from start, or from an early dial's return
	}
	c.endTelemetry()
	c.releaseRendezvous()
	destroyed := c.qp == nil || c.qp.Close() == nil
	if c.cq != nil {
		c.cq.Close()
	}
	for _, b := range []*bufpool.Buffer{c.rx[large].buf, c.tx[large].stage} {
		if b != nil {
			b.Release()
		}
	}
	if c.pool != nil {
		c.pool.Trim() // a kit keeps the small rings alone
	}
	for _, b := range []*bufpool.Buffer{c.rx[small].buf, c.tx[small].stage} {
		if b != nil {
			b.Release()
		}
	}
	if c.pool != nil && c.pd != nil && destroyed {
		if s := c.pool.Stats(); s.InUseBuffers == 0 && s.FreeBuffers > 0 && keepKit(c.pool.Device(), c.pd, c.pool) {
			return
		}
	}
	if c.pool != nil {
		c.pool.Close()
	}
	if c.pd != nil {
		c.pd.Close()
	}
}
