package conn

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Rendezvous: a message above the rendezvous threshold is not pushed
// through the rings. The writer (the holder) copies it into registered
// memory of its own and advertises it; the reader, when it reads, asks for
// exactly the part it has a destination for, naming source and
// destination segments; the holder checks the source against what it
// advertised on this connection and RDMA-writes into the destination, the
// last segment with the request's sequence in its immediate. That
// immediate completes the read: the data is then copied once, into the
// reader's slice.
//
// The holder's memory is never remotely accessible: the peer only names
// it, and the holder does the writes. The token in an advert makes a
// request for a message that is no longer advertised fail even when its
// sequence number comes round again.

const (
	// rdvRing marks a recvQ entry that is a rendezvous message.
	rdvRing = 2
	// rdvSegment is the largest single RDMA write of a transfer.
	rdvSegment = 1 << 20
	// idRdv marks the work requests of a transfer (the holder's writes).
	idRdv = 1 << 60
)

var errPeerClosed = errors.New("conn: the peer closed the connection and reads no more")

var errRefusedRead = errors.New("conn: refused the peer's read request")

// advert is a message this side holds for the peer.
type advert struct {
	seq, token uint32
	buf        *bufpool.Buffer
	size       int
	requested  int // bytes asked for: the next request must start here
	written    int // bytes whose writes completed
	start      time.Time
}

// inAdvert is a message the peer holds for us, in stream order.
type inAdvert struct {
	seq, token uint32
	addr       uint64
	size       int
	requested  int
}

// readReq is one of this side's read requests: at most two are out at a
// time (prefetchLocked).
type readReq struct {
	active, landed bool
	seq            uint32
	dst            *bufpool.Buffer
	n, off         int // bytes requested; bytes copied out
	start          time.Time
}

type rendezvous struct {
	// as holder
	seq     uint32
	out     []*advert
	serving []int // bytes of each request being written, in order
	// peerClosed: the peer reads no more; what it did not fetch is lost,
	// as unread data is when a TCP peer closes.
	peerClosed bool
	// as reader
	in  []inAdvert
	req readReq
	// next: the request for the advert after req's, sent while req's is
	// outstanding or being copied out (prefetchLocked); it becomes req
	// when req's copy is done. Allocated at the first (an idle
	// connection keeps none: rdmaConn's size).
	next   *readReq
	reqSeq uint32
}

// writeRendezvous sends b by rendezvous, a chunk (an advert) at a time; c.wmu is
// held. When no registered memory can be had for a chunk (the budget),
// that chunk goes through the rings instead: the data always goes through.
func (c *rdmaConn) writeRendezvous(b []byte) (int, error) {
	n := 0
	for len(b) > 0 {
		k := min(len(b), c.o.rdvChunk)
		c.mu.Lock()
		for {
			ch := c.changed
			err := c.writeErrLocked()
			if err == nil && c.rdv.peerClosed {
				err = errPeerClosed
			}
			if err != nil {
				c.mu.Unlock()
				return n, c.opErr("write", err)
			}
			if len(c.rdv.out) < maxAdverts {
				break
			}
			c.waitLocked(ch, c.wdl)
		}
		c.mu.Unlock()
		buf, err := c.pool.Get(bufpool.Owner(c.id), k, transport.AccessLocalWrite)
		if err != nil {
			c.mu.Lock()
			c.st.RendezvousFallbacks++
			c.mu.Unlock()
			if len(b) > c.o.threshold {
				if err := c.enlarge(); err != nil {
					return n, c.opErr("write", err)
				}
			}
			m, err := c.write(b[:k])
			n += m
			if err != nil {
				return n, err
			}
			b = b[k:]
			continue
		}
		copy(buf.Bytes(), b[:k])
		c.mu.Lock()
		c.rdv.seq++
		a := &advert{seq: c.rdv.seq, token: rand.Uint32(), buf: buf, size: k, start: time.Now()}
		c.rdv.out = append(c.rdv.out, a)
		err = c.sendRecordLocked(record{typ: recAdvert, seq: a.seq, addr: buf.Addr(), rkey: a.token, size: uint32(k)}, c.wdl, true)
		if err != nil {
			// Not advertised: take it back.
			c.rdv.out = c.rdv.out[:len(c.rdv.out)-1]
			buf.Release()
			c.mu.Unlock()
			return n, c.opErr("write", err)
		}
		c.st.Rendezvous++
		c.tel.RendezvousOut(k)
		c.st.BytesOut += uint64(k)
		c.mu.Unlock()
		n += k
		b = b[k:]
	}
	return n, nil
}

