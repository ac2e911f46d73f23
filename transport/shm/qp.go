package shm

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

var qpNums atomic.Uint32

// qp is an RC queue pair. Lock order: sendMu → cq.mu → recvMu.
type qp struct {
	dev  *device
	pd   *pd
	num  uint32
	cfg  qpLimits
	scq  *cq
	rcq  *cq
	seg  *segment
	ring ring // our receive queue and state word, shared with the peer

	// Owner side of the receive ring.
	recvMu   sync.Mutex
	rqPosted uint64
	rqPolled uint64
	// rqIDs are the posted receives' IDs by slot; nil while each ID is
	// its slot's index, as conn posts them (352 B of every connection
	// end). ownFlush: the slots this side claimed in order to flush them,
	// made in ERROR only.
	rqIDs     []uint64
	ownFlush  []bool
	recvGone  bool // Close drained the ring
	sqRetired atomic.Uint64

	// Send side: the requester engine (datapath.go).
	sendMu   sync.Mutex
	sq       []*sendOp // accepted, not yet executed (waiting behind RNR/retry)
	sqPosted uint64
	timer    *time.Timer // the retry timer, made at its first use (most QPs never wait)
	scratchL [][]byte
	respFail respFail // set by execute, applied by run (sendMu)
	scratchR [][]byte
	pins     []uint32 // peer MR keys pinned by the executing request
	// ctlPins: the listener's control files a dialer listed as held in
	// its connect, kept mapped until the answer (pinned).
	ctlPins  []kept[fileKey]
	sgeBuf   []transport.SGE
	memReqID uint64

	peer   *peer // set before start, then read-only (its maps: sendMu)
	sock   sock  // the connection's socket, from start (a dialer's: from its request)
	local  net.Addr
	remote net.Addr
	// peerPriv: the peer's private data as it sent it; PeerPrivate pads
	// it to peerPrivLen, as rdma_cm delivers it, at each call (a padded
	// copy kept for the connection's life cost a client end 200 B).
	peerPriv []byte

	sockFD      int                     // sock's descriptor while watched (sockets.mu)
	sockID      int32                   // its registration with the socket poller (sockets.mu)
	peerPrivLen uint8                   // (here, not by peerPriv: it fills sockID's padding)
	memW        atomic.Pointer[memWait] // a memfd request's, made at the first (peer.go)
	// answer: while a dialer waits for the listener's answer, the
	// socket poller hands it each message here instead of serving it
	// (awaitAccept).
	answer atomic.Pointer[answerWait]
	// The retry timer and kicks run service on a goroutine of their own,
	// only while there is something to do: an idle QP has none.
	kicking   atomic.Bool
	svcMu     sync.Mutex
	svcClosed bool // Close ran: service does nothing any more
	hupOnce   sync.Once
	disc      chan struct{} // Disconnected()
	peerGone  atomic.Bool
	discing   atomic.Bool
	// shared: the peer was handed our ring and CQ header. forced: we
	// closed the socket without the peer's word that it stopped (see
	// Close).
	shared, started bool
	forced          atomic.Bool
	early           atomic.Pointer[earlyDial] // ConnectEarly's wait for the answer, until it succeeded
	closed          sync.Once
}

type memReply struct {
	req uint64
	fd  int
}

// memWait is where a memfd request waits: for the reply, or for the peer
// to be gone (hup, closed by hangup). Few connections ever ask (a
// device keeps the arenas its connections fetched), so it is made at
// the first request.
type memWait struct {
	rep chan memReply
	hup chan struct{}
}

// qpLimits is what a QP keeps of its transport.QPConfig: its PD and CQs
// are fields of their own, and its initial receives are posted at
// creation. (Half the size: every connection end holds a QP.)
type qpLimits struct {
	MaxSendWR, MaxRecvWR, MaxSendSGE, MaxRecvSGE, MaxInline int
	RetryCount, RNRRetry                                    int
	MinRNRTimer, Timeout                                    time.Duration
}

func limitsOf(c transport.QPConfig) qpLimits {
	return qpLimits{
		MaxSendWR: c.MaxSendWR, MaxRecvWR: c.MaxRecvWR, MaxSendSGE: c.MaxSendSGE, MaxRecvSGE: c.MaxRecvSGE, MaxInline: c.MaxInline,
		RetryCount: c.RetryCount, RNRRetry: c.RNRRetry, MinRNRTimer: c.MinRNRTimer, Timeout: c.Timeout,
	}
}

