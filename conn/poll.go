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
		switch wc.Opcode {
		case transport.WCRecvRDMAWithImm:
			if err := c.receivedLocked(wc.Imm); err != nil {
				c.failLocked(err)
				c.qp.SetError()
				continue
			}
			if _, err := c.qp.PostRecv(transport.RecvWR{ID: wc.ID}); err != nil && !c.closed {
				c.failLocked(fmt.Errorf("conn: repost receive: %w", err))
			}
		case transport.WCRDMAWrite:
			if wc.ID&ctlID != 0 {
				c.ctlPending--
				if wc.ID&^ctlID == kindCredit {
					c.creditOut = false
					c.returnCreditsLocked()
				}
			} else {
				c.sendsDone++
			}
		default:
			c.failLocked(fmt.Errorf("%w: unexpected completion %v", errProtocol, wc.Opcode))
		}
	}
}

// receivedLocked accounts one incoming message; everything in its
// immediate is checked against what this connection granted.
func (c *Conn) receivedLocked(imm uint32) error {
	kind, credits, n := decodeImm(imm)
	c.credits += credits
	if c.credits > int(c.peer.slotCount) {
		return fmt.Errorf("%w: %d credits returned, only %d slots granted", errProtocol, c.credits, c.peer.slotCount)
	}
	c.st.MessagesIn++
	switch kind {
	case kindData:
		if n == 0 || n > c.slotSize || len(c.recvLens) >= c.slots || c.eofIn {
			return fmt.Errorf("%w: data message of %d bytes with %d of %d slots full", errProtocol, n, len(c.recvLens), c.slots)
		}
		c.recvLens = append(c.recvLens, n)
	case kindCredit:
	case kindEOF:
		c.eofIn = true
	default:
		return fmt.Errorf("%w: message kind %d", errProtocol, kind)
	}
	return nil
}
