package conn

import (
	"errors"
	"fmt"
	"net"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// What the completion loop does with each completion: the account of
// our own posts, and every message of the peer's checked against what
// this connection granted it (doc/protocol.md, section 4).

// abortLocked fails the connection and tells the peer at once, as a TCP
// reset would: its reads and writes fail now rather than at its next
// time-out.
func (c *rdmaConn) abortLocked(err error) {
	c.failLocked(err)
	if !c.aborted {
		c.aborted = true
		c.qp.SetError()
		c.qp.Disconnect()
	}
}

func (c *rdmaConn) fail(err error) {
	c.mu.Lock()
	c.failLocked(err)
	c.mu.Unlock()
}

var errProtocol = errors.New("conn: peer broke the protocol")

// handle takes wcs into account and reports whether the connection is
// still open and sound, and whether a goroutine will come back for more:
// a writer waited for credits (the broadcast woke it), or data waits to
// be read. Not any goroutine that slept on the connection: a reader woken
// by control messages alone (an idle connection's park) would poll in
// the loop's place for nothing, and serve the next control message on
// its own stack, which then stayed 8 KiB (4 KiB more per idle server
// end of grpc-go, whose reader sleeps with more than a quarter of 4 KiB
// in use).
//
// owed: a pending message went out (pack.go) and a kick came during its
// post; the caller polls again before it lets the queue sleep, or, if it
// gives up the role, has it polled (pollNow).
func (c *rdmaConn) handle(wcs []transport.WorkCompletion) (open, waiter, owed bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	waiter = c.creditWait
	defer c.broadcastLocked()
	for i := range wcs {
		wc := &wcs[i]
		if wc.Status != transport.StatusSuccess {
			if c.closed {
				// Closing: the peer is gone or our teardown flushes;
				// either way nothing more will complete, so end the drain.
				c.failLocked(net.ErrClosed)
				continue
			}
			// Only the first error is kept: every posted receive flushes
			// at a close, and formatting each was a fifth of the CPU of a
			// dial-and-close loop.
			if c.eofIn && wc.Status == transport.StatusWRFlushErr {
				if c.err == nil {
					c.failLocked(fmt.Errorf("conn: peer %v closed the connection", c.qp.RemoteAddr()))
				}
				continue
			}
			err := c.err
			if err == nil {
				err = fmt.Errorf("conn: connection to %v lost: %w", c.qp.RemoteAddr(), wc.Err())
			}
			c.abortLocked(err)
			continue
		}
		switch {
		case wc.Opcode == transport.WCRecvRDMAWithImm:
			if err := c.receivedLocked(wc.Imm); err != nil {
				c.abortLocked(err)
				continue
			}
			if err := c.repostLocked(); err != nil && !c.closed {
				c.failLocked(fmt.Errorf("conn: repost receive: %w", err))
			}
		case wc.Opcode != transport.WCRDMAWrite:
			c.failLocked(fmt.Errorf("%w: unexpected completion %v", errProtocol, wc.Opcode))
		case wc.ID&idCtl != 0:
			c.ctlPending--
			if wc.ID&^idCtl == kindCredit {
				c.creditOut = false
				c.returnCreditsLocked()
			}
		case wc.ID&idRecord != 0:
			c.recordOut = false
		case wc.ID&idRdv != 0:
			if err := c.servedLocked(); err != nil {
				c.failLocked(err)
			}
		default:
			// Send queues complete in order: this message's completion
			// confirms the unsignalled ones posted before it (write).
			t := &c.tx[wc.ID>>idRing&1]
			t.done = max(t.done, wc.ID&(1<<idRing-1)+1)
		}
	}
	// Credits or staging may have come for a pending message (pack.go).
	owed = c.flushPendLocked()
	// A peer that closed sends nothing more: what completes now is this
	// side's own teardown, not worth a spin.
	return !c.closed && c.err == nil && !c.rdv.peerClosed, waiter || len(c.recvQ) > 0, owed
}

// receivedLocked accounts one incoming message; everything in its
// immediate is checked against what this connection granted.
func (c *rdmaConn) receivedLocked(imm uint32) error {
	kind, ring, credits, n := decodeImm(imm)
	if t := &c.tx[ring]; credits > 0 && !(ring == large && c.enl.shrunk) && !t.returned(credits, t.count) {
		return fmt.Errorf("%w: %d credits for a ring of %d slots", errProtocol, t.credits, t.count)
	}
	c.st.MessagesIn++
	switch kind {
	case kindSmall, kindLarge:
		r := &c.rx[kind-kindSmall]
		if r.buf == nil || n == 0 || n > r.size || c.eofIn {
			return fmt.Errorf("%w: data message of %d bytes into ring %d", errProtocol, n, kind)
		}
		if r.retiring {
			return fmt.Errorf("%w: data message into the large ring after the writer shrank away from it", errProtocol)
		}
		slot, ok := r.land()
		if !ok {
			return fmt.Errorf("%w: data message beyond the credits of ring %d (%d slots)", errProtocol, kind, r.count)
		}
		// A writer keeps its last credit for control records (write),
		// so that a reader waiting at a rendezvous message can always
		// ask for it: data that leaves the writer no credit, counting
		// every credit we sent back, broke that rule. Spilling relies on
		// it (spillLocked).
		if r.tookReserve() {
			return fmt.Errorf("%w: data message into the last credit of ring %d, kept for control records", errProtocol, kind)
		}
		if c.discarding {
			// Closed: nobody reads it; the slot goes back at once.
			r.consumeNow(slot)
			c.returnCreditsLocked()
			return nil
		}
		c.recvQ = append(c.recvQ, entry{ring: uint8(kind - kindSmall), slot: int32(slot), n: int32(n)})
		if kind == kindLarge {
			c.maybeFreeSmallLocked()
		}
		if kind == kindSmall {
			c.st.SmallDataIn++
		} else {
			c.st.LargeDataIn++
		}
	case kindControl, kindRecordL:
		ring := small
		if kind == kindRecordL {
			ring = large
		}
		r := &c.rx[ring]
		if n != recordLen || r.buf == nil {
			return fmt.Errorf("%w: control record of %d bytes into ring %d", errProtocol, n, ring)
		}
		if r.retiring {
			return fmt.Errorf("%w: control record into the large ring after the writer shrank away from it", errProtocol)
		}
		slot, ok := r.land()
		if !ok {
			return fmt.Errorf("%w: control record beyond the credits of ring %d", errProtocol, ring)
		}
		rec, err := decodeRecord(r.buf.Bytes()[slot*r.size : slot*r.size+n])
		r.consume(slot) // read at once
		r.urgent = true // the writer keeps a credit for records: give it back
		c.returnCreditsLocked()
		if ring == large {
			c.maybeFreeSmallLocked()
		}
		if errors.Is(err, errTornRecord) {
			// A torn or corrupt record counts as not received; the
			// writer's time-out and retry recover from it.
			c.st.BadRecords++
			return nil
		}
		if err != nil {
			// Well framed, checksum right, content invalid: sent so.
			return fmt.Errorf("%w: %w", errProtocol, err)
		}
		if rec.typ == recShrink {
			// The last message into our large ring: it must be there.
			if ring != large {
				return fmt.Errorf("%w: shrink record in the small ring", errProtocol)
			}
			if err := c.retireLargeLocked(rec.addr == shrinkClimb); err != nil {
				return fmt.Errorf("%w: %w", errProtocol, err)
			}
			return nil
		}
		return c.recordLocked(rec)
	case kindReadEnd:
		return c.readEndLocked(n)
	case kindCredit:
		if n != 0 {
			return c.parkMessageLocked(n)
		}
	case kindEOF:
		c.eofIn = true
	case kindClose:
		c.eofIn = true
		c.rdv.peerClosed = true
	default:
		return fmt.Errorf("%w: message kind %d", errProtocol, kind)
	}
	return nil
}