// advertLocked queues a message the peer holds for us (poller).
func (c *rdmaConn) advertLocked(r record) error {
	if c.discarding {
		return nil // closed: the peer knows we fetch nothing more
	}
	if c.eofIn {
		return fmt.Errorf("%w: rendezvous advert after end of stream", errProtocol)
	}
	// The holder advertises again once the writes of an earlier advert
	// completed, which may be before we copied that one out: an advert
	// whose last request landed is over for the holder.
	outstanding := len(c.rdv.in)
	if q := c.rdv.req; outstanding > 0 && q.landed && c.rdv.in[0].requested == c.rdv.in[0].size {
		outstanding--
		if q := c.rdv.next; outstanding > 0 && q != nil && q.landed && c.rdv.in[1].requested == c.rdv.in[1].size {
			outstanding--
		}
	}
	if outstanding >= maxAdverts {
		return fmt.Errorf("%w: more than %d rendezvous adverts outstanding", errProtocol, maxAdverts)
	}
	c.rdv.in = append(c.rdv.in, inAdvert{seq: r.seq, token: r.rkey, addr: r.addr, size: int(r.size)})
	c.recvQ = append(c.recvQ, entry{ring: rdvRing})
	c.st.RendezvousIn++
	c.tel.RendezvousIn()
	return nil
}

// serveReadLocked checks a read request against what this connection
// advertised and writes the data (poller). Requests must come in order:
// the first advert not fully asked for, from where the last one ended.
func (c *rdmaConn) serveReadLocked(r record) error {
	var a *advert
	for _, x := range c.rdv.out {
		if x.requested < x.size {
			a = x
			break
		}
	}
	switch {
	case a == nil:
		return fmt.Errorf("%w: read request %d with nothing advertised", errRefusedRead, r.seq)
	case r.count != a.seq:
		return fmt.Errorf("%w: read request for advert %d, the pending one is %d", errRefusedRead, r.count, a.seq)
	case r.rkey != a.token:
		return fmt.Errorf("%w: wrong token for advert %d", errRefusedRead, a.seq)
	case r.addr != a.buf.Addr()+uint64(a.requested) || int64(r.size) > int64(a.size-a.requested):
		return fmt.Errorf("%w: source %#x+%d is not the next part of advert %d (%#x+%d, %d asked for)",
			errRefusedRead, r.addr, r.size, a.seq, a.buf.Addr(), a.size, a.requested)
	case len(c.rdv.serving) >= maxServing:
		return fmt.Errorf("%w: more than %d read requests at once", errRefusedRead, maxServing)
	}
	n := int(r.size)
	off := a.requested
	for done := 0; done < n; {
		k := min(n-done, rdvSegment)
		wr := transport.SendWR{
			ID: idRdv | uint64(r.seq), Opcode: transport.OpWrite,
			SG:         []transport.SGE{{Addr: a.buf.Addr() + uint64(off+done), Length: uint32(k), LKey: a.buf.LKey()}},
			RemoteAddr: r.addr2 + uint64(done), RKey: r.rkey2,
		}
		if done+k == n {
			cring, credits := c.takeCreditsLocked()
			wr.Opcode, wr.Signaled = transport.OpWriteWithImm, true
			wr.Imm = encodeImm(kindReadEnd, cring, credits, int(r.seq&maxLen))
		}
		if _, err := c.qp.PostSend(wr); err != nil {
			return fmt.Errorf("conn: post rendezvous write: %w", err)
		}
		done += k
	}
	a.requested += n
	c.rdv.serving = append(c.rdv.serving, n)
	c.st.MessagesOut++
	return nil
}

// servedLocked accounts the completion of a read request's writes.
func (c *rdmaConn) servedLocked() error {
	if len(c.rdv.serving) == 0 || len(c.rdv.out) == 0 {
		return fmt.Errorf("%w: rendezvous completion with no transfer", errProtocol)
	}
	n := c.rdv.serving[0]
	c.rdv.serving = c.rdv.serving[1:]
	a := c.rdv.out[0]
	a.written += n
	if a.written == a.size {
		if c.rpcsInFlight() {
			now := time.Now()
			c.rpcEvent(telemetry.EventRPCRdvSent, now, trace.SpanContext{},
				telemetry.KeyRdvBytes.Int(a.size), telemetry.KeyRdvDuration.Float64(now.Sub(a.start).Seconds()))
		}
		a.buf.Release()
		c.rdv.out = c.rdv.out[1:]
	}
	return nil
}

// readEndLocked completes our oldest outstanding read request (poller):
// the holder serves them in order.
func (c *rdmaConn) readEndLocked(seq int) error {
	q := &c.rdv.req
	if q.landed && c.rdv.next != nil {
		q = c.rdv.next
	}
	if !q.active || q.landed || uint32(seq) != q.seq&maxLen {
		return fmt.Errorf("%w: end of read request %d, none such outstanding", errProtocol, seq)
	}
	q.landed = true
	c.tel.ReadLanded(q.n)
	c.st.RendezvousBytesIn += uint64(q.n)
	c.st.LastRendezvousDuration = time.Since(q.start)
	if c.rpcsInFlight() {
		c.rpcEvent(telemetry.EventRPCRdvReceived, q.start.Add(c.st.LastRendezvousDuration), trace.SpanContext{},
			telemetry.KeyRdvBytes.Int(q.n), telemetry.KeyRdvDuration.Float64(c.st.LastRendezvousDuration.Seconds()))
	}
	return nil
}

