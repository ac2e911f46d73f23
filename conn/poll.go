package conn

import (
	"context"
	"errors"
	"fmt"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// poll is the connection's completion loop: poll, arm, poll again, then
// sleep on the CQ's file descriptor in the netpoller. It owns no OS
// thread while idle and exits when Close cancels ctx.
func (c *Conn) poll(ctx context.Context) {
	defer close(c.pollDone)
	wcs := make([]transport.WorkCompletion, 32)
	armed := false
	for {
		n, err := c.cq.Poll(wcs)
		if err != nil {
			c.fail(fmt.Errorf("conn: completion queue: %w", err))
			return
		}
		if n > 0 {
			c.handle(wcs[:n])
			armed = false
			continue
		}
		if !armed {
			if err := c.cq.ReqNotify(); err != nil {
				c.fail(fmt.Errorf("conn: arm completion queue: %w", err))
				return
			}
			armed = true
			continue // a completion may have landed before arming
		}
		if err := c.cq.Wait(ctx); err != nil {
			if ctx.Err() == nil {
				c.fail(fmt.Errorf("conn: wait for completions: %w", err))
			}
			return
		}
		armed = false
	}
}

func (c *Conn) fail(err error) {
	c.mu.Lock()
	c.failLocked(err)
	c.mu.Unlock()
}

var errProtocol = errors.New("conn: peer broke the protocol")

func (c *Conn) handle(wcs []transport.WorkCompletion) {
	c.mu.Lock()
	defer c.mu.Unlock()
	defer c.broadcastLocked()
	for i := range wcs {
		wc := &wcs[i]
		if wc.Status != transport.StatusSuccess {
			if c.closed {
				continue // our own teardown flushing
			}
			if c.eofIn && wc.Status == transport.StatusWRFlushErr {
				c.failLocked(fmt.Errorf("conn: peer %v closed the connection", c.qp.RemoteAddr()))
				continue
			}
			c.failLocked(fmt.Errorf("conn: connection to %v lost: %w", c.qp.RemoteAddr(), wc.Err()))
			continue
		}
		switch {
		case wc.Opcode == transport.WCRecvRDMAWithImm:
			if err := c.receivedLocked(wc.Imm); err != nil {
				c.failLocked(err)
				c.qp.SetError()
				continue
			}
			if _, err := c.qp.PostRecv(transport.RecvWR{ID: wc.ID}); err != nil && !c.closed {
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
		default:
			c.tx[wc.ID>>idRing&1].done++
		}
	}
}

// receivedLocked accounts one incoming message; everything in its
// immediate is checked against what this connection granted.
func (c *Conn) receivedLocked(imm uint32) error {
	kind, ring, credits, n := decodeImm(imm)
	if t := &c.tx[ring]; credits > 0 {
		t.credits += credits
		if t.credits > t.count {
			return fmt.Errorf("%w: %d credits for a ring of %d slots", errProtocol, t.credits, t.count)
		}
	}
	c.st.MessagesIn++
	switch kind {
	case kindSmall, kindLarge:
		r := &c.rx[kind-kindSmall]
		if r.buf == nil || n == 0 || n > r.size || r.inUse >= r.count || c.eofIn {
			return fmt.Errorf("%w: data message of %d bytes into ring %d (%d of %d slots full)", errProtocol, n, kind, r.inUse, r.count)
		}
		slot := r.arrived % uint64(r.count)
		r.arrived++
		r.inUse++
		c.recvQ = append(c.recvQ, entry{ring: uint8(kind - kindSmall), slot: int32(slot), n: int32(n)})
		if kind == kindSmall {
			c.st.SmallDataIn++
		} else {
			c.st.LargeDataIn++
		}
	case kindControl:
		r := &c.rx[small]
		if n != recordLen || r.inUse >= r.count {
			return fmt.Errorf("%w: control record of %d bytes", errProtocol, n)
		}
		slot := int(r.arrived % uint64(r.count))
		r.arrived++
		rec, err := decodeRecord(r.buf.Bytes()[slot*r.size : slot*r.size+n])
		r.freed++ // read at once: the slot is free again
		c.returnCreditsLocked()
		if err != nil {
			// M3: a torn or corrupt record counts as not received; the
			// writer's time-out and retry recover from it.
			c.st.BadRecords++
			return nil
		}
		c.recordLocked(rec)
	case kindCredit:
	case kindEOF:
		c.eofIn = true
	default:
		return fmt.Errorf("%w: message kind %d", errProtocol, kind)
	}
	return nil
}