func (d *device) newQP(cfg transport.QPConfig) (*qp, error) {
	p, ok := cfg.PD.(*pd)
	if !ok || p == nil || p.dev != d {
		return nil, fmt.Errorf("shm: create QP: PD is not from this shm device: %w", transport.ErrInvalidWR)
	}
	scq, ok1 := cfg.SendCQ.(*cq)
	rcq, ok2 := cfg.RecvCQ.(*cq)
	if !ok1 || !ok2 || scq == nil || rcq == nil {
		return nil, fmt.Errorf("shm: create QP: CQs are not from the shm provider: %w", transport.ErrInvalidWR)
	}
	if scq.dev != d || rcq.dev != d {
		// The peer maps the receive CQ's header and must find nothing
		// of another peer's beside it.
		return nil, fmt.Errorf("shm: create QP: CQs are not from this shm device (each peer process has its own): %w", transport.ErrInvalidWR)
	}
	a := deviceAttr
	if cfg.MaxSendWR < 0 || cfg.MaxSendWR > a.MaxQPWR || cfg.MaxRecvWR < 0 || cfg.MaxRecvWR > a.MaxQPWR ||
		cfg.MaxSendSGE < 0 || cfg.MaxSendSGE > a.MaxSGE || cfg.MaxRecvSGE < 0 || cfg.MaxRecvSGE > a.MaxSGE ||
		cfg.MaxInline < 0 || cfg.MaxInline > a.MaxInline || cfg.RNRRetry < 0 || cfg.RNRRetry > 7 ||
		cfg.RetryCount < 0 || cfg.RetryCount > 7 {
		return nil, fmt.Errorf("shm: create QP: attributes out of range (device limits %+v): %+v: %w", a, cfg, transport.ErrInvalidWR)
	}
	seg, err := newSegment(d.ctl, qpSegSize(cfg.MaxRecvWR, cfg.MaxRecvSGE))
	if err != nil {
		return nil, fmt.Errorf("shm: create QP: %w", err)
	}
	q := &qp{
		dev:  d,
		pd:   p,
		num:  qpNums.Add(1),
		cfg:  limitsOf(cfg),
		scq:  scq,
		rcq:  rcq,
		seg:  seg,
		ring: newRing(seg.mem, cfg.MaxRecvWR, cfg.MaxRecvSGE),
		disc: make(chan struct{}),
	}
	*word32(seg.mem, qpState) = uint32(transport.QPSRTS)
	scq.attach(q, false)
	rcq.attach(q, true)
	if n, err := q.PostRecv(cfg.InitialRecvs...); err != nil || n < len(cfg.InitialRecvs) {
		q.Close()
		return nil, fmt.Errorf("shm: create QP: initial receives: %d of %d posted: %w", n, len(cfg.InitialRecvs), err)
	}
	return q, nil
}

func (q *qp) info(addr net.Addr, private []byte) *qpInfo {
	return &qpInfo{
		num: q.num, pd: q.pd.id, recvCap: uint32(q.cfg.MaxRecvWR), recvSGE: uint32(q.cfg.MaxRecvSGE),
		cqCap: uint32(q.rcq.cap), addr: addrPort(addr), private: private,
	}
}

// shareCtl notes in info the places of the QP ring and of the receive CQ
// header in their arenas, and hands the peer the files it maps (MR
// table, those two arenas): by name (ctlNamed) when held, the inodes the
// peer said it keeps mapped, lists all three; else as descriptors, dups
// the caller closes after sending.
func (q *qp) shareCtl(info *qpInfo, held []uint64) ([]int, error) {
	ringIno, off := q.seg.place()
	cqIno, cqOff, err := q.rcq.place()
	if err != nil {
		return nil, err
	}
	info.ringOff, info.cqOff, info.cqID, info.token = off, cqOff, q.rcq.id, procToken
	q.shared = true
	ctl := [infoFDs]uint64{q.dev.mrs.ino, ringIno, cqIno}
	if holdsAll(held, ctl[:]) {
		info.flags |= ctlNamed
		info.ctl = ctl
		handshakes.named.Add(1)
		return nil, nil
	}
	return q.dupCtl()
}

// dupCtl returns dups of the descriptors of the files the peer maps, in
// the order of qpInfo.ctl.
func (q *qp) dupCtl() ([]int, error) {
	mrt, err := q.dev.mrs.dupFD()
	if err != nil {
		return nil, err
	}
	seg, _, err := q.seg.share()
	if err != nil {
		closeFDs([]int{mrt})
		return nil, fmt.Errorf("shm: share QP ring with peer: %w", err)
	}
	cqh, _, err := q.rcq.share()
	if err != nil {
		closeFDs([]int{mrt, seg})
		return nil, err
	}
	handshakes.fdsSent.Add(1)
	return []int{mrt, seg, cqh}, nil
}

