package conn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Read reads from the ring slots and rendezvous messages in arrival order.
func (c *rdmaConn) Read(b []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	return c.readRLocked(b)
}

// readRLocked is Read, c.rmu held.
func (c *rdmaConn) readRLocked(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		ch := c.changed
		switch {
		case c.closed:
			return 0, c.opErr("read", net.ErrClosed)
		case expired(c.rdl):
			return 0, c.opErr("read", os.ErrDeadlineExceeded)
		case len(c.recvQ) > 0 && len(b) == 0:
			return 0, nil
		case len(c.recvQ) > 0 && c.recvQ[0].ring == rdvRing:
			if n, err, done := c.readRendezvousLocked(b); done {
				return n, err
			}
			if c.err != nil {
				return 0, c.opErr("read", c.err)
			}
		case len(c.recvQ) > 0:
			return c.readRingLocked(b), nil
		case c.eofIn:
			return 0, io.EOF
		case c.err != nil:
			return 0, c.opErr("read", c.err)
		case len(b) == 0:
			return 0, nil
		}
		c.waitLocked(ch, c.rdl)
	}
}

// readRingLocked copies from the ring slot at the head of the stream, or
// from the copy spillLocked made of it.
func (c *rdmaConn) readRingLocked(b []byte) int {
	e := c.recvQ[0]
	r := &c.rx[e.ring]
	src := e.spill
	if src == nil {
		off := int(e.slot) * r.size
		src = r.buf.Bytes()[off : off+int(e.n)]
	}
	src = src[c.readOff:]
	c.mu.Unlock()
	k := copy(b, src) // the slot stays ours until its credit goes back
	c.mu.Lock()
	c.readOff += k
	c.st.BytesIn += uint64(k)
	if c.readOff == int(e.n) {
		c.recvQ = c.recvQ[1:]
		c.readOff = 0
		if e.spill != nil {
			c.spilled -= len(e.spill)
		} else { // a spilled slot went back already
			r.consume(int(e.slot))
			c.returnCreditsLocked()
			c.ringsConsumedLocked()
		}
	}
	return k
}

func (c *rdmaConn) postCtlLocked(kind, ring, credits int) error {
	t := &c.tx[c.sending] // zero-length: any ring of the peer's that exists
	_, err := c.qp.PostSend(transport.SendWR{
		ID: idCtl | uint64(kind), Opcode: transport.OpWriteWithImm, Signaled: true,
		RemoteAddr: t.addr, RKey: t.rkey, Imm: encodeImm(kind, ring, credits, 0),
	})
	if err != nil {
		return fmt.Errorf("conn: post control message: %w", err)
	}
	c.ctlPending++
	c.st.MessagesOut++
	return nil
}

