package conn

import (
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// The sending direction's phase.
const (
	phaseSmall    = iota // small buffers; enlargement may be asked for
	phaseLarge           // enlarged
	phaseRefused         // the peer could not provision: small for good
	phaseTimedOut        // no acknowledgement after the retries: small for good
	phaseLocalErr        // our own large staging could not be registered
)

var phaseNames = [...]string{"small", "large", "small (peer refused enlargement)", "small (enlargement ack timed out)", "small (local registration failed)"}

// Outcomes reported to enlargementMarker (and rdmatrace).
const (
	outcomeEnlarged = 1 + iota
	outcomeRefused
	outcomeTimedOut
	outcomeLocalErr
	outcomeServed     // receiver side: provisioned and acknowledged
	outcomeServeError // receiver side: refused
)

var outcomeNames = [...]string{"", "enlarged", "refused by peer", "ack timed out", "local registration failed", "served", "refused"}

// enlargement is the state of M3 on both sides of a connection.
type enlargement struct {
	// as sender of the data
	phase    int
	reqSeq   uint32 // of the request in flight
	waiting  bool
	ack      *record // a valid acknowledgement of reqSeq, not yet used
	refused  bool
	attempts int
	// as receiver of the data
	reqIn     uint32 // the latest request seen
	serving   bool   // the enlargement server goroutine runs
	rxRefused error
}

//go:noinline
func enlargementMarker(connID uint64, fromSize, toSize uint32, durationNanos int64, outcome uint32) {
	// An eBPF uprobe target (bpf/, rdmatrace): the arguments are what it
	// reads, so the function must exist, not inlined, with this shape.
	markerCalls.Add(1)
}

// enlarge moves the sending direction to large buffers (M3 sender side).
// It returns an error only when the write cannot go on at all (deadline,
// close, a dead connection); if enlargement cannot be had, the data goes
// through the small buffers. c.wmu is held.
func (c *Conn) enlarge() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.enl.phase != phaseSmall {
		return nil
	}
	start := time.Now()
	from := uint32(c.tx[small].size)
	c.enl.waiting = true
	defer func() { c.enl.waiting = false }()
	for attempt := 0; attempt <= c.o.ackRetries && c.enl.ack == nil && !c.enl.refused; attempt++ {
		c.enl.reqSeq++
		c.enl.attempts++
		req := record{typ: recRequest, seq: c.enl.reqSeq, size: uint32(c.o.largeSize), count: uint32(c.o.largeCount)}
		if err := c.sendRecordLocked(req, c.wdl, true); err != nil {
			return err
		}
		timeout := time.Now().Add(c.o.ackTimeout)
		for c.enl.ack == nil && !c.enl.refused && time.Now().Before(timeout) {
			if err := c.writeErrLocked(); err != nil {
				return err
			}
			dl := timeout
			if !c.wdl.IsZero() && c.wdl.Before(dl) {
				dl = c.wdl
			}
			c.waitLocked(dl)
		}
		if err := c.writeErrLocked(); err != nil {
			return err
		}
	}
	switch {
	case c.enl.ack != nil:
		ack := *c.enl.ack
		c.enl.ack = nil
		// M4: provision our large send buffers, then switch.
		c.mu.Unlock()
		stage, err := c.pool.Get(bufpool.Owner(c.id), c.o.largeSize*c.o.largeCount, transport.AccessLocalWrite)
		c.mu.Lock()
		if err != nil {
			c.finishEnlargeLocked(phaseLocalErr, outcomeLocalErr, from, 0, start)
			return nil
		}
		c.tx[large] = txRing{addr: ack.addr, rkey: ack.rkey, size: int(ack.size), count: int(ack.count), credits: int(ack.count),
			stage: stage, stageSize: c.o.largeSize, stageSlots: c.o.largeCount}
		c.sending = large
		c.finishEnlargeLocked(phaseLarge, outcomeEnlarged, from, ack.size, start)
	case c.enl.refused:
		c.finishEnlargeLocked(phaseRefused, outcomeRefused, from, 0, start)
	default:
		c.finishEnlargeLocked(phaseTimedOut, outcomeTimedOut, from, 0, start)
	}
	return nil
}