// minRdvRequest is the smallest read request a reader short of
// registered memory falls back to: the pool's smallest class.
const minRdvRequest = bufpool.DefaultMinSize

// rendezvousDest gets registered memory for a read request of up to k
// bytes, called with c.rmu held and c.mu not. Under budget pressure it
// asks for less, halving down to minRdvRequest (a read request may name
// any part of an advert). When not even that fits, it takes one page
// beyond the budget (bufpool's GetOverdraft): waiting instead could wait
// forever, for the budget may be full of the very source the peer holds
// for us (both ends in one process), or of memory held as long as this
// stream is stuck. A budget shortage slows a stream down to a page per
// round trip; it never breaks it. It returns the buffer and the bytes to
// ask for.
func (c *rdmaConn) rendezvousDest(k int) (*bufpool.Buffer, int, error) {
	const access = transport.AccessLocalWrite | transport.AccessRemoteWrite
	for n := k; ; n = max(n/2, minRdvRequest) {
		dst, err := c.pool.Get(bufpool.Owner(c.id), n, access)
		if err == nil {
			if n < k {
				c.mu.Lock()
				c.st.RendezvousShortReads++
				c.mu.Unlock()
			}
			return dst, n, nil
		}
		if !errors.Is(err, bufpool.ErrBudget) {
			return nil, n, err
		}
		if n <= minRdvRequest {
			break
		}
	}
	n := min(k, minRdvRequest)
	dst, err := c.pool.GetOverdraft(bufpool.Owner(c.id), n, access)
	if err != nil {
		return nil, n, err
	}
	c.mu.Lock()
	c.st.RendezvousShortReads++
	c.st.BudgetOverdrafts++
	c.mu.Unlock()
	return dst, n, nil
}

// readRendezvousLocked serves Read from the rendezvous message at the
// head of the stream: it asks for the next part when no request is out,
// waits for it to land, then copies. c.rmu and c.mu are held; done
// reports whether Read should return (n, err), else it waits and retries.
func (c *rdmaConn) readRendezvousLocked(b []byte) (n int, err error, done bool) {
	a := &c.rdv.in[0]
	q := &c.rdv.req
	if !q.active {
		if c.err != nil {
			return 0, c.opErr("read", c.err), true
		}
		k := min(a.size-a.requested, c.o.rdvChunk)
		c.mu.Unlock()
		dst, k, gerr := c.rendezvousDest(k)
		c.mu.Lock()
		if gerr != nil {
			// No way to take the data: the stream cannot go on.
			c.failLocked(fmt.Errorf("conn: rendezvous destination of %d bytes: %w", k, gerr))
			return 0, c.opErr("read", c.err), true
		}
		if serr := c.requestReadLocked(q, 0, dst, k); serr != nil {
			return 0, c.opErr("read", serr), true
		}
	}
	c.prefetchLocked()
	a = &c.rdv.in[0] // either may have waited, and the queue grown
	if !q.landed {
		return 0, nil, false
	}
	k := copy(b, q.dst.Bytes()[q.off:q.n])
	q.off += k
	c.st.BytesIn += uint64(k)
	if q.off == q.n {
		q.dst.Release()
		*q = readReq{}
		if n := c.rdv.next; n != nil {
			*q, *n = *n, readReq{}
		}
		if a.requested == a.size {
			c.rdv.in = c.rdv.in[1:]
			c.recvQ = c.recvQ[1:]
		}
	}
	return k, nil, true
}