// sendFDs answers msgNeedFDs: the descriptors the connect named.
func (q *qp) sendFDs(s sock) error {
	fds, err := q.dupCtl()
	if err != nil {
		return err
	}
	defer closeFDs(fds)
	return s.send([]byte{msgFDs}, fds...)
}

// pinned keeps pins (pinCtl) until the listener's answer (unpin) or Close.
func (q *qp) pinned(pins []kept[fileKey]) {
	q.sendMu.Lock()
	q.ctlPins = pins
	q.sendMu.Unlock()
}

// unpin takes back the pins pinned kept, for the caller to release.
func (q *qp) unpin() []kept[fileKey] {
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	pins := q.ctlPins
	q.ctlPins = nil
	return pins
}

// start hands the connection's socket to the socket poller (a dialer's
// is there already, waiting for the answer: it is served from now on).
func (q *qp) start(s sock, p *peer, peerPriv []byte, padTo uint8) error {
	q.sock, q.peer, q.peerPriv, q.peerPrivLen = s, p, peerPriv, padTo
	if err := sockets.serve(q); err != nil {
		return err
	}
	q.started = true
	return nil
}

func (q *qp) Num() uint32                   { return q.num }
func (q *qp) State() transport.QPState      { return q.ring.state() }
func (q *qp) LocalAddr() net.Addr           { return q.local }
func (q *qp) RemoteAddr() net.Addr          { return q.remote }
func (q *qp) PeerPrivate() []byte           { return transport.PadPrivate(q.peerPriv, int(q.peerPrivLen)) }
func (q *qp) Disconnected() <-chan struct{} { return q.disc }

// kick runs service soon, on a goroutine of its own (kick's callers hold
// locks service takes).
func (q *qp) kick() {
	if q.kicking.CompareAndSwap(false, true) {
		go func() {
			q.kicking.Store(false)
			q.service()
		}()
	}
}

func sendKick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (q *qp) retireSend(idx uint64) {
	for {
		old := q.sqRetired.Load()
		if idx+1 <= old || q.sqRetired.CompareAndSwap(old, idx+1) {
			return
		}
	}
}

func (q *qp) PostRecv(wrs ...transport.RecvWR) (int, error) {
	q.recvMu.Lock()
	n := 0
	var err error
	for _, wr := range wrs {
		if q.recvGone {
			err = fmt.Errorf("shm: post recv on QP %d: QP destroyed: %w", q.num, transport.ErrQPState)
			break
		}
		if len(wr.SG) > q.cfg.MaxRecvSGE {
			err = fmt.Errorf("shm: post recv on QP %d: %d SGEs, max %d: %w", q.num, len(wr.SG), q.cfg.MaxRecvSGE, transport.ErrInvalidWR)
			break
		}
		if q.rqPosted-q.rqPolled >= q.ring.cap {
			err = fmt.Errorf("shm: post recv on QP %d: %d receives outstanding: %w", q.num, q.ring.cap, transport.ErrQueueFull)
			break
		}
		i := q.rqPosted
		q.setRecvID(i%q.ring.cap, wr.ID)
		q.ring.post(i, wr.SG)
		q.rqPosted++
		n++
	}
	if n > 0 {
		q.ring.publish(q.rqPosted)
	}
	flushed := q.claimForFlushLocked()
	q.recvMu.Unlock()
	if flushed {
		q.rcq.wake()
	}
	return n, err
}

// setRecvID keeps the ID of the receive posted in slot s (recvMu).
func (q *qp) setRecvID(s, id uint64) {
	if q.rqIDs == nil {
		if id == s {
			return
		}
		q.rqIDs = make([]uint64, q.ring.cap)
		for j := range q.rqIDs {
			q.rqIDs[j] = uint64(j)
		}
	}
	q.rqIDs[s] = id
}

func (q *qp) recvID(s uint64) uint64 {
	if q.rqIDs == nil {
		return s
	}
	return q.rqIDs[s]
}

