package conn

import (
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// The sending direction's phase.
const (
	phaseSmall    = iota // small buffers; enlargement may be asked for
	phaseLarge           // enlarged
	phaseRefused         // the peer could not provision: small until the back-off ends
	phaseTimedOut        // no acknowledgement after the retries: likewise
	phaseLocalErr        // our own large staging could not be registered: likewise
)

// A failed enlargement is asked for again by the first large write after
// a back-off that doubles from enlargeBackoffMin to enlargeBackoffMax
// with each failure in a row: a budget short for a moment, or a peer
// slow to answer, does not leave a connection small for its whole life.
const (
	enlargeBackoffMin = time.Second
	enlargeBackoffMax = time.Minute
)

var phaseNames = [...]string{"small", "large", "small (peer refused enlargement; asks again after a back-off)", "small (enlargement ack timed out; asks again after a back-off)", "small (local registration failed; asks again after a back-off)"}

// Outcomes reported to enlargementMarker (and rdmatrace).
const (
	outcomeEnlarged = 1 + iota
	outcomeRefused
	outcomeTimedOut
	outcomeLocalErr
	outcomeServed     // receiver side: provisioned and acknowledged
	outcomeServeError // receiver side: refused
	// Connection events travel on the same marker, so that the one probe
	// rdmatrace attaches sees them (bpf.KindConnection; codes mirrored
	// there): a connection opened over RDMA or TCP, and closed.
	outcomeOpenedRDMA
	outcomeOpenedTCP
	outcomeClosed
	// Shrinks (shrink.go): our direction back to small; the peer's large
	// ring dropped here.
	outcomeShrunk
	outcomeShrinkServed
	// Parks (park.go): our small direction parked, the peer having
	// released its ring's pages; the peer's parked, our ring released.
	outcomeParked
	outcomeParkServed
)

var outcomeNames = [...]string{"", "enlarged", "refused by peer", "ack timed out", "local registration failed", "served", "refused",
	"opened over RDMA", "opened over TCP", "closed", "shrunk", "shrink served", "parked", "park served"}

// enlargement is the state of the enlargement protocol on both sides of a connection.
type enlargement struct {
	// as sender of the data
	sendPhase         // the state machine (phase.go)
	reqSeq    uint32  // of the request in flight
	ack       *record // a valid acknowledgement of reqSeq, not yet used
	refused   bool
	attempts  int
	tel       *telemetry.Enlargement // the sender's, until it ends
	localErr  error                  // why our large staging failed
	// Shrinking (shrink.go): the peer keeps its small ring once enlarged
	// (its ack says so), so we may go back to it; lastLarge is when data
	// last went into the large ring; idleTimer is armed for the shrink
	// while the direction is large, and for a park (park.go) while it is
	// small.
	peerKeepsSmall bool
	lastLarge      time.Time
	idleTimer      *time.Timer
	pressure       bool      // the peer asked us to shrink (pressure.go)
	pressureUntil  time.Time // when that ask lapses
	// The ladder (WithBufferPhases): level is the large phase asked for
	// next, and held once enlarged (0: the first); capped: the peer gave
	// less than asked, so climbing further is no use.
	level  int
	capped bool
	// as receiver of the data
	recvPhase // the state machine (phase.go)
	// peerTakesAsks: the peer's request said it shrinks when asked
	// (pressure.go); reqSize, reqCount: the ring its request asked for.
	peerTakesAsks     bool
	reqSize, reqCount int
}

//go:noinline
func enlargementMarker(connID uint64, fromSize, toSize uint32, durationNanos int64, outcome uint32) {
	// An eBPF uprobe target (bpf/, rdmatrace): the arguments are what it
	// reads, so the function must exist, not inlined, with this shape.
	markerCalls.Add(1)
}

// enlarge moves the sending direction to large buffers (the sender's
// side of the enlargement protocol).
// It returns an error only when the write cannot go on at all (deadline,
// close, a dead connection); if enlargement cannot be had, the data goes
// through the small buffers. c.wmu is held.
func (c *rdmaConn) enlarge() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.enl.phase != phaseSmall {
		if !c.enl.retry() {
			return nil
		}
		// The back-off of a failed enlargement is over: ask again.
		c.enl.refused, c.enl.localErr = false, nil
	}
	start := time.Now()
	from := uint32(c.tx[small].size)
	c.enl.waiting = true
	defer func() { c.enl.waiting = false }()
	want := c.o.largePhases()[c.enl.level]
	c.enl.tel = c.tel.StartEnlargement(telemetry.Sender, start, int(from), want.Size, want.Count)
	if c.rpcsInFlight() {
		c.enl.tel.Link(c.rpcLinks())
	}
	defer c.abortEnlargeTelemetryLocked()
	for attempt := 0; attempt <= c.o.ackRetries && c.enl.ack == nil && !c.enl.refused; attempt++ {
		c.enl.reqSeq++
		c.enl.attempts++
		req := record{typ: recRequest, seq: c.enl.reqSeq, size: uint32(want.Size), count: uint32(want.Count), addr2: reqTakesShrinkAsks}
		if err := c.sendRecordLocked(req, c.wdl, true); err != nil {
			return err
		}
		c.enl.tel.Requested(attempt + 1)
		timeout := time.Now().Add(c.o.ackTimeout)
		for c.enl.ack == nil && !c.enl.refused && time.Now().Before(timeout) {
			ch := c.changed
			if err := c.writeErrLocked(); err != nil {
				return err
			}
			dl := timeout
			if !c.wdl.IsZero() && c.wdl.Before(dl) {
				dl = c.wdl
			}
			c.waitLocked(ch, dl)
		}
		if err := c.writeErrLocked(); err != nil {
			return err
		}
	}
	switch {
	case c.enl.ack != nil:
		ack := *c.enl.ack
		c.enl.ack = nil
		c.enl.tel.Answered(true)
		// Provision our large send buffers, then switch. A provider
		// that sends inline from the caller's memory (shm) needs none:
		// its inline copy is the copy into the send buffer.
		// Staging of what we asked for at most: the peer's ack sizes its
		// own ring, never our memory.
		t := txRing{addr: ack.addr, rkey: ack.rkey, size: int(ack.size), count: int(ack.count),
			stageSize: min(int(ack.size), want.Size), stageSlots: min(int(ack.count), want.Count)}
		t.grant(t.count)
		if c.enl.capped = int(ack.size)*int(ack.count) < want.Size*want.Count; c.enl.capped {
			// Stats: the phase we got, not the one we asked for.
			c.enl.level = c.o.levelFor(int(ack.size) * int(ack.count))
		}
		c.enl.stallsCounted()
		if int(c.inlineMax) < t.size {
			c.mu.Unlock()
			regStart := time.Now()
			stage, err := c.pool.Get(bufpool.Owner(c.id), t.stageSize*t.stageSlots, transport.AccessLocalWrite)
			c.enl.tel.Registration(time.Since(regStart))
			c.mu.Lock()
			if err != nil {
				c.enl.localErr = err
				c.finishEnlargeLocked(phaseLocalErr, outcomeLocalErr, from, 0, start)
				return nil
			}
			t.stage = stage
		} else {
			t.stageSlots = t.count // bounds nothing: credits do
		}
		c.tx[large] = t
		c.sending = large
		c.enl.peerKeepsSmall = ack.addr2 == ackKeepsSmall
		c.finishEnlargeLocked(phaseLarge, outcomeEnlarged, from, ack.size, start)
		c.enl.lastLarge = time.Now()
		c.armShrinkLocked()
	case c.enl.refused:
		c.enl.tel.Answered(false)
		c.finishEnlargeLocked(phaseRefused, outcomeRefused, from, 0, start)
	default:
		c.finishEnlargeLocked(phaseTimedOut, outcomeTimedOut, from, 0, start)
	}
	return nil
}

