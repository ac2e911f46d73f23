package conn

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Parking: a direction that carried nothing for WithIdleShrink in its
// small phase lends its small ring back to the receiver, which gives the
// ring's pages back to the system (an idle connection should
// cost what a TCP one does, and a TCP socket holds no buffer pages once
// its data is read). Without it every connection that ever carried an
// HTTP/2 handshake keeps both 8 KiB rings resident, and on shm each
// counts in both processes, since both map it.
//
// The receiver cannot release the pages on its own: the writer may write
// into any slot it holds a credit for, and a page released under a write
// in progress loses it. So the writer, which alone knows whether it is
// writing, parks:
//
//  1. With no write under way (it holds c.wmu), it sends a park message,
//     a zero-length one, and from then on puts nothing into that ring, no
//     data and no record, until the answer. The connection delivers in
//     order: the park lands after everything the writer put there.
//  2. The receiver, on the park, looks at the ring. If its reader has
//     consumed every slot, nothing of the writer's is there and nothing
//     can land: it releases the ring's pages and answers with a resume.
//     If the reader has not, it answers at once that it declines: a
//     writer must never wait on its peer's reader to write (the
//     application might read only after our next write), so the park
//     does not wait for the read either. Both answers are zero-length and
//     carry the credits the receiver had not returned yet (credits go
//     back in batches): zero-length messages take no ring credit, so they
//     go out even when the receiver's own direction is parked.
//  3. The writer's next write, or record, waits for the answer: one
//     round trip, once per idle period, and the pages it writes come back
//     as it writes them. Declined, it tries again an idle period later.
//
// A receiver whose memory cannot be released (verbs pins it for the
// HCA) does not offer parking in its hello, and its peer never parks. A
// park to a receiver that did not offer it, or an answer nobody asked
// for, is a protocol error.
// idPark is the work request id of park messages: not credit messages,
// whose completion lets the next credit message go.
const idPark = idCtl | 1<<8

// offersParks: our small ring's pages can go back while the connection
// idles, so the peer may park its writes into it.
func (c *rdmaConn) offersParks() bool {
	return !withholdParks.Load() && c.rx[small].buf != nil && c.rx[small].buf.CanReleasePages()
}

// withholdParks: tests set it to see a receiver that does not offer.
var withholdParks atomic.Bool

// armIdleLocked (re)arms the connection's idle timer to fire after wait:
// the shrink of a large direction and the park of a small one share it.
func (c *rdmaConn) armIdleLocked(wait time.Duration) {
	if c.enl.idleTimer == nil {
		c.enl.idleTimer = time.AfterFunc(wait, c.onIdle)
		return
	}
	c.enl.idleTimer.Reset(wait)
}

// onIdle runs on the idle timer.
func (c *rdmaConn) onIdle() {
	c.mu.Lock()
	c.parkArmed = false
	isLarge := c.enl.phase == phaseLarge
	c.mu.Unlock()
	if isLarge {
		c.shrinkIfIdle()
		return
	}
	c.parkIfIdle()
}

// armParkLocked arms the idle timer for a park of our small direction,
// once: each write calls it, and the timer, when it fires, looks at when
// the last write ended.
func (c *rdmaConn) armParkLocked() {
	if c.parkArmed || !c.peerParks || c.o.idleShrink <= 0 || c.closed {
		return
	}
	c.parkArmed = true
	c.armIdleLocked(c.o.idleShrink)
}

// parkIfIdle parks our small direction if it has been idle for
// WithIdleShrink and can be parked now, or arms the timer again.
func (c *rdmaConn) parkIfIdle() {
	if !c.wmu.TryLock() {
		c.mu.Lock()
		c.armParkLocked() // a write is under way: not idle
		c.mu.Unlock()
		return
	}
	defer c.wmu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.err != nil || c.wclosed || !c.enl.mayPark() || c.sending != small {
		return
	}
	last := time.Unix(0, c.lastWrite.Load())
	if wait := time.Until(last.Add(c.o.idleShrink)); wait > 0 {
		c.parkArmed = true
		c.armIdleLocked(wait)
		return
	}
	if c.posting || c.enl.waiting || c.pendingLocked() {
		c.armParkLocked() // a record of the reader's is being posted
		return
	}
	if err := c.postParkLocked(lenPark, 0); err != nil {
		c.failLocked(err)
		return
	}
	c.enl.parked = true
	c.st.Parks++
	// Our staging for the small ring goes too: nothing is in flight from
	// it (every small write and record completed), and only this writer
	// (c.wmu) and a record (c.mu) write into it.
	if t := &c.tx[small]; t.stage != nil && t.seq == t.done && !c.recordOut && t.stage.CanReleasePages() {
		if err := t.stage.ReleasePages(); err != nil {
			c.st.FreeSmallErrors++
		}
	}
}

// postParkLocked sends a park or an answer to one, with credits for our
// small ring.
func (c *rdmaConn) postParkLocked(n, credits int) error {
	t := &c.tx[c.sending] // zero-length: any ring of the peer's that exists
	_, err := c.qp.PostSend(transport.SendWR{
		ID: idPark, Opcode: transport.OpWriteWithImm, Signaled: true,
		RemoteAddr: t.addr, RKey: t.rkey, Imm: encodeImm(kindCredit, small, credits, n),
	})
	if err != nil {
		return fmt.Errorf("conn: post park message: %w", err)
	}
	c.ctlPending++
	c.st.MessagesOut++
	return nil
}

// parkMessageLocked handles a park or a resume from the peer (poller).
func (c *rdmaConn) parkMessageLocked(n int) error {
	switch n {
	case lenPark:
		r := &c.rx[small]
		if !c.offered {
			return fmt.Errorf("%w: park of a ring that was not offered for parking", errProtocol)
		}
		if r.buf == nil {
			// Freed once the peer enlarged (WithFreeSmallOnEnlarge): a
			// peer that parks into it does not write there either.
			return fmt.Errorf("%w: park of a small ring that is gone", errProtocol)
		}
		credits := r.takeForPark()
		if !r.drained() {
			c.st.ParksDeclined++
			return c.postParkLocked(lenDecline, credits)
		}
		// Nothing of the writer's is in the ring, and it writes nothing
		// more until the resume: the pages can go.
		if err := r.buf.ReleasePages(); err != nil {
			c.st.FreeSmallErrors++ // still resident: only memory is lost
		}
		c.st.ParksServed++
		enlargementMarker(c.id, uint32(r.size), 0, 0, outcomeParkServed)
		c.tel.Parked(telemetry.Receiver)
		return c.postParkLocked(lenResume, credits)
	case lenResume, lenDecline:
		if !c.enl.parked {
			return fmt.Errorf("%w: answer to a park that was not sent", errProtocol)
		}
		c.enl.parked = false
		if n == lenDecline {
			c.st.Parks--
			c.armParkLocked()
			return nil
		}
		enlargementMarker(c.id, uint32(c.tx[small].size), 0, 0, outcomeParked)
		c.tel.Parked(telemetry.Sender)
		return nil
	}
	return fmt.Errorf("%w: credit message of length %d", errProtocol, n)
}