// claimForFlushLocked claims, once the QP is in ERROR, every posted
// receive the peer has not taken, so that Poll reports them flushed.
func (q *qp) claimForFlushLocked() bool {
	if q.ring.state() != transport.QPSErr {
		return false
	}
	for {
		c, p := q.ring.claimed(), q.rqPosted
		if c >= p {
			return false
		}
		if q.ring.casClaimed(c, p) {
			if q.ownFlush == nil {
				q.ownFlush = make([]bool, q.ring.cap)
			}
			for i := c; i < p; i++ {
				q.ownFlush[i%q.ring.cap] = true
			}
			return true
		}
	}
}

// pollRecv moves completed receives into wc (called with the CQ locked)
// and returns how many, and how many of them the peer had counted in the
// CQ header (flushes are produced here and were never counted).
func (q *qp) pollRecv(wc []transport.WorkCompletion) (n, counted int) {
	q.recvMu.Lock()
	defer q.recvMu.Unlock()
	if q.recvGone {
		return 0, 0
	}
	q.claimForFlushLocked()
	gone := q.peerGone.Load()
	for n < len(wc) && q.rqPolled < q.rqPosted {
		i := q.rqPolled
		s := i % q.ring.cap
		w := &wc[n]
		*w = transport.WorkCompletion{}
		if q.ring.completed(i, w) {
			counted++
		} else if (q.ownFlush != nil && q.ownFlush[s]) || (gone && i < q.ring.claimed()) {
			// A slot we claimed in ERROR, or one a dead peer claimed
			// and never completed.
			w.Status = transport.StatusWRFlushErr
			w.Opcode = transport.WCRecv
		} else {
			break // the peer is still working on slot i
		}
		if q.ownFlush != nil {
			q.ownFlush[s] = false
		}
		w.ID = q.recvID(s)
		w.QPNum = q.num
		q.rqPolled++
		q.ring.setPolled(q.rqPolled)
		n++
	}
	return n, counted
}

func (q *qp) SetError() error {
	q.ring.setErr()
	q.sendMu.Lock()
	q.progress()
	q.sendMu.Unlock()
	q.scq.wake()
	q.rcq.wake()
	return nil
}

// service retries work waiting for the responder (RNR, unresponsive
// responder) and flushes the send queue when another goroutine moved the
// QP to ERROR. It runs when the retry timer fires or on a kick.
func (q *qp) service() {
	q.svcMu.Lock()
	defer q.svcMu.Unlock()
	if q.svcClosed {
		return
	}
	q.sendMu.Lock()
	q.progress()
	q.sendMu.Unlock()
	if q.ring.state() == transport.QPSErr {
		q.scq.wake()
		q.rcq.wake()
	}
}

// hangup runs once the peer is gone (DISCONNECT received, socket closed,
// process died): no peer work is in flight any more.
func (q *qp) hangup() { q.hupOnce.Do(q.hangupOnce) }

func (q *qp) hangupOnce() {
	q.peerGone.Store(true)
	q.ring.setErr()
	if w := q.memW.Load(); w != nil {
		close(w.hup) // releases a requester waiting for a memfd reply
	}
	q.sendMu.Lock()
	q.progress()
	q.sendMu.Unlock()
	sockets.remove(q)
	q.sock.close()
	// Unconditionally: a peer may have disarmed a queue and sent a wake-up
	// this reader will never read.
	q.scq.signal()
	q.rcq.signal()
	close(q.disc)
}

// Disconnect moves the QP to ERROR, tells the peer, and waits (bounded)
// for the peer to acknowledge by closing its end.
func (q *qp) Disconnect() error {
	if e := q.early.Load(); e != nil {
		e.end(q)
	}
	if !q.started {
		q.ring.setErr()
		return nil
	}
	if q.discing.Swap(true) {
		<-q.disc
		return nil
	}
	q.ring.setErr()
	q.sendMu.Lock() // after this, no request of ours touches the peer
	q.progress()
	q.sendMu.Unlock()
	q.scq.wake()
	q.rcq.wake()
	select {
	case <-q.disc:
		return nil
	default:
	}
	q.sock.send([]byte{msgDisconnect})
	t := time.NewTimer(time.Second)
	defer t.Stop()
	select {
	case <-q.disc:
	case <-t.C:
		q.forced.Store(true)
		q.hangup()
	}
	return nil
}