func (c *rdmaConn) finishEnlargeLocked(phase, outcome int, from, to uint32, start time.Time) {
	d := time.Since(start)
	if outcome == outcomeEnlarged {
		c.st.Enlargements++
		c.enl.enlarged()
	} else {
		c.st.EnlargeFailures++
		c.enl.failed(phase, time.Now())
	}
	c.st.LastEnlargeFrom, c.st.LastEnlargeTo = int(from), int(to)
	c.st.LastEnlargeDuration = d
	c.st.LastEnlargeOutcome = outcomeNames[outcome]
	c.broadcastLocked()
	enlargementMarker(c.id, from, to, d.Nanoseconds(), uint32(outcome))
	if c.rpcsInFlight() {
		c.rpcEvent(telemetry.EventRPCEnlargement, start.Add(d), c.enl.tel.SpanContext(),
			telemetry.KeySide.String(telemetry.Sender), telemetry.KeyOutcome.String(string(telemetryOutcomes[outcome])),
			telemetry.KeyEnlargeDuration.Float64(d.Seconds()), telemetry.KeyFromSize.Int(int(from)), telemetry.KeyToSize.Int(int(to)))
	}
	c.endEnlargeTelemetryLocked(outcome)
}

// sendRecordLocked writes a control record into the peer's ring of the
// current phase (its small ring may be gone once enlarged), from the last
// small staging slot, with the credit data leaves for records.
// bounded: deadline applies (a writer's or a reader's).
//
// The last credit is for read requests alone. A reader whose stream is
// stopped at a rendezvous message must always be able to ask for it:
// otherwise two sides, each with its ring full of the other's unread data
// behind an advert, and their last credits taken by adverts, enlargement
// requests or acks, wait for each other forever. Data keeps that credit
// too (write). A reader's second read request (prefetchLocked) is sent
// only when a credit is free: it never needs the last one.
func (c *rdmaConn) sendRecordLocked(r record, deadline time.Time, bounded bool) error {
	read := r.typ == recRead
	for c.recordOut || !c.tx[c.sending].canSendRecord(read) || c.posting || c.enl.parked {
		ch := c.changed
		if c.posting {
			c.recordWaits = true
		}
		if read && !c.tx[c.sending].canSendRecord(read) {
			c.spillLocked()
		}
		switch {
		case c.closed:
			return net.ErrClosed
		case c.err != nil:
			return c.err
		case bounded && expired(deadline):
			return os.ErrDeadlineExceeded
		}
		c.waitLocked(ch, deadline)
	}
	stage := &c.tx[small]
	off := stage.stageSlots * stage.stageSize
	buf := r.encode(stage.stage.Bytes()[off:])
	t, kind := &c.tx[c.sending], kindControl
	if c.sending == large {
		kind = kindRecordL
	}
	slot := t.msgs % uint64(t.count)
	cring, credits := c.takeCreditsLocked()
	_, err := c.qp.PostSend(transport.SendWR{
		ID: idRecord, Opcode: transport.OpWriteWithImm, Signaled: true,
		SG:         []transport.SGE{{Addr: stage.stage.Addr() + uint64(off), Length: uint32(len(buf)), LKey: stage.stage.LKey()}},
		RemoteAddr: t.addr + slot*uint64(t.size), RKey: t.rkey, Imm: encodeImm(kind, cring, credits, len(buf)),
	})
	if err != nil {
		err = fmt.Errorf("conn: post control record: %w", err)
		c.failLocked(err)
		return err
	}
	t.msgs++
	t.use()
	c.recordOut = true
	c.st.MessagesOut++
	return nil
}

