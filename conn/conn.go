package conn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Work request ids: zero-length control messages, control records, and
// data (ring bit, then the data sequence number).
const (
	idCtl    = 1 << 63
	idRecord = 1 << 62
	idRing   = 61
)

var connIDs atomic.Uint64

// rxRing is a ring the peer writes into, with the account of its slots
// and credits (rxCredits).
type rxRing struct {
	buf  *bufpool.Buffer
	size int
	rxCredits
	retiredAt time.Time
	// stamp: a large ring, whose last landing is noted for the shrink
	// under pressure (pressure.go); askedAt: when its writer was last
	// asked to shrink.
	stamp       bool
	askedAt     time.Time
	lastLanding time.Time
	// climb: the writer retired this ring to ask for a deeper one (the
	// ladder), not to shrink.
	climb bool
}

func newRxRing(buf *bufpool.Buffer, size, count int) rxRing {
	return rxRing{buf: buf, size: size, rxCredits: newRxCredits(count)}
}

// land takes the next slot for an arriving message; ok is false when the
// peer wrote past the credits it was given.
func (r *rxRing) land() (slot int, ok bool) {
	if slot, ok = r.arrive(); ok && r.stamp {
		r.lastLanding = time.Now()
	}
	return slot, ok
}

// txRing is a ring of the peer's we write into, with our staging for it.
type txRing struct {
	addr  uint64
	rkey  uint32
	size  int
	count int
	msgs  uint64 // messages posted into the peer's ring
	txCredits
	stage      *bufpool.Buffer
	stageSize  int
	stageSlots int    // staging slots for data
	seq, done  uint64 // data messages posted and completed
}

// Conn is an RDMA connection. It implements net.Conn; Stats, CloseWrite
// and WriteBuffers are its additions.
//
// Every idle connection end holds one, so its size counts: it is kept
// within the 1,792 B allocation class with its 8 B malloc header
// (TestConnSize), with no field that Stats can derive and its small
// fields packed.
type Conn struct {
	id        uint64
	tcp       *tcpSide     // set: a connection over TCP (tcp.go), nothing below is used
	rpcs      rpcTrack     // the RPCs on it, for StatsHandler (rpcstats.go)
	ends      *ends        // RDMA: its addresses, set at start
	lastWrite atomic.Int64 // UnixNano of the end of the last Write: idle shrink (shrink.go)
	opened    atomic.Bool  // start succeeded: release reports the close to the marker
	// closedFast mirrors closed for the calls that must fail at once
	// after Close without taking c.mu (isClosed).
	closedFast atomic.Bool
	o          *options
	qp         transport.QP
	pd         transport.PD
	cq         transport.CQ
	pool       *bufpool.Pool
	tel        *telemetry.Conn // nil-safe; see conn/telemetry.go
	// inlineMax is the largest message the provider sends inline from
	// the caller's memory (0: none): a ring whose slots fit needs no
	// registered staging, and each write is one copy instead of two.
	inlineMax int32
	// SetLinger; lingerSet false: the default (background, DefaultLinger)
	linger int32

	rmu, wmu sync.Mutex // one reader, one writer at a time

	mu      sync.Mutex
	changed chan struct{} // closed and replaced on every state change
	rx      [2]rxRing
	tx      [2]txRing
	recvQ   []entry
	readOff int
	spilled int // bytes of recvQ held in spill copies (bounded: spillLocked)
	// control traffic
	ctlPending int32 // zero-length messages in flight
	// recvs: receives posted, kept so by reposting each that completes
	// (see recvDepth); recvNext: the ID of the next, which is the slot
	// it takes in the provider's ring of recvDepth.
	recvs, recvNext uint16
	creditOut       bool // a credit message is in flight
	recordOut       bool // the control record staging slot is in use
	// posting: a data message holds a credit and is not posted yet. A
	// record waits for it (recordWaits), so that data never lands after
	// a record that took a credit after it: the receiver holds the writer
	// to keeping its last credit for records (receivedLocked).
	posting, recordWaits bool
	discarding           bool  // closed: what arrives is dropped (discardLocked)
	lingerSet            bool  // see linger
	sending              uint8 // the ring data goes to: small, then large once enlarged
	// creditWait: a writer sleeps for credits; a round of completions
	// that wakes it suspends the loop (poll.go).
	creditWait bool
	enl        enlargement
	rdv        rendezvous
	// lifecycle
	wclosed bool
	eofIn   bool
	closed  bool
	aborted bool // the QP was put in error and disconnected
	// Parking (park.go): offered, our hello offered it; peerParks, the
	// peer's did; parked, our small direction is parked until the peer's
	// answer; parkArmed, the idle timer is set for a park.
	offered, peerParks, parked, parkArmed bool
	err                                   error
	rdl                                   time.Time
	wdl                                   time.Time
	st                                    Stats

	wg sync.WaitGroup // the enlargement server

	pl pollState // the completion loop (poll.go)
}