func (q *qp) Close() error {
	q.closed.Do(func() {
		q.Disconnect()
		q.svcMu.Lock()
		q.svcClosed = true
		q.svcMu.Unlock()
		releaseKept(q.unpin())
		q.sendMu.Lock()
		if q.timer != nil {
			q.timer.Stop()
		}
		q.ring.setErr()
		q.progress()
		if q.peer != nil {
			q.peer.unmap()
		}
		q.sendMu.Unlock()
		q.peerGone.Store(true)
		q.drainRecv()
		// A peer that said it stopped (its DISCONNECT or its end closed,
		// a dead process included) writes our ring and CQ header no
		// more, and they can be reused. Otherwise a late write could land
		// in the next connection's ring: they are left unused instead.
		clean := !q.shared || (q.started && !q.forced.Load())
		q.scq.detach(q, false, clean)
		q.rcq.detach(q, true, clean)
		if clean {
			q.seg.close()
		} else {
			q.seg.quarantine()
		}
	})
	return nil
}

// drainRecv moves the receive completions nobody polled yet, including
// flushes, into the CQ's local queue: destroying a QP does not remove its
// completions from the CQ in verbs.
func (q *qp) drainRecv() {
	c := q.rcq
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, r := range c.rings {
		if r == q {
			c.rings = append(c.rings[:i], c.rings[i+1:]...)
			break
		}
	}
	var buf [64]transport.WorkCompletion
	for {
		n, counted := q.pollRecv(buf[:])
		if !c.closed {
			for _, w := range buf[:n] {
				c.local = append(c.local, cqe{wc: w})
			}
			// Local entries are all counted; flushes were not yet.
			if flushes := n - counted; flushes > 0 {
				atomic.AddUint64(word64(c.hdr, cqCount), uint64(flushes))
			}
		}
		if n < len(buf) {
			break
		}
	}
	q.recvMu.Lock()
	q.recvGone = true
	q.recvMu.Unlock()
}

// earlyDial is the wait of a QP of ConnectEarly for the listener's
// answer: Established runs it, Disconnect ends it. A wait that failed is
// kept, for its error; one that succeeded is dropped.
type earlyDial struct {
	cred *unix.Ucred // the socket's peer's, when the dial knew it (DeviceFor)
	addr string
	wg   sync.WaitGroup // a wait that started

	mu      sync.Mutex
	waiting bool          // a wait started
	ended   bool          // Disconnect ran: no wait may start
	reading bool          // the wait reads the answer: end makes the read fail
	ready   chan struct{} // the wait's, while reading
	err     error         // the wait's outcome, once wg is done
}

// Established implements transport.EarlyQP. A QP of Connect or Accept is
// established already.
func (q *qp) Established(ctx context.Context) error { return q.establish(ctx, time.Time{}) }

// EstablishedBy implements transport.DeadlineEstablisher.
// Background has no Done channel: nothing is registered for it.
func (q *qp) EstablishedBy(deadline time.Time) error {
	return q.establish(context.Background(), deadline)
}

func (q *qp) establish(ctx context.Context, deadline time.Time) error {
	e := q.early.Load()
	if e == nil {
		return nil
	}
	e.mu.Lock()
	switch {
	case e.waiting:
		e.mu.Unlock()
		e.wg.Wait()
		return e.err
	case e.ended:
		e.mu.Unlock()
		return fmt.Errorf("shm: connect to %s: %w", e.addr, net.ErrClosed)
	}
	e.waiting = true
	e.wg.Add(1)
	e.mu.Unlock()
	err := q.awaitAccept(ctx, deadline, e.cred, e.addr, e)
	e.mu.Lock()
	e.err = err
	e.mu.Unlock()
	if err == nil {
		q.early.Store(nil) // established: nothing of the wait is kept
	}
	e.wg.Done()
	return err
}

// startRead marks the answer's wait begun on ready, unless Disconnect
// came first.
func (e *earlyDial) startRead(ready chan struct{}) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reading, e.ready = !e.ended, ready
	return e.reading
}

// stopRead marks it over and reports whether Disconnect came meanwhile.
func (e *earlyDial) stopRead() (ended bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reading = false
	return e.ended
}

// end stops the wait of q's answer under way, which returns an error
// unless the answer was read already, and waits for it; a request never
// waited for is abandoned with its socket.
func (e *earlyDial) end(q *qp) {
	e.mu.Lock()
	first := !e.ended
	e.ended = true
	waiting := e.waiting
	if e.reading {
		// Under mu, so the wait sees it or has not begun (startRead
		// then refuses): it fails now rather than at its deadline.
		select {
		case e.ready <- struct{}{}:
		default: // the answer is there, unread: the wait ends anyway
		}
	}
	e.mu.Unlock()
	if !waiting {
		if first {
			q.sock.close()
		}
		return
	}
	e.wg.Wait()
}