func (c *Conn) finishEnlargeLocked(phase, outcome int, from, to uint32, start time.Time) {
	d := time.Since(start)
	c.enl.phase = phase
	if outcome == outcomeEnlarged {
		c.st.Enlargements++
	} else {
		c.st.EnlargeFailures++
	}
	c.st.LastEnlargeFrom, c.st.LastEnlargeTo = int(from), int(to)
	c.st.LastEnlargeDuration = d
	c.st.LastEnlargeOutcome = outcomeNames[outcome]
	c.broadcastLocked()
	enlargementMarker(c.id, from, to, d.Nanoseconds(), uint32(outcome))
}

// sendRecordLocked writes a control record into the peer's small ring,
// using the staging slot and the credit kept for control records.
// asWriter: a write deadline and CloseWrite apply.
func (c *Conn) sendRecordLocked(r record, deadline time.Time, asWriter bool) error {
	t := &c.tx[small]
	for c.recordOut || t.credits < 1 {
		switch {
		case c.closed:
			return net.ErrClosed
		case c.err != nil:
			return c.err
		case asWriter && expired(deadline):
			return os.ErrDeadlineExceeded
		}
		c.waitLocked(deadline)
	}
	off := (t.stageSlots) * t.stageSize
	buf := r.encode(t.stage.Bytes()[off:])
	slot := t.msgs % uint64(t.count)
	cring, credits := c.takeCreditsLocked()
	_, err := c.qp.PostSend(transport.SendWR{
		ID: idRecord, Opcode: transport.OpWriteWithImm, Signaled: true,
		SG:         []transport.SGE{{Addr: t.stage.Addr() + uint64(off), Length: uint32(len(buf)), LKey: t.stage.LKey()}},
		RemoteAddr: t.addr + slot*uint64(t.size), RKey: t.rkey, Imm: encodeImm(kindControl, cring, credits, len(buf)),
	})
	if err != nil {
		err = fmt.Errorf("conn: post control record: %w", err)
		c.failLocked(err)
		return err
	}
	t.msgs++
	t.credits--
	c.recordOut = true
	c.st.MessagesOut++
	return nil
}

// recordLocked handles a control record from the peer (poller).
func (c *Conn) recordLocked(r record) {
	switch r.typ {
	case recRequest:
		c.enl.reqIn = r.seq
		if !c.enl.serving {
			c.enl.serving = true
			c.wg.Add(1)
			go c.serveEnlarge()
		}
	case recAck, recRefuse:
		if !c.enl.waiting || r.seq != c.enl.reqSeq {
			c.st.StaleRecords++ // an answer to a request we gave up on
			return
		}
		if r.typ == recAck {
			c.enl.ack = &r
		} else {
			c.enl.refused = true
		}
	}
}

// serveEnlarge is the receiver side of M3, off the completion loop so
// small traffic keeps flowing: it provisions large buffers for this
// connection only and acknowledges with their address and key, or
// refuses. Later requests (a retry after a lost ack) are answered with
// the same buffers. Owned by the Conn; exits on Close.
func (c *Conn) serveEnlarge() {
	defer c.wg.Done()
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		seq := c.enl.reqIn
		rx := &c.rx[large]
		if rx.buf == nil && c.enl.rxRefused == nil {
			start := time.Now()
			c.mu.Unlock()
			buf, err := c.pool.Get(bufpool.Owner(c.id), c.o.largeSize*c.o.largeCount, transport.AccessLocalWrite|transport.AccessRemoteWrite)
			c.mu.Lock()
			if c.closed {
				if buf != nil {
					buf.Release()
				}
				c.enl.serving = false
				return
			}
			outcome := outcomeServed
			if err != nil {
				c.enl.rxRefused = err
				outcome = outcomeServeError
				c.st.EnlargeRefusals++
			} else {
				*rx = rxRing{buf: buf, size: c.o.largeSize, count: c.o.largeCount}
				c.st.EnlargementsServed++
			}
			enlargementMarker(c.id, uint32(c.rx[small].size), uint32(c.o.largeSize), time.Since(start).Nanoseconds(), uint32(outcome))
		}
		answer := record{typ: recRefuse, seq: seq}
		if rx.buf != nil {
			answer = record{typ: recAck, seq: seq, addr: rx.buf.Addr(), rkey: rx.buf.RKey(), size: uint32(rx.size), count: uint32(rx.count)}
		}
		if err := c.sendRecordLocked(answer, time.Time{}, false); err != nil {
			c.enl.serving = false
			return
		}
		if c.enl.reqIn == seq {
			c.enl.serving = false
			return
		}
	}
}

var markerCalls atomic.Uint64