// Write writes b. Above the threshold it first enlarges this direction
// (an enlargement request and its acknowledgement): the call blocks until the peer's acknowledgement, a refusal,
// or the acknowledgement time-out, honouring the write deadline.
func (c *rdmaConn) Write(b []byte) (int, error) {
	if c.isClosed() {
		return 0, c.opErr("write", net.ErrClosed)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	defer c.noteWrite()
	return c.writeElem(b)
}

// writeElem sends one buffer the way its size asks for: by rendezvous
// above the rendezvous threshold, through the large ring above the
// threshold (enlarging first), else through the ring of the current phase.
func (c *rdmaConn) writeElem(b []byte) (int, error) {
	c.mu.Lock()
	err := c.awaitOpenLocked(context.Background(), c.wdl)
	if err == nil {
		err = c.writeErrLocked()
	}
	stalling := c.enl.stalling() // the ladder (climb)
	if err == nil && c.pendingLocked() && (stalling || len(b) > c.o.threshold || c.o.rdvThreshold > 0 && len(b) > c.o.rdvThreshold) {
		// What follows may enlarge or climb, or go by rendezvous: after
		// the pending message (pack.go).
		err = c.awaitPendLocked()
	}
	c.mu.Unlock()
	if err != nil {
		return 0, c.opErr("write", err)
	}
	if c.o.rdvThreshold > 0 && len(b) > c.o.rdvThreshold {
		return c.writeRendezvous(b)
	}
	climbed := false
	if stalling {
		if climbed, err = c.climb(); err != nil {
			return 0, c.opErr("write", err)
		}
	}
	if climbed || len(b) > c.o.threshold {
		if err := c.enlarge(); err != nil {
			return 0, c.opErr("write", err)
		}
	}
	return c.write(b)
}

// write copies b into staging slots and writes it into the peer's ring of
// the current phase, a slot per message, waiting for credits when that
// ring is full. c.wmu is held.
func (c *rdmaConn) write(b []byte) (int, error) {
	n := 0
	for {
		c.mu.Lock()
		var stalled time.Time
		var t *txRing
		for {
			ch := c.changed
			// Every byte posted: the write succeeded, as a socket's does
			// once its bytes are in the send buffer. A peer that read
			// them and closed at once must not turn it into a failure.
			if len(b) == 0 {
				c.mu.Unlock()
				return n, nil
			}
			if err := c.writeErrLocked(); err != nil {
				if !stalled.IsZero() {
					c.stalled(time.Since(stalled))
				}
				c.mu.Unlock()
				return n, c.opErr("write", err)
			}
			t = &c.tx[c.sending]
			if c.enl.parked { // the answer to our park: a round trip, not a stall
				c.waitLocked(ch, c.wdl)
				continue
			}
			if c.pendingLocked() {
				// Behind a pending message (pack.go): post it first, or
				// pack behind it, or wait until it went.
				c.flushPendPollLocked()
				if c.pendingLocked() {
					if c.packLocked(t, b) {
						c.mu.Unlock()
						return n + len(b), nil
					}
					c.creditWait = true
					c.waitLocked(ch, c.wdl)
				}
				continue
			}
			if t.canSendData() && t.seq-t.done < uint64(t.stageSlots) {
				break
			}
			if !t.canSendData() && c.packLocked(t, b) {
				if !stalled.IsZero() {
					c.stalled(time.Since(stalled))
				}
				c.mu.Unlock()
				return n + len(b), nil
			}
			// A wait for staging is for our own completions (signal.go),
			// not a stall on the peer's reader: only credits count.
			if stalled.IsZero() && !t.canSendData() {
				stalled = time.Now()
				c.st.CreditStalls++
				if c.sending == large {
					c.enl.stall(stalled) // the ladder's signal (climb)
				}
				c.tel.CreditStall()
			}
			c.creditWait = true
			c.waitLocked(ch, c.wdl)
		}
		if !stalled.IsZero() {
			c.stalled(time.Since(stalled))
		}
		ring := int(c.sending)
		seq := t.seq
		t.seq++
		t.use()
		c.posting = true
		c.mu.Unlock()

		// The copy runs unlocked: the staging slot is this writer's alone
		// (c.wmu). The peer's slot is taken only now, with the post, under
		// c.mu: the peer assigns slots in arrival order, so a control
		// record posted in between (a reader's read request) must not
		// take a later slot yet arrive first, or each would be read from
		// the other's slot.
		wr, k := t.dataWR(ring, seq, b)
		c.mu.Lock()
		kicked, err := c.postDataLocked(t, ring, seq, k, wr)
		c.posting = false
		if c.recordWaits {
			c.recordWaits = false
			c.broadcastLocked()
		}
		if err != nil {
			c.failLocked(fmt.Errorf("conn: post write: %w", err))
			c.mu.Unlock()
			if kicked {
				c.pollNow()
			}
			return n, c.opErr("write", c.err)
		}
		c.st.BytesOut += uint64(k)
		c.mu.Unlock()
		if kicked {
			c.pollNow()
		}
		n += k
		b = b[k:]
	}
}

// dataWR is the work request of data message seq, carrying as much of b
// as one message takes (k bytes): inline, the provider copying from b at
// the post, or copied into the message's staging slot now.
func (t *txRing) dataWR(ring int, seq uint64, b []byte) (wr transport.SendWR, k int) {
	wr = transport.SendWR{ID: uint64(ring)<<idRing | seq, Opcode: transport.OpWriteWithImm}
	if t.stage == nil {
		k = min(len(b), t.size)
		wr.Inline, wr.Data = true, b[:k]
		return wr, k
	}
	k = min(len(b), t.size, t.stageSize)
	off := int(seq%uint64(t.stageSlots)) * t.stageSize
	copy(t.stage.Bytes()[off:], b[:k])
	wr.SG = []transport.SGE{{Addr: t.stage.Addr() + uint64(off), Length: uint32(k), LKey: t.stage.LKey()}}
	return wr, k
}

// postDataLocked posts data message seq of k bytes, wr, into the peer's
// ring: it takes the peer's next slot (the peer assigns slots in arrival
// order), the credits to return, and the signalling (signal.go).
func (c *rdmaConn) postDataLocked(t *txRing, ring int, seq uint64, k int, wr transport.SendWR) (kicked bool, err error) {
	slot := t.msgs % uint64(t.count)
	t.msgs++
	cring, credits := c.takeCreditsLocked()
	wr.RemoteAddr, wr.RKey, wr.Imm = t.addr+slot*uint64(t.size), t.rkey, encodeImm(kindSmall+ring, cring, credits, k)
	wr.Signaled = ring == small || t.stage == nil || t.mustSignal(seq)
	if wr.Signaled {
		t.signaled = seq + 1
	} else {
		unsignaledPosts.Add(1)
	}
	kicked, err = c.postSend(wr)
	if err != nil {
		return kicked, err
	}
	c.st.MessagesOut++
	if ring == small && !c.parkArmed {
		c.armParkLocked()
	}
	return kicked, nil
}

// WriteBuffers is the vectored write, checked element
// by element: elements at or below the threshold go as they are; at the
// first element above it the connection is enlarged, so a small prefix
// goes through the small buffers and the rest, from the large element on,
// after the enlargement. Elements above the rendezvous threshold go by
// rendezvous.
func (c *rdmaConn) WriteBuffers(v net.Buffers) (int64, error) {
	if c.isClosed() {
		return 0, c.opErr("write", net.ErrClosed)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	defer c.noteWrite()
	var n int64
	for _, b := range v {
		k, err := c.writeElem(b)
		n += int64(k)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func (c *rdmaConn) writeErrLocked() error {
	switch {
	case c.closed:
		return net.ErrClosed
	case c.wclosed:
		return errors.New("conn: write after CloseWrite")
	case expired(c.wdl):
		return os.ErrDeadlineExceeded
	case c.err != nil:
		return c.err
	}
	return nil
}