// recordLocked handles a control record from the peer (poller); an error
// fails the connection.
func (c *rdmaConn) recordLocked(r record) error {
	switch r.typ {
	case recRequest:
		c.enl.peerTakesAsks = r.addr2&reqTakesShrinkAsks != 0
		c.enl.reqSize, c.enl.reqCount = int(r.size), int(r.count)
		// Once Close set closed it waits on c.wg: a server started
		// after that would outlive the connection's memory.
		if c.enl.requested(r.seq) {
			if c.closed {
				c.enl.serverGone()
			} else {
				c.wg.Add(1)
				go c.serveEnlarge(time.Now())
			}
		}
	case recAck, recRefuse:
		if r.seq == 0 || r.seq > c.enl.reqSeq {
			// Not a late answer: an answer to a request never made.
			return fmt.Errorf("%w: %s for enlargement request %d, %d made", errProtocol, recordNames[r.typ], r.seq, c.enl.reqSeq)
		}
		if !c.enl.waiting || r.seq != c.enl.reqSeq {
			c.st.StaleRecords++ // an answer to a request we gave up on
			return nil
		}
		if r.typ == recAck {
			c.enl.ack = &r
			// Every credit for a large ring we shrank away from came
			// before this ack: what follows is the new ring's.
			c.enl.acked()
		} else {
			c.enl.refused = true
		}
	case recShrinkAsk:
		c.shrinkAskedLocked()
	case recAdvert:
		return c.advertLocked(r)
	case recRead:
		return c.serveReadLocked(r)
	}
	return nil
}

