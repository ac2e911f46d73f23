package conn

import (
	"errors"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// Shrinking: a direction whose large buffers carried nothing for
// WithIdleShrink goes back to the small phase, and both sides give the
// large memory back: registered memory follows traffic.
//
// The writer decides, since it alone knows when it last wrote. With no
// write in progress (it holds c.wmu) and every large write completed, it
// posts a shrink record as the last message into the peer's large ring
// and, in the same critical section, makes the small ring its sending
// ring again and deregisters its large staging. A reliable connection
// delivers in order, so the peer sees the record after every message the
// writer put into that ring and before anything it sends after: from the
// record on, nothing may land in the large ring (the peer fails the
// connection if something does, and once it is deregistered the provider
// refuses the write itself). The peer retires the ring: it keeps it until
// its reader has consumed what is still there, returns no more credits
// for it, then deregisters it. Credits the peer returned for the old ring
// before it saw the record may reach the writer after its shrink: it
// drops large-ring credits until the ack of its next enlargement, which
// the peer sends after it saw the record, so after every such credit.
//
// The small ring must still be there: a peer that frees it on
// enlargement (WithFreeSmallOnEnlarge) says so in its ack, and such a
// direction never shrinks. An enlargement request that arrives while the
// old ring is still being drained is served once it is gone.

// armShrinkLocked (re)arms the shrink timer of an enlarged direction.
func (c *rdmaConn) armShrinkLocked() {
	d := c.shrinkAfter()
	if d <= 0 || !c.enl.peerKeepsSmall || c.closed {
		return
	}
	c.parkArmed = false
	c.armIdleLocked(max(time.Until(c.enl.lastLarge.Add(d)), 0))
}

// shrinkIfIdle runs on the shrink timer: it shrinks the sending direction
// when it is idle and can be shrunk now, or re-arms the timer.
func (c *rdmaConn) shrinkIfIdle() {
	if !c.wmu.TryLock() {
		// A write is in progress: not idle. Close also holds c.wmu for
		// its teardown; it set closed first, which the re-arm checks.
		c.mu.Lock()
		c.enl.lastLarge = time.Now()
		c.armShrinkLocked()
		c.mu.Unlock()
		return
	}
	defer c.wmu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.err != nil || c.enl.phase != phaseLarge {
		return
	}
	t := &c.tx[large]
	if w := time.Unix(0, c.lastWrite.Load()); w.After(c.enl.lastLarge) {
		c.enl.lastLarge = w
	}
	if time.Since(c.enl.lastLarge) < c.shrinkAfter() {
		c.armShrinkLocked()
		return
	}
	if t.done != t.seq { // completions still to come: look again soon
		c.confirmLocked() // behind messages left unsignalled (signal.go)
		c.enl.lastLarge = time.Now().Add(-c.shrinkAfter() + 10*time.Millisecond)
		c.armShrinkLocked()
		return
	}
	if err := c.shrinkLocked(); err != nil {
		if !errors.Is(err, errShrinkBusy) {
			return // the connection failed or closed
		}
		c.enl.lastLarge = time.Now()
		c.armShrinkLocked()
	}
}

var errShrinkBusy = errors.New("conn: shrink: no credit in the peer's large ring")

// shrinkLocked takes the sending direction back to the small phase.
// c.wmu and c.mu are held, the direction is large and every large write
// has completed.
func (c *rdmaConn) shrinkLocked() error {
	if c.pendingLocked() {
		return errShrinkBusy // the record must follow the pending message
	}
	start := time.Now()
	t := &c.tx[large]
	from, to := t.size, c.tx[small].size
	// A short bound: credits come back as the peer's reader reads; a peer
	// that reads nothing keeps its large ring for now.
	rec := record{typ: recShrink, seq: c.enl.reqSeq}
	if c.enl.climbing {
		rec.addr = shrinkClimb
	}
	err := c.sendRecordLocked(rec, start.Add(c.o.ackTimeout), true)
	if err != nil {
		if c.err == nil && !c.closed {
			return errShrinkBusy
		}
		return err
	}
	// The record was the last message into the large ring.
	c.sending = small
	c.enl.shrank()
	if t.stage != nil {
		if derr := t.stage.Discard(); derr != nil {
			c.st.ShrinkDiscardErrors++ // still registered: the pool reports it at Close
		}
	}
	*t = txRing{}
	c.pool.Trim() // rendezvous sources kept for reuse: idle now too
	d := time.Since(start)
	if c.enl.climbing {
		return nil // a step up the ladder, not a shrink: climb asks next
	}
	c.enl.level = 0 // the next enlargement starts at the first large phase
	c.st.Shrinks++
	c.armParkLocked() // and, idle on, the small ring parks
	reason := telemetry.ReasonIdle
	if c.enl.pressure {
		c.enl.pressure = false
		c.st.PressureShrinks++
		reason = telemetry.ReasonPressure
	}
	c.st.LastShrinkDuration = d
	c.broadcastLocked()
	enlargementMarker(c.id, uint32(from), uint32(to), d.Nanoseconds(), outcomeShrunk)
	c.shrinkTelemetryLocked(telemetry.Sender, reason, start, d, from, to)
	return nil
}

// shrinkTelemetryLocked: the span (linked to the RPCs in flight), the
// metric, and the event on those RPCs' spans (linked to the span).
func (c *rdmaConn) shrinkTelemetryLocked(side, reason string, start time.Time, d time.Duration, from, to int) {
	var links []trace.Link
	inflight := c.rpcsInFlight()
	if inflight {
		links = c.rpcLinks()
	}
	sc := c.tel.Shrunk(side, reason, start, d, from, to, links)
	if inflight {
		c.rpcEvent(telemetry.EventRPCShrink, start.Add(d), sc,
			telemetry.KeySide.String(side), telemetry.KeyShrinkReason.String(reason),
			telemetry.KeyFromSize.Int(from), telemetry.KeyToSize.Int(to))
	}
}

// retireLargeLocked is the peer's shrink record arrived (poller): the
// large receive ring takes nothing more and goes once drained. climb: the
// writer steps up the ladder rather than shrinking.
func (c *rdmaConn) retireLargeLocked(climb bool) error {
	if err := c.enl.shrinkRecord(climb, time.Now()); err != nil {
		return err
	}
	c.rx[large].retire() // the writer has no use for its credits any more
	c.maybeDropLargeLocked()
	return nil
}

var errShrinkNoRing = errors.New("shrink record with no large ring in use")

// noteWrite marks the end of a Write for the idle shrink (only where it
// is on: a clock read per Write otherwise for nothing).
func (c *rdmaConn) noteWrite() {
	if c.o.idleShrink > 0 {
		c.lastWrite.Store(time.Now().UnixNano())
	}
}

// ringsConsumedLocked gives back receive rings whose last use was just
// consumed: the small one after an enlargement (WithFreeSmallOnEnlarge),
// a large one the writer shrank away from. Call it after consuming.
func (c *rdmaConn) ringsConsumedLocked() {
	c.maybeFreeSmallLocked()
	c.maybeDropLargeLocked()
}

// maybeDropLargeLocked deregisters a retiring large receive ring once the
// reader consumed everything in it. Call it after consuming from it.
func (c *rdmaConn) maybeDropLargeLocked() {
	r := &c.rx[large]
	if !c.enl.draining() || !r.drained() {
		return
	}
	from := r.size
	climb, d := c.enl.freed(time.Now())
	reason := telemetry.ReasonIdle
	if !r.askedAt.IsZero() {
		reason = telemetry.ReasonPressure
	}
	if err := r.buf.Discard(); err != nil {
		c.st.ShrinkDiscardErrors++
	}
	*r = rxRing{}
	c.holdingLarge(false)
	c.pool.Trim() // rendezvous destinations kept for reuse
	if climb {
		c.broadcastLocked() // a deeper ring comes next: no shrink to tell
		return
	}
	c.st.ShrinksServed++
	c.broadcastLocked()
	enlargementMarker(c.id, uint32(from), uint32(c.rx[small].size), d.Nanoseconds(), outcomeShrinkServed)
	c.shrinkTelemetryLocked(telemetry.Receiver, reason, time.Now().Add(-d), d, from, c.rx[small].size)
}