type entry struct {
	ring  uint8
	slot  int32
	n     int32
	spill []byte // the message, copied out of its slot (spillLocked)
}

// newConn prepares a connection's memory and queues; start finishes it
// once the QP exists. ctx parents the connection span; role is
// telemetry.Client or telemetry.Server.
func newConn(ctx context.Context, role string, provider string, dev transport.Device, o *options) (c *Conn, cfg transport.QPConfig, err error) {
	c = &Conn{id: idFor(ctx), o: o, changed: make(chan struct{})}
	c.st.Provider, c.st.ProviderReason, c.st.Device = provider, o.providerWhy, dev.Name()
	c.tel = o.tel.StartConn(ctx, role, c.id, provider, o.providerWhy)
	partial := c // the error returns below set c to nil
	defer func() {
		if err != nil {
			partial.tel.Fail(err)
			partial.release()
		}
	}()
	if c.pd, c.pool = takeKit(dev, o.budget); c.pool != nil {
		c.pool.SetOnRegister(c.tel.Registered)
	} else {
		if c.pd, err = dev.AllocPD(); err != nil {
			return nil, cfg, fmt.Errorf("conn: allocate protection domain: %w", err)
		}
		if c.pool, err = bufpool.New(dev, c.pd, bufpool.Options{Budget: o.budget, OnRegister: c.tel.Registered}); err != nil {
			return nil, cfg, err
		}
	}
	size := o.slotSize * o.slotCount
	ring, err := c.pool.Get(bufpool.Owner(c.id), size, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err != nil {
		return nil, cfg, fmt.Errorf("conn: receive buffers: %w", err)
	}
	c.rx[small] = newRxRing(ring, o.slotSize, o.slotCount)
	stage, err := c.pool.Get(bufpool.Owner(c.id), size, transport.AccessLocalWrite)
	if err != nil {
		return nil, cfg, fmt.Errorf("conn: send buffers: %w", err)
	}
	// The last staging slot holds control records; data uses the others.
	c.tx[small] = txRing{stage: stage, stageSize: o.slotSize, stageSlots: o.slotCount - 1}
	if c.pool.Stats().FreeBuffers > 0 {
		c.pool.Trim() // a kit of rings of other sizes
	}
	maxSize, maxCount := o.maxLarge()
	if want := max(o.slotSize, maxSize); dev.Attr().MaxInline >= want {
		c.inlineMax = int32(want)
	}
	recvs := c.recvDepth()
	if c.cq, err = dev.CreateCQ(2*recvs + 2*o.slotCount + maxServing + 16); err != nil {
		return nil, cfg, fmt.Errorf("conn: completion queue: %w", err)
	}
	cfg = transport.QPConfig{
		PD: c.pd, SendCQ: c.cq, RecvCQ: c.cq,
		MaxSendWR: max(o.slotCount, maxCount) + 8 + maxServing*((o.rdvChunk+rdvSegment-1)/rdvSegment), MaxRecvWR: recvs, MaxSendSGE: 1, MaxRecvSGE: 1,
		MaxInline:  int(c.inlineMax),
		RetryCount: 7, RNRRetry: 7, MinRNRTimer: time.Millisecond,
	}
	// Posted by the provider before the peer can send: the peer writes
	// the moment it is connected (grpc-go's preface, the server's
	// settings), and a receive posted after Connect or Accept return
	// cost every new connection a 1 ms RNR timer. Those for a large ring
	// come when it is provisioned (postRecvsLocked): most connections
	// never enlarge, and posting them all cost each set-up a few percent
	// of its CPU.
	c.recvs = uint16(c.smallRecvs())
	c.recvNext = c.recvs % uint16(recvs)
	cfg.InitialRecvs = initialRecvs(int(c.recvs))
	return c, cfg, nil
}

// recvsByID holds receives whose IDs are their indices, shared read-only
// by every connection's InitialRecvs (the providers only read them): a
// slice of its own cost each connection set-up 1.5 KiB of garbage.
var recvsByID atomic.Pointer[[]transport.RecvWR]

// initialRecvs returns n receives with IDs 0 to n-1, not to be written.
func initialRecvs(n int) []transport.RecvWR {
	if p := recvsByID.Load(); p != nil && len(*p) >= n {
		return (*p)[:n:n]
	}
	s := make([]transport.RecvWR, max(n, 64))
	for i := range s {
		s[i].ID = uint64(i)
	}
	recvsByID.Store(&s)
	return s[:n:n]
}

// recvDepth: every message (data, record, credit, EOF) consumes a posted
// receive; data and records are bounded by the credits of both rings,
// zero-length messages by one credit message and one EOF in flight, the
// ends of rendezvous transfers by our one read request, parks by one park
// and one resume (park.go): controlRecvs in all, beside the rings' slots.
func (c *Conn) recvDepth() int { return c.o.recvCap }

// controlRecvs are the receives zero-length messages may take (recvDepth).
const controlRecvs = 7

// smallRecvs is recvDepth while the peer writes into our small ring only.
func (c *Conn) smallRecvs() int { return c.o.slotCount + controlRecvs }

// postRecvsLocked brings the receives posted to those a large ring of
// count slots needs, before the peer learns of it.
func (c *Conn) postRecvsLocked(count int) error {
	want := min(c.smallRecvs()+count, c.recvDepth())
	for int(c.recvs) < want {
		if err := c.repostLocked(); err != nil {
			return err
		}
		c.recvs++
	}
	return nil
}

// repostLocked posts one receive, with the ID of the slot it takes.
func (c *Conn) repostLocked() error {
	id := c.recvNext
	if c.recvNext++; int(c.recvNext) == c.recvDepth() {
		c.recvNext = 0
	}
	_, err := c.qp.PostRecv(transport.RecvWR{ID: uint64(id)})
	return err
}

func (c *Conn) hello() hello {
	r := c.rx[small]
	h := hello{ringAddr: r.buf.Addr(), ringRKey: r.buf.RKey(), slotSize: uint32(r.size), slotCount: uint32(r.count)}
	if c.offered = c.offersParks(); c.offered {
		h.flags |= helloParks
	}
	return h
}

// start starts the completion loop (the provider posted the receives),
// before anyone else has the Conn.
func (c *Conn) start(qp transport.QP, peer hello) error {
	c.setQP(qp)
	c.track()
	c.mu.Lock()
	c.openLocked(peer)
	c.mu.Unlock()
	c.run()
	return nil
}

// openLocked takes the peer's ring from its hello: from here calls can
// use the connection (awaitOpenLocked).
func (c *Conn) openLocked(peer hello) {
	t := &c.tx[small]
	t.addr, t.rkey, t.size, t.count = peer.ringAddr, peer.ringRKey, int(peer.slotSize), int(peer.slotCount)
	t.grant(t.count)
	c.peerParks = peer.flags&helloParks != 0
	if c.tel.Recording() {
		c.lookUpPathLocked() // for the connection span; else Stats asks
	}
	c.opened.Store(true)
	c.broadcastLocked()
}

// lookUpPathLocked asks the QP the path it was programmed with, once:
// verbs queries the QP (a firmware command on most NICs) and reads the
// GID's type from sysfs, which a dial need not pay when nobody looks.
// Best effort: a QP that cannot say its path still carries data.
func (c *Conn) lookUpPathLocked() {
	if c.st.Path.Port != 0 {
		return
	}
	if pq, ok := c.qp.(transport.PathQP); ok {
		if p, err := pq.Path(); err == nil {
			c.st.Path = p
		}
	}
}

// run reports an opened connection and starts its completion loop.
func (c *Conn) run() {
	c.tel.Connected(c.qp.LocalAddr(), c.qp.RemoteAddr(), c.telemetrySnapshot)
	c.tel.Fabric(c.st.Device, c.st.Path)
	enlargementMarker(c.id, providerCodes[c.st.Provider], 0, 0, outcomeOpenedRDMA)
	c.startPolling()
}

// providerCodes name an RDMA connection's provider in the fromSize of its
// opened marker, for rdmatrace (bpf.OpenedShm, bpf.OpenedVerbs); 0: any
// other. Not the "provider code" of doc/protocol.md (§2.3), which is
// providerCode's FNV-1a hash in the negotiation's SETTINGS.
var providerCodes = map[string]uint32{"shm": 1, "verbs": 2}

// establish finishes a dial that returned once its request was sent
// (dialRDMA): the listener's answer, then what start does. Until then the
// Conn's calls wait (awaitOpenLocked; Read for data anyway); a failure
// comes with them, as a reset TCP connection's does. The answer, or its
// absence, leaves the gate; forget, if not nil, runs on a failure.
func (c *Conn) establish(ctx context.Context, qp transport.EarlyQP, gate *earlyGate, forget func()) {
	defer c.wg.Done()
	var err error
	if d, ok := qp.(transport.DeadlineEstablisher); ok {
		// ctx carries no cancellation (WithoutCancel): a deadline is all
		// it would add, at the price of a context and a timer per dial.
		err = d.EstablishedBy(time.Now().Add(c.o.upgradeTimeout))
	} else {
		tctx, cancel := context.WithTimeout(ctx, c.o.upgradeTimeout)
		err = qp.Established(tctx)
		cancel()
	}
	gate.leave()
	var peer hello
	if err == nil {
		peer, err = decodeHello(qp.PeerPrivate())
	}
	c.mu.Lock()
	if c.closed {
		// Close came first (and maybe caused err): it tears down once we
		// return.
		c.mu.Unlock()
		return
	}
	if err != nil {
		// Forgotten before a call sees the failure: the dial it makes
		// next negotiates afresh.
		if forget != nil {
			forget()
		}
		err = rejected(err)
		c.failLocked(err)
		c.mu.Unlock()
		c.tel.Fail(err)
		return
	}
	c.openLocked(peer)
	c.mu.Unlock()
	c.run()
}

// awaitOpen is awaitOpenLocked for a caller bound by ctx alone.
func (c *Conn) awaitOpen(ctx context.Context) error {
	if c.opened.Load() {
		return nil
	}
	stop := context.AfterFunc(ctx, func() {
		c.mu.Lock()
		c.broadcastLocked()
		c.mu.Unlock()
	})
	defer stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.awaitOpenLocked(ctx, time.Time{})
}

// awaitOpenLocked waits until a connection whose dial returned early is
// open, within ctx and dl: an error if it failed, was closed, or ctx or
// dl ended first.
func (c *Conn) awaitOpenLocked(ctx context.Context, dl time.Time) error {
	for !c.opened.Load() {
		ch := c.changed
		switch {
		case c.closed:
			return net.ErrClosed
		case c.err != nil:
			return c.err
		case expired(dl):
			return os.ErrDeadlineExceeded
		case ctx.Err() != nil:
			return ctx.Err()
		}
		c.waitLocked(ch, dl)
	}
	return nil
}

func (c *Conn) broadcastLocked() {
	c.creditWait = false
	close(c.changed)
	c.changed = make(chan struct{})
}

func (c *Conn) failLocked(err error) {
	if c.err == nil {
		c.err = err
		c.broadcastLocked()
	}
}

// waitLocked sleeps until the state changes or the deadline passes; c.mu
// is held on entry and on return. ch is c.changed as it was when the
// caller last checked its condition: a loop that let go of c.mu since
// (a copy, a registration) must not sleep through a broadcast it missed,
// such as Close's.
func (c *Conn) waitLocked(ch chan struct{}, deadline time.Time) {
	if c.pollInstead(ch, deadline) {
		return
	}
	c.mu.Unlock()
	if deadline.IsZero() {
		<-ch
	} else if d := time.Until(deadline); d > 0 {
		t := time.NewTimer(d)
		select {
		case <-ch:
		case <-t.C:
		}
		t.Stop()
	}
	c.mu.Lock()
}

func (c *Conn) opErr(op string, err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	nw := "rdma"
	if c.tcp != nil {
		nw = "tcp"
	}
	return &net.OpError{Op: op, Net: nw, Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

func expired(dl time.Time) bool { return !dl.IsZero() && !time.Now().Before(dl) }

// Read reads data written by the peer; io.EOF once the peer closed its
// direction and everything before was read.
func (c *Conn) Read(b []byte) (int, error) {
	if c.tcp != nil {
		return c.tcpRead(b)
	}
	c.rmu.Lock()
	defer c.rmu.Unlock()
	return c.readRLocked(b)
}

// readRLocked is Read, c.rmu held.
func (c *Conn) readRLocked(b []byte) (int, error) {
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
func (c *Conn) readRingLocked(b []byte) int {
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

// takeCreditsLocked picks freed slots to piggyback on an outgoing message.
func (c *Conn) takeCreditsLocked() (ring, n int) { return piggyback(&c.rx) }

// returnCreditsLocked sends freed slots back in a credit message once
// half a ring is free and no credit message is on its way already (data
// messages carry credits too).
func (c *Conn) returnCreditsLocked() {
	if c.creditOut || c.err != nil || c.qp == nil {
		return
	}
	r, ok := creditDue(&c.rx)
	if !ok {
		return
	}
	if err := c.postCtlLocked(kindCredit, r, c.rx[r].pending()); err != nil {
		c.failLocked(err)
		return
	}
	c.rx[r].take()
	c.creditOut = true
}

func (c *Conn) postCtlLocked(kind, ring, credits int) error {
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
func (c *Conn) Write(b []byte) (int, error) {
	if c.tcp != nil {
		return c.tcpWrite(b)
	}
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
func (c *Conn) writeElem(b []byte) (int, error) {
	c.mu.Lock()
	err := c.awaitOpenLocked(context.Background(), c.wdl)
	if err == nil {
		err = c.writeErrLocked()
	}
	stalling := c.enl.phase == phaseLarge && c.enl.stalls >= climbStalls // the ladder (climb)
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
func (c *Conn) write(b []byte) (int, error) {
	n := 0
	for {
		c.mu.Lock()
		var stalled time.Time
		var t *txRing
		for {
			ch := c.changed
			if err := c.writeErrLocked(); err != nil {
				if !stalled.IsZero() {
					c.stalled(time.Since(stalled))
				}
				c.mu.Unlock()
				return n, c.opErr("write", err)
			}
			if len(b) == 0 {
				c.mu.Unlock()
				return n, nil
			}
			t = &c.tx[c.sending]
			if c.parked { // the answer to our park: a round trip, not a stall
				c.waitLocked(ch, c.wdl)
				continue
			}
			if t.canSendData() && t.seq-t.done < uint64(t.stageSlots) {
				break
			}
			if stalled.IsZero() {
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
		wr := transport.SendWR{ID: uint64(ring)<<idRing | seq, Opcode: transport.OpWriteWithImm, Signaled: true}
		var k int
		if t.stage == nil {
			// Inline: the provider copies from b itself, at the post.
			k = min(len(b), t.size)
			wr.Inline, wr.Data = true, b[:k]
		} else {
			k = min(len(b), t.size, t.stageSize)
			off := int(seq%uint64(t.stageSlots)) * t.stageSize
			copy(t.stage.Bytes()[off:], b[:k])
			wr.SG = []transport.SGE{{Addr: t.stage.Addr() + uint64(off), Length: uint32(k), LKey: t.stage.LKey()}}
		}
		c.mu.Lock()
		slot := t.msgs % uint64(t.count)
		t.msgs++
		cring, credits := c.takeCreditsLocked()
		wr.RemoteAddr, wr.RKey, wr.Imm = t.addr+slot*uint64(t.size), t.rkey, encodeImm(kindSmall+ring, cring, credits, k)
		_, err := c.qp.PostSend(wr)
		c.posting = false
		if c.recordWaits {
			c.recordWaits = false
			c.broadcastLocked()
		}
		if err != nil {
			c.failLocked(fmt.Errorf("conn: post write: %w", err))
			c.mu.Unlock()
			return n, c.opErr("write", c.err)
		}
		c.st.BytesOut += uint64(k)
		c.st.MessagesOut++
		if ring == small && !c.parkArmed {
			c.armParkLocked()
		}
		c.mu.Unlock()
		n += k
		b = b[k:]
	}
}

// WriteBuffers is the vectored write, checked element
// by element: elements at or below the threshold go as they are; at the
// first element above it the connection is enlarged, so a small prefix
// goes through the small buffers and the rest, from the large element on,
// after the enlargement. Elements above the rendezvous threshold go by
// rendezvous.
func (c *Conn) WriteBuffers(v net.Buffers) (int64, error) {
	if c.tcp != nil {
		if r := c.tcp.upgraded(); r != nil {
			return r.WriteBuffers(v)
		}
		return c.tcpWriteBuffers(v)
	}
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

// discardLocked drops everything received and not read, after Close,
// and has everything that arrives later dropped on arrival: the slots are
// freed and their credits returned at once.
func (c *Conn) discardLocked() {
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
func (c *Conn) isClosed() bool { return c.closedFast.Load() }

func (c *Conn) writeErrLocked() error {
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

// CloseWrite ends our direction: the peer reads io.EOF after the data.
func (c *Conn) CloseWrite() error {
	if c.tcp != nil {
		return c.tcpCloseWrite()
	}
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

func (c *Conn) sendEOFLocked() error {
	if c.wclosed || c.err != nil {
		return nil
	}
	c.wclosed = true
	return c.postCtlLocked(kindEOF, small, 0)
}

// sendCloseLocked tells the peer we read no more, so that it stops
// holding rendezvous data for us (and its Close does not wait for us).
func (c *Conn) sendCloseLocked() {
	if c.err != nil {
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
func (c *Conn) sentLocked() bool {
	return c.tx[small].seq == c.tx[small].done && c.tx[large].seq == c.tx[large].done && c.ctlPending == 0 && !c.recordOut
}

// drainedLocked: the peer has everything written, rendezvous messages
// included, or reads no more (a peer that closed: waiting is pointless).
func (c *Conn) drainedLocked() bool {
	return c.rdv.peerClosed || c.sentLocked() && len(c.rdv.out) == 0
}

// closeWait bounds how long Close itself waits for what it posted last
// (the end of stream) and for writes in flight to complete: microseconds
// with a live peer. What the peer must still fetch is delivered in the
// background.
const closeWait = 100 * time.Millisecond

// SetLinger sets what Close does with data written but not yet delivered,
// as net.TCPConn's SetLinger: sec < 0 (the default), Close returns at
// once and the connection delivers it in the background, for at most
// DefaultLinger; sec == 0, Close discards it and tears down at once;
// sec > 0, Close blocks until it is delivered or sec seconds passed,
// then tears down. Data in the peer's rings is delivered in every case:
// only rendezvous messages, which the peer fetches from us, need us.
func (c *Conn) SetLinger(sec int) error {
	if c.tcp != nil {
		return c.tcpSetLinger(sec)
	}
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
func (c *Conn) Close() error {
	if c.tcp != nil {
		if c.tcp.neg != nil {
			return c.closeBehind()
		}
		return c.tcpClose()
	}
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
func (c *Conn) teardown(deadline time.Time) {
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
func (c *Conn) release() {
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

// setQP makes qp the connection's, and its addresses c's: once, so that
// an early dial's Conn keeps the values grpc-go took at its return.
func (c *Conn) setQP(qp transport.QP) {
	c.qp = qp
	if c.ends == nil {
		c.ends = &ends{local: tcpAddr(qp.LocalAddr()), remote: tcpAddr(qp.RemoteAddr())}
	}
}

// ends are an RDMA connection's addresses as grpc-go and its users read
// them, and the other key it is found by (trackAs).
type ends struct {
	local, remote net.Addr
	alias         net.Addr
}

// tcpAddr is a provider's address as a *net.TCPAddr: the IP, and the port
// in the provider's port space (RDMA CM's TCP port space on verbs; shm
// numbers its ends the same way). grpc-go's channelz, xDS filter chains,
// local credentials and IP-based authorization read a connection's
// addresses as TCP ones; the provider is on Stats (StatsFromContext).
func tcpAddr(a net.Addr) net.Addr {
	if a == nil {
		return nil
	}
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return a
	}
	return net.TCPAddrFromAddrPort(ap)
}

// LocalAddr is the address of this end: over TCP, the TCP connection's;
// over RDMA, a *net.TCPAddr with the IP of this end and its port in the
// provider's port space. A dial that was upgraded after its TCP
// connection opened keeps that connection's addresses.
func (c *Conn) LocalAddr() net.Addr {
	if c.tcp != nil {
		return c.tcp.nc.LocalAddr()
	}
	if c.ends == nil { // never connected
		return nil
	}
	return c.ends.local
}

// RemoteAddr is the address of the peer's end, as LocalAddr is this
// end's.
func (c *Conn) RemoteAddr() net.Addr {
	if c.tcp != nil {
		return c.tcp.nc.RemoteAddr()
	}
	if c.ends == nil {
		return nil
	}
	return c.ends.remote
}

func (c *Conn) SetDeadline(t time.Time) error {
	if c.tcp != nil {
		return c.tcpSetDeadline(t, true, true)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rdl, c.wdl = t, t
	c.broadcastLocked()
	return nil
}

func (c *Conn) SetReadDeadline(t time.Time) error {
	if c.tcp != nil {
		return c.tcpSetDeadline(t, true, false)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rdl = t
	c.broadcastLocked()
	return nil
}

func (c *Conn) SetWriteDeadline(t time.Time) error {
	if c.tcp != nil {
		return c.tcpSetDeadline(t, false, true)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wdl = t
	c.broadcastLocked()
	return nil
}
