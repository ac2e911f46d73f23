package conn

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Work request ids: data sends carry their sequence number; control
// messages have the top bit set.
const ctlID = 1 << 63

var connIDs atomic.Uint64

// Conn is an RDMA connection. It implements net.Conn; Stats and CloseWrite
// are its additions.
type Conn struct {
	id       uint64
	provider string
	qp       transport.QP
	pd       transport.PD
	cq       transport.CQ
	pool     *bufpool.Pool
	ring     *bufpool.Buffer // the peer writes here
	stage    *bufpool.Buffer // we copy here before writing to the peer
	slotSize int             // of our ring and staging
	slots    int
	peer     hello

	rmu, wmu sync.Mutex // one reader, one writer at a time

	mu      sync.Mutex
	changed chan struct{} // closed and replaced on every state change
	// sending
	credits    int    // free slots of the peer's ring
	sendSeq    uint64 // data messages posted
	sendsDone  uint64 // data messages completed
	ctlPending int    // control messages posted, not completed
	creditOut  bool   // a credit message is in flight
	wclosed    bool
	// receiving
	recvLens []int  // lengths of filled slots, oldest first
	recvSeq  uint64 // messages consumed
	readOff  int
	freed    int // slots consumed, not yet returned to the peer
	eofIn    bool
	// lifecycle
	closed bool
	err    error
	rdl    time.Time
	wdl    time.Time
	st     Stats

	stopPoll context.CancelFunc
	pollDone chan struct{}
}

// newConn prepares a connection's memory and queues; start finishes it
// once the QP exists.
func newConn(provider string, dev transport.Device, o *options) (c *Conn, cfg transport.QPConfig, err error) {
	c = &Conn{id: connIDs.Add(1), provider: provider, slotSize: o.slotSize, slots: o.slotCount, changed: make(chan struct{})}
	defer func() {
		if err != nil {
			c.release()
		}
	}()
	if c.pd, err = dev.AllocPD(); err != nil {
		return nil, cfg, fmt.Errorf("conn: allocate protection domain: %w", err)
	}
	if c.pool, err = bufpool.New(dev, c.pd, bufpool.Options{Budget: o.budget}); err != nil {
		return nil, cfg, err
	}
	size := o.slotSize * o.slotCount
	if c.ring, err = c.pool.Get(bufpool.Owner(c.id), size, transport.AccessLocalWrite|transport.AccessRemoteWrite); err != nil {
		return nil, cfg, fmt.Errorf("conn: receive buffers: %w", err)
	}
	if c.stage, err = c.pool.Get(bufpool.Owner(c.id), size, transport.AccessLocalWrite); err != nil {
		return nil, cfg, fmt.Errorf("conn: send buffers: %w", err)
	}
	recvs := 2*o.slotCount + 4
	if c.cq, err = dev.CreateCQ(2 * (recvs + 2*o.slotCount + 8)); err != nil {
		return nil, cfg, fmt.Errorf("conn: completion queue: %w", err)
	}
	cfg = transport.QPConfig{
		PD: c.pd, SendCQ: c.cq, RecvCQ: c.cq,
		MaxSendWR: 2*o.slotCount + 8, MaxRecvWR: recvs, MaxSendSGE: 1, MaxRecvSGE: 1,
		RetryCount: 7, RNRRetry: 7, MinRNRTimer: time.Millisecond,
	}
	return c, cfg, nil
}

func (c *Conn) hello() hello {
	return hello{ringAddr: c.ring.Addr(), ringRKey: c.ring.RKey(), slotSize: uint32(c.slotSize), slotCount: uint32(c.slots)}
}