// prefetchLocked asks for the advert after the head's as soon as the
// head's last request went out: the holder finds the next request queued
// when it has posted the writes of one, and posts the next at once,
// rather than after a read end reached the reader, woke it, its copy was
// done and its next request reached a holder asleep by then: two
// wake-ups in series per message, milliseconds each in the rxe guest
// (perftest keeps its send queue full the same way). At most two
// requests are outstanding, and the second only when it can go at once:
// registered memory for what it asks (the advert, up to our chunk size)
// without waiting or overdraft, the record slot free, a credit;
// otherwise the next advert is asked for as before, when the reader
// reaches it. c.rmu and c.mu are held.
func (c *rdmaConn) prefetchLocked() {
	ready := func() bool {
		return len(c.rdv.in) > 1 && c.rdv.in[0].requested == c.rdv.in[0].size && c.rdv.in[1].requested == 0 &&
			(c.rdv.next == nil || !c.rdv.next.active) && c.err == nil && !c.closed &&
			// Not the last credit: that one stays for the request the
			// reader needs when it reaches an advert (sendRecordLocked).
			!c.recordOut && c.tx[c.sending].canSendRecord(false) && !c.posting && !c.enl.parked
	}
	if !ready() {
		return
	}
	k := min(c.rdv.in[1].size, c.o.rdvChunk)
	c.mu.Unlock()
	dst, err := c.pool.Get(bufpool.Owner(c.id), k, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	c.mu.Lock()
	if err != nil {
		return
	}
	if !ready() { // the poller or a writer moved on meanwhile
		dst.Release()
		return
	}
	if c.rdv.next == nil {
		c.rdv.next = new(readReq)
	}
	if c.requestReadLocked(c.rdv.next, 1, dst, k) == nil {
		c.st.RendezvousPrefetches++
	}
}

// requestReadLocked sends q, the read request for the next k bytes of
// advert c.rdv.in[i] into dst, and accounts them as requested; on an
// error dst is released and q left inactive. c.mu is held.
func (c *rdmaConn) requestReadLocked(q *readReq, i int, dst *bufpool.Buffer, k int) error {
	a := &c.rdv.in[i]
	c.rdv.reqSeq++
	*q = readReq{active: true, seq: c.rdv.reqSeq, dst: dst, n: k, start: time.Now()}
	r := record{typ: recRead, seq: q.seq, count: a.seq, rkey: a.token, addr: a.addr + uint64(a.requested), size: uint32(k),
		addr2: dst.Addr(), rkey2: dst.RKey()}
	if err := c.sendRecordLocked(r, c.rdl, true); err != nil {
		dst.Release()
		*q = readReq{}
		c.rdv.reqSeq--
		return err
	}
	a = &c.rdv.in[i] // sending may have waited, and the queue grown
	a.requested += k
	c.tel.ReadRequested(q.seq, a.seq, k, q.start)
	return nil
}

// spillLocked is called by a reader that must ask for the rendezvous
// message at the head of its stream and has no credit to do it with. The
// peer may be in the same state: its reader at one of our messages, with
// no credit either, because our ring is full of its data queued behind
// the message we wait for and of its read requests after that data (a
// slot is released only after those before it). Neither could ask: a
// deadlock. So when one of our rings is full (the peer can send nothing
// into it), we copy the oldest messages queued behind the head into
// memory of our own until a slot is free, and give it back at once. The
// peer's writer never takes its last credit (receivedLocked enforces
// it), so that one goes to its read request: the peer reads on, and
// gives us the credit we wait for. A ring that is not full is never
// spilled, so a peer that writes and does not read meets back-pressure as
// before.
//
// The copies are bounded by maxSpillLocked whatever the peer does: a peer
// that alternates data with records it does not need (torn ones count as
// not received) could otherwise refill the ring after every spill. At
// the bound the reader stops spilling and waits, as TCP's receiver does
// with a full window: memory stays bounded, and a legitimate peer, whose
// reader a single spill unblocks, never comes near it.
func (c *rdmaConn) spillLocked() {
	spilled := false
	for ring := range c.rx {
		r := &c.rx[ring]
		for i := 1; i < len(c.recvQ) && r.buf != nil && r.full(); i++ {
			e := &c.recvQ[i] // the head is the rendezvous message
			if int(e.ring) != ring || e.spill != nil {
				continue
			}
			if c.spilled+int(e.n) > c.maxSpillLocked() {
				c.st.SpillRefusals++
				break
			}
			off := int(e.slot) * r.size
			e.spill = bytes.Clone(r.buf.Bytes()[off : off+int(e.n)])
			c.spilled += int(e.n)
			r.consumeNow(int(e.slot))
			c.st.SpilledBytes += uint64(e.n)
			spilled = true
		}
	}
	if spilled {
		c.returnCreditsLocked()
		c.ringsConsumedLocked()
	}
}

// maxSpillLocked bounds the bytes held in spill copies at once: what the
// receive rings hold, so a connection's peer-driven memory is at most
// twice its rings.
func (c *rdmaConn) maxSpillLocked() int {
	n := c.o.slotSize * c.o.slotCount
	if c.rx[large].buf != nil {
		n += c.rx[large].size * c.rx[large].count
	}
	return n
}

// releaseRendezvous gives back the memory of transfers cut short.
func (c *rdmaConn) releaseRendezvous() {
	for _, a := range c.rdv.out {
		a.buf.Release()
	}
	c.rdv.out = nil
	for _, q := range []*readReq{&c.rdv.req, c.rdv.next} {
		if q != nil && q.dst != nil {
			q.dst.Release()
			q.dst = nil
		}
	}
}
