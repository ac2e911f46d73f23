package conn

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
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
	// stamp: a large ring, whose last landing is noted for the shrink
	// under pressure (pressure.go); askedAt: when its writer was last
	// asked to shrink.
	stamp       bool
	askedAt     time.Time
	lastLanding time.Time
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
	// signaled: the data messages that a signalled work request confirms
	// when it completes (the last signalled one's seq + 1). Past it,
	// messages were posted unsignalled and wait for a later completion
	// (mustSignal, confirmLocked).
	signaled uint64
}

// rdmaConn is a connection over RDMA (a queue pair of a provider):
// what a Conn holds from an accept or a direct dial, and what the
// negotiation behind a dial hands every call to once it upgraded
// (lazy.go).
//
// Every idle connection end holds one, so its size counts: it is kept
// within the 1,792 B allocation class with its 8 B malloc header
// (TestConnSize), with no field that Stats can derive and its small
// fields packed.
type rdmaConn struct {
	connCore
	ends      *ends        // its addresses, set at start
	lastWrite atomic.Int64 // UnixNano of the end of the last Write: idle shrink (shrink.go)
	pend      *pending     // small writes taken while the ring had no credit (pack.go)
	opened    atomic.Bool  // start succeeded: release reports the close to the marker
	// closedFast mirrors closed for the calls that must fail at once
	// after Close without taking c.mu (isClosed).
	closedFast atomic.Bool
	qp         transport.QP
	pd         transport.PD
	cq         transport.CQ
	pool       *bufpool.Pool
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
	// peer's did; parkArmed, the idle timer is set for a park. Whether
	// our small direction is parked is c.enl.parked.
	offered, peerParks, parkArmed bool
	err                           error
	rdl                           time.Time
	wdl                           time.Time
	st                            Stats

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
func newConn(ctx context.Context, role string, provider string, dev transport.Device, o *options) (c *rdmaConn, cfg transport.QPConfig, err error) {
	c = &rdmaConn{connCore: connCore{id: idFor(ctx), o: o}, changed: make(chan struct{})}
	why := providerWhy(ctx, o)
	c.st.Provider, c.st.ProviderReason, c.st.Device = provider, why, dev.Name()
	c.tel = o.tel.StartConn(ctx, role, c.id, provider, why)
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
		MaxSendWR: max(o.slotCount, maxCount) + 8 + maxServing*((o.rdvChunk+rdvSegment-1)/rdvSegment), MaxRecvWR: recvs, MaxSendSGE: 1, MaxRecvSGE: 1, RecvImmOnly: true,
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
// ends of rendezvous transfers by our read requests (two at most), parks
// by one park and one resume (park.go): controlRecvs in all, beside the
// rings' slots.
func (c *rdmaConn) recvDepth() int { return c.o.recvCap }

// controlRecvs are the receives zero-length messages may take (recvDepth).
const controlRecvs = 7

// smallRecvs is recvDepth while the peer writes into our small ring only.
func (c *rdmaConn) smallRecvs() int { return c.o.slotCount + controlRecvs }

// postRecvsLocked brings the receives posted to those a large ring of
// count slots needs, before the peer learns of it.
func (c *rdmaConn) postRecvsLocked(count int) error {
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
func (c *rdmaConn) repostLocked() error {
	id := c.recvNext
	if c.recvNext++; int(c.recvNext) == c.recvDepth() {
		c.recvNext = 0
	}
	_, err := c.qp.PostRecv(transport.RecvWR{ID: uint64(id)})
	return err
}

func (c *rdmaConn) hello() hello {
	r := c.rx[small]
	h := hello{ringAddr: r.buf.Addr(), ringRKey: r.buf.RKey(), slotSize: uint32(r.size), slotCount: uint32(r.count)}
	if c.offered = c.offersParks(); c.offered {
		h.flags |= helloParks
	}
	return h
}

// start starts the completion loop (the provider posted the receives),
// before anyone else has the Conn.
func (c *rdmaConn) start(qp transport.QP, peer hello) error {
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
func (c *rdmaConn) openLocked(peer hello) {
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
func (c *rdmaConn) lookUpPathLocked() {
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
func (c *rdmaConn) run() {
	c.tel.Connected(c.qp.LocalAddr(), c.qp.RemoteAddr(), c.telemetrySnapshot)
	c.tel.Fabric(c.st.Device, c.st.Path)
	enlargementMarker(c.id, providerCodes[c.st.Provider], reasonCode(c.st.ProviderReason, c.o), 0, outcomeOpenedRDMA)
	c.startPolling()
}

// providerCodes name an RDMA connection's provider in the fromSize of its
// opened marker, for rdmatrace (bpf.OpenedShm, bpf.OpenedVerbs); 0: any
// other. Not the "provider code" of doc/protocol.md (§2.3), which is
// providerCode's FNV-1a hash in the negotiation's SETTINGS.
var providerCodes = map[string]uint32{"shm": 1, "verbs": 2}

// The phrases of a ProviderReason that say where the peer is, as the
// per-connection choice (offer.go) words them.
const (
	whySameKernel = "(same kernel)"
	whyOtherHost  = "another host"
)

// The reason codes of an opened marker's toSize, for rdmatrace (bpf's
// WhyPinned...): why the connection has its provider.
const (
	reasonPinned    = 1 // WithProvider or RDMAGRPC_PROVIDER
	reasonSameHost  = 2 // the peer is on this host: shared memory
	reasonOtherHost = 3 // the peer is on another host
	reasonDefault   = 4 // the process's provider (an RDMA device found, or none)
)

// reasonCode sums a connection's ProviderReason up as a reason code.
func reasonCode(why string, o *options) uint32 {
	switch {
	case o.pinned:
		return reasonPinned
	case strings.Contains(why, whySameKernel):
		return reasonSameHost
	case strings.Contains(why, whyOtherHost):
		return reasonOtherHost
	}
	return reasonDefault
}

// establish finishes a dial that returned once its request was sent
// (dialRDMA): the listener's answer, then what start does. Until then the
// Conn's calls wait (awaitOpenLocked; Read for data anyway); a failure
// comes with them, as a reset TCP connection's does. The answer, or its
// absence, leaves the gate; forget, if not nil, runs on a failure.
func (c *rdmaConn) establish(ctx context.Context, qp transport.EarlyQP, gate *earlyGate, forget func()) {
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

// Handshake waits for the listener's answer to an early dial
// (Conn.Handshake).
func (c *rdmaConn) Handshake(ctx context.Context) error {
	if err := c.awaitOpen(ctx); err != nil {
		return c.opErr("handshake", err)
	}
	return nil
}

// awaitOpen is awaitOpenLocked for a caller bound by ctx alone.
func (c *rdmaConn) awaitOpen(ctx context.Context) error {
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
func (c *rdmaConn) awaitOpenLocked(ctx context.Context, dl time.Time) error {
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

func (c *rdmaConn) broadcastLocked() {
	c.creditWait = false
	close(c.changed)
	c.changed = make(chan struct{})
}

func (c *rdmaConn) failLocked(err error) {
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
func (c *rdmaConn) waitLocked(ch chan struct{}, deadline time.Time) {
	if c.pollInstead(ch, deadline) {
		return
	}
	c.markWaiting()
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
	c.pl.flags.And(^uint32(plFlagWaiting))
	c.mu.Lock()
}

func (c *rdmaConn) opErr(op string, err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	return &net.OpError{Op: op, Net: "rdma", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

func expired(dl time.Time) bool { return !dl.IsZero() && !time.Now().Before(dl) }