// start posts the receives and starts the completion loop.
func (c *Conn) start(qp transport.QP, peer hello) error {
	c.qp, c.peer, c.credits = qp, peer, int(peer.slotCount)
	for i := range c.qpRecvs() {
		if _, err := qp.PostRecv(transport.RecvWR{ID: uint64(i)}); err != nil {
			return fmt.Errorf("conn: post receives: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.stopPoll, c.pollDone = cancel, make(chan struct{})
	go c.poll(ctx)
	return nil
}

func (c *Conn) qpRecvs() int { return 2*c.slots + 4 }

// chunk is the largest message: a slot, ours and the peer's.
func (c *Conn) chunk() int { return min(c.slotSize, int(c.peer.slotSize)) }

func (c *Conn) broadcastLocked() {
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
// is held on entry and on return.
func (c *Conn) waitLocked(deadline time.Time) {
	ch := c.changed
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
	return &net.OpError{Op: op, Net: "rdma", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

func expired(dl time.Time) bool { return !dl.IsZero() && !time.Now().Before(dl) }

// Read reads data written by the peer; io.EOF once the peer closed its
// direction and everything before was read.
func (c *Conn) Read(b []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	c.mu.Lock()
	for {
		switch {
		case c.closed:
			c.mu.Unlock()
			return 0, c.opErr("read", net.ErrClosed)
		case expired(c.rdl):
			c.mu.Unlock()
			return 0, c.opErr("read", os.ErrDeadlineExceeded)
		case len(c.recvLens) > 0:
		case c.eofIn:
			c.mu.Unlock()
			return 0, io.EOF
		case c.err != nil:
			err := c.err
			c.mu.Unlock()
			return 0, c.opErr("read", err)
		case len(b) == 0:
			c.mu.Unlock()
			return 0, nil
		default:
			c.waitLocked(c.rdl)
			continue
		}
		break
	}
	n, off := c.recvLens[0], int(c.recvSeq%uint64(c.slots))*c.slotSize
	src := c.ring.Bytes()[off+c.readOff : off+n]
	c.mu.Unlock()
	k := copy(b, src) // the slot stays ours until its credit goes back
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readOff += k
	c.st.BytesIn += uint64(k)
	if c.readOff == n {
		c.recvLens = c.recvLens[1:]
		c.recvSeq++
		c.readOff = 0
		c.freed++
		c.returnCreditsLocked()
	}
	return k, nil
}

// returnCreditsLocked sends freed slots back in a credit message once
// half the ring is free and no credit message is already on its way
// (data messages carry credits too).
func (c *Conn) returnCreditsLocked() {
	if c.creditOut || c.freed < max(1, c.slots/2) || c.err != nil {
		return
	}
	n := min(c.freed, maxCredits)
	if err := c.postCtlLocked(kindCredit, n); err != nil {
		c.failLocked(err)
		return
	}
	c.freed -= n
	c.creditOut = true
}

func (c *Conn) postCtlLocked(kind, credits int) error {
	_, err := c.qp.PostSend(transport.SendWR{
		ID: ctlID | uint64(kind), Opcode: transport.OpWriteWithImm, Signaled: true,
		RemoteAddr: c.peer.ringAddr, RKey: c.peer.ringRKey, Imm: encodeImm(kind, credits, 0),
	})
	if err != nil {
		return fmt.Errorf("conn: post control message: %w", err)
	}
	c.ctlPending++
	c.st.MessagesOut++
	return nil
}

// Write copies b into the staging slots and writes it into the peer's
// ring, a slot per message, waiting for credits when the ring is full.
func (c *Conn) Write(b []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	n := 0
	for {
		c.mu.Lock()
		stalled := false
		for {
			err := c.writeErrLocked()
			if err != nil {
				c.mu.Unlock()
				return n, c.opErr("write", err)
			}
			if len(b) == 0 || (c.credits > 0 && c.sendSeq-c.sendsDone < uint64(c.slots)) {
				break
			}
			if !stalled {
				stalled = true
				c.st.CreditStalls++
			}
			c.waitLocked(c.wdl)
		}
		if len(b) == 0 {
			c.mu.Unlock()
			return n, nil
		}
		seq := c.sendSeq
		c.sendSeq++
		c.credits--
		ret := min(c.freed, maxCredits)
		c.freed -= ret
		c.mu.Unlock()

		k := min(len(b), c.chunk())
		off := int(seq%uint64(c.slots)) * c.slotSize
		copy(c.stage.Bytes()[off:], b[:k])
		remote := c.peer.ringAddr + (seq%uint64(c.peer.slotCount))*uint64(c.peer.slotSize)
		_, err := c.qp.PostSend(transport.SendWR{
			ID: seq, Opcode: transport.OpWriteWithImm, Signaled: true,
			SG:         []transport.SGE{{Addr: c.stage.Addr() + uint64(off), Length: uint32(k), LKey: c.stage.LKey()}},
			RemoteAddr: remote, RKey: c.peer.ringRKey, Imm: encodeImm(kindData, ret, k),
		})
		c.mu.Lock()
		if err != nil {
			c.failLocked(fmt.Errorf("conn: post write: %w", err))
			c.mu.Unlock()
			return n, c.opErr("write", c.err)
		}
		c.st.BytesOut += uint64(k)
		c.st.MessagesOut++
		c.mu.Unlock()
		n += k
		b = b[k:]
	}
}

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
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
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
	return c.postCtlLocked(kindEOF, 0)
}

// drainTimeout bounds how long Close waits for written data to be
// acknowledged before it disconnects.
const drainTimeout = 2 * time.Second

// Close sends what was written, tells the peer (which reads io.EOF),
// disconnects and releases every resource of the connection.
func (c *Conn) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return c.opErr("close", net.ErrClosed)
	}
	c.closed = true
	c.broadcastLocked()
	c.mu.Unlock()

	c.wmu.Lock() // blocked writers have seen closed and left
	c.mu.Lock()
	c.sendEOFLocked()
	deadline := time.Now().Add(drainTimeout)
	for c.err == nil && (c.sendsDone < c.sendSeq || c.ctlPending > 0) && time.Now().Before(deadline) {
		c.waitLocked(deadline)
	}
	c.mu.Unlock()
	c.wmu.Unlock()

	c.qp.Disconnect()
	c.stopPoll()
	<-c.pollDone
	c.release()
	return nil
}

// release frees what newConn and start created, in reverse order.
func (c *Conn) release() {
	if c.qp != nil {
		c.qp.Close()
	}
	if c.cq != nil {
		c.cq.Close()
	}
	for _, b := range []*bufpool.Buffer{c.ring, c.stage} {
		if b != nil {
			b.Release()
		}
	}
	if c.pool != nil {
		c.pool.Close()
	}
	if c.pd != nil {
		c.pd.Close()
	}
}

func (c *Conn) LocalAddr() net.Addr  { return c.qp.LocalAddr() }
func (c *Conn) RemoteAddr() net.Addr { return c.qp.RemoteAddr() }

func (c *Conn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rdl, c.wdl = t, t
	c.broadcastLocked()
	return nil
}

func (c *Conn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rdl = t
	c.broadcastLocked()
	return nil
}

func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wdl = t
	c.broadcastLocked()
	return nil
}