// serveEnlarge is the receiver's side of the enlargement protocol, off the completion loop so
// small traffic keeps flowing: it provisions large buffers for this
// connection only and acknowledges with their address and key, or
// refuses. Later requests (a retry after a lost ack) are answered with
// the same buffers; the transitions are recvPhase's. Owned by the Conn; exits on Close. arrived is when
// the request that started it came.
func (c *rdmaConn) serveEnlarge(arrived time.Time) {
	defer c.wg.Done()
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		if c.enl.tornShrink(c.rx[large].arrived > 0) {
			c.retireLargeLocked(false)
		}
		// A large ring the peer shrank away from is still draining: the
		// new one comes when it is gone, if that is soon (within half
		// the peer's ack time-out); else the answer is a refusal, and
		// the peer asks again after its back-off. Waiting longer would
		// provision for a request the writer gave up on, and keep that
		// ring with nothing to shrink it.
		drainBy := time.Now().Add(c.o.ackTimeout / 2)
		for c.enl.draining() && !c.closed && c.err == nil && time.Now().Before(drainBy) {
			c.waitLocked(c.changed, drainBy)
		}
		if c.closed || c.err != nil {
			c.enl.serverGone()
			return
		}
		seq := c.enl.reqIn
		rx := &c.rx[large]
		var tel *telemetry.Enlargement // only the pass that provisions
		// Still draining: refused below, not for good.
		if c.enl.mayProvision(seq) {
			ph := c.o.phaseFor(c.enl.reqSize, c.enl.reqCount)
			tel = c.tel.StartEnlargement(telemetry.Receiver, arrived, c.rx[small].size, ph.Size, ph.Count)
			if c.rpcsInFlight() {
				tel.Link(c.rpcLinks())
			}
			start := time.Now()
			c.mu.Unlock()
			get := func() (*bufpool.Buffer, error) {
				return c.pool.Get(bufpool.Owner(c.id), ph.Size*ph.Count, transport.AccessLocalWrite|transport.AccessRemoteWrite)
			}
			buf, err := get()
			if first := c.o.largePhases()[0]; isBudgetErr(err) && ph != first {
				// No room for a step up the ladder: the first large
				// phase, rather than sending the writer back to small
				// (it stops climbing, given less than it asked). No
				// other connection is asked to shrink for a step up.
				ph = first
				buf, err = get()
			}
			if isBudgetErr(err) && askShrinks(c, c.pool.Budget(), int64(ph.Size*ph.Count)) > 0 {
				// Within half the writer's ack time-out, as for a
				// draining ring above.
				buf, err = c.awaitRoom(get, start.Add(c.o.ackTimeout/2))
			}
			tel.Registration(time.Since(start))
			c.mu.Lock()
			if c.closed {
				if buf != nil {
					buf.Release()
				}
				c.enl.serverGone()
				tel.Abort(net.ErrClosed)
				return
			}
			outcome := outcomeServed
			if err != nil {
				c.enl.refuse(err)
				outcome = outcomeServeError
				c.st.EnlargeRefusals++
			} else if perr := c.postRecvsLocked(ph.Count); perr != nil {
				buf.Release()
				c.failLocked(fmt.Errorf("conn: post receives for the large ring: %w", perr))
				c.enl.serverGone()
				tel.Abort(perr)
				return
			} else {
				*rx = newRxRing(buf, ph.Size, ph.Count)
				rx.stamp, rx.lastLanding = true, time.Now()
				c.enl.provisioned()
				c.holdingLarge(true)
				c.st.EnlargementsServed++
			}
			enlargementMarker(c.id, uint32(c.rx[small].size), uint32(ph.Size), time.Since(start).Nanoseconds(), uint32(outcome))
		}
		answer := record{typ: recRefuse, seq: seq}
		if c.enl.acks() {
			answer = record{typ: recAck, seq: seq, addr: rx.buf.Addr(), rkey: rx.buf.RKey(), size: uint32(rx.size), count: uint32(rx.count)}
			if !c.o.freeSmall {
				answer.addr2 = ackKeepsSmall
			}
		}
		if err := c.sendRecordLocked(answer, time.Time{}, false); err != nil {
			c.enl.serverGone()
			tel.Abort(err)
			return
		}
		c.endServeTelemetryLocked(tel, arrived)
		if c.enl.answeredUpTo(seq) {
			return
		}
	}
}

var markerCalls atomic.Uint64

// maybeFreeSmallLocked frees the small ring, with WithFreeSmallOnEnlarge: once the
// peer writes into our large ring it never writes into the small one again
// (a reliable connection keeps order, so everything it wrote there has
// landed), and once the reader consumed all of it the small ring is
// deregistered and freed.
func (c *rdmaConn) maybeFreeSmallLocked() {
	r := &c.rx[small]
	if !c.o.freeSmall || r.buf == nil || c.rx[large].arrived == 0 || !r.drained() {
		return
	}
	if err := r.buf.Discard(); err != nil {
		// Still registered: the pool keeps it and reports it at Close.
		c.st.FreeSmallErrors++
	}
	r.buf = nil
	r.forgo() // nothing to give back: the peer writes there no more
	c.st.SmallFreed = true
}
