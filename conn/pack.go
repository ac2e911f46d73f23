package conn

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Packing. A ring carries one message per slot, whatever its length, so
// a writer of small messages into a ring with no credit left would wait
// for the reader's credits after every few of them: over verbs in the rxe
// guest, 20,000 writes of 64 B made 9,600 credit stalls, a round trip of
// wake-ups each. Instead, a small write that finds no credit is copied
// into the connection's pending message and returns, as a socket's write
// returns once its bytes are in the send buffer; the writes that follow
// go into the same message until it is full, and the message goes out as
// one, in one slot, as soon as a credit comes (the poller posts it, or the
// next write). rsockets packs its writes into a byte ring for the same
// reason. The stream is unchanged for the reader: a message is bytes of
// the stream.
//
// Order: everything that puts stream bytes, or what stands for them, into
// the peer's rings after a pending message waits until it went out (a
// write too large to pack, a rendezvous advert, an enlargement, a climb,
// a shrink, a park); the end of the stream is posted right behind it.

// packShare: the largest write that packs is this fraction of the
// pending message's room. A larger one gains little from sharing a slot,
// and leaves room for only a few more.
const packShare = 4

// pendMax bounds a pending message, whatever the ring's slot size: the
// poller copies it into staging under the connection's lock.
const pendMax = 4 << 10

// pending is a message being packed: bytes written, not yet posted, for
// the ring the connection sends into.
type pending struct {
	buf []byte
	// CloseWrite or Close came meanwhile: the end of the stream, and
	// Close's message that we read no more (which ends it too), follow.
	eof, close bool
}

var pendPool = sync.Pool{New: func() any { return &pending{buf: make([]byte, 0, pendMax)} }}

// packedWrites counts the writes that went into a pending message (tests).
var packedWrites atomic.Uint64

// pendingLocked reports whether a message waits to be posted.
func (c *rdmaConn) pendingLocked() bool { return c.pend != nil && len(c.pend.buf) > 0 }

// packLocked takes b into the pending message, starting one, if b is
// small enough for the ring t and the message has room, and reports
// whether it did. The caller found no credit, or a message pending.
func (c *rdmaConn) packLocked(t *txRing, b []byte) bool {
	room := min(t.size, pendMax)
	if t.stage != nil {
		room = min(room, t.stageSize)
	}
	if len(b) > room/packShare || c.enl.parked || c.wclosed {
		return false
	}
	if c.pend == nil {
		c.pend = pendPool.Get().(*pending)
	}
	p := c.pend
	if len(p.buf)+len(b) > room {
		return false
	}
	p.buf = append(p.buf, b...)
	packedWrites.Add(1)
	c.st.BytesOut += uint64(len(b))
	return true
}

// flushPendLocked posts the pending message if the ring has a credit and
// staging room for it, and reports whether a kick came meanwhile (the
// caller owes the queue a poll, as after postSend). c.mu is held; no
// writer is between its reservation and its post (one that finds a
// message pending posts it first, or packs behind it).
func (c *rdmaConn) flushPendLocked() (kicked bool) {
	if !c.pendingLocked() || c.posting || c.err != nil || c.enl.parked {
		return false
	}
	p := c.pend
	t := &c.tx[c.sending]
	if !t.canSendData() || t.seq-t.done >= uint64(t.stageSlots) {
		return false
	}
	ring := int(c.sending)
	seq := t.seq
	t.seq++
	t.use()
	wr, k := t.dataWR(ring, seq, p.buf)
	if k != len(p.buf) { // packLocked kept it within a slot and its staging
		c.failLocked(fmt.Errorf("conn: a pending message of %d bytes, a message takes %d", len(p.buf), k))
		return false
	}
	kicked, err := c.postDataLocked(t, ring, seq, k, wr)
	p.buf = p.buf[:0]
	if err != nil {
		c.failLocked(fmt.Errorf("conn: post packed writes: %w", err))
		return kicked
	}
	eof, closing := p.eof, p.close
	p.eof, p.close = false, false
	// Back to the pool: a connection that packed once keeps no 4 KiB.
	c.pend = nil
	pendPool.Put(p)
	if eof {
		if err := c.postCtlLocked(kindEOF, small, 0); err != nil {
			c.failLocked(err)
		}
	}
	if closing {
		c.sendCloseLocked()
	}
	c.broadcastLocked()
	return kicked
}

// flushPendPollLocked is flushPendLocked for a goroutine that may let go
// of c.mu: a kick during the post is polled at once (pollNow).
func (c *rdmaConn) flushPendPollLocked() {
	if c.flushPendLocked() {
		c.mu.Unlock()
		c.pollNow()
		c.mu.Lock()
	}
}

// awaitPendLocked waits until no message is pending, posting it as soon
// as it can: what the caller posts next must come after it.
func (c *rdmaConn) awaitPendLocked() error {
	for c.pendingLocked() {
		ch := c.changed
		if err := c.writeErrLocked(); err != nil {
			return err
		}
		c.flushPendPollLocked()
		if c.pendingLocked() {
			c.creditWait = true
			c.waitLocked(ch, c.wdl)
		}
	}
	return nil
}
