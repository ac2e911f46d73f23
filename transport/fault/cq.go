package fault

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// cq translates the inner completions back to the caller's ids, applies
// completion rules, and keeps completions that are held back (ActDelay) or
// did not fit in the caller's slice, in order.
type cq struct {
	dev    *device
	inner  transport.CQ
	buf    []transport.WorkCompletion
	closed once
	// closedQPs counts roles (send, receive) of closed QPs on this queue
	// not yet reaped: an empty Poll reaps only when it is not zero, so
	// that pollers spinning on empty queues do not take the device lock.
	closedQPs atomic.Int32

	mu    sync.Mutex // never held while waiting
	queue []queued
	armed bool
}

type queued struct {
	wc  transport.WorkCompletion
	due time.Time // zero: ready now
}

func newCQ(d *device, inner transport.CQ) *cq {
	return &cq{dev: d, inner: inner, buf: make([]transport.WorkCompletion, 64)}
}

func (c *cq) Cap() int { return c.inner.Cap() }
func (c *cq) Close() error {
	c.closed.do(func() { c.dev.inj.live.cqs.Add(-1) })
	err := c.inner.Close()
	c.dev.reap(c) // nothing is translated through c any more
	return err
}

func (c *cq) ReqNotify() error {
	c.mu.Lock()
	c.armed = true
	c.mu.Unlock()
	return c.inner.ReqNotify()
}

func (c *cq) Poll(wc []transport.WorkCompletion) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var perr error
	if len(wc) > 0 {
		want := min(len(wc), len(c.buf))
		n, err := c.inner.Poll(c.buf[:want])
		perr = err
		now := time.Now()
		for i := range n {
			c.translate(c.buf[i], now)
		}
		if n == 0 && err == nil && len(c.queue) == 0 {
			c.dev.reap(c)
		}
	}
	n := 0
	now := time.Now()
	for n < len(wc) && len(c.queue) > 0 && !c.queue[0].due.After(now) {
		wc[n] = c.queue[0].wc
		c.queue[0] = queued{}
		c.queue = c.queue[1:]
		n++
	}
	if len(c.queue) == 0 {
		c.queue = c.queue[:0:0]
	}
	if n > 0 {
		return n, nil // an overflow is reported by the next Poll
	}
	return 0, perr
}

// translate restores the caller's view of one inner completion, runs the
// completion rules on it and queues it (possibly due later).
func (c *cq) translate(wc transport.WorkCompletion, now time.Time) {
	q := c.dev.lookup(wc.QPNum)
	if q == nil {
		c.queue = append(c.queue, queued{wc: wc})
		return
	}
	ev := Event{Op: OpCompletion, Device: c.dev.inner.Name(), QPNum: q.num}
	var landed func() ([][]byte, bool)
	if wc.ID&recvTag != 0 {
		e := q.popRecv(wc.ID &^ recvTag)
		if e == nil {
			c.queue = append(c.queue, queued{wc: wc})
			return
		}
		wc.ID = e.wr.ID
		if wc.Status != transport.StatusSuccess {
			wc.Opcode = transport.WCRecv
		}
		if wc.Status == transport.StatusSuccess && wc.Opcode == transport.WCRecv {
			landed = func() ([][]byte, bool) { return q.pd.segments(clip(e.wr.SG, wc.ByteLen)) }
		}
	} else {
		e := q.popSend(wc.ID)
		if e == nil {
			c.queue = append(c.queue, queued{wc: wc})
			return
		}
		defer func() { q.pd.stage.put(e.stage); e.stage = nil }()
		wc.ID = e.wr.ID
		ev.Request = &e.wr
		switch {
		case e.status != transport.StatusSuccess:
			wc.Status, wc.ByteLen = e.status, 0
			if e.status != transport.StatusWRFlushErr {
				// The injected failure: now everything
				// still queued on the inner QP flushes.
				q.inner.SetError()
			}
		case e.drop && wc.Status == transport.StatusSuccess:
			wc.ByteLen = e.length
		}
		wc.Opcode = e.wr.Opcode.Completion()
		if e.drop && !e.wr.Signaled && wc.Status == transport.StatusSuccess {
			return // cannot happen: an unsignaled success is silent
		}
		if wc.Status == transport.StatusSuccess && e.wr.Opcode == transport.OpRead {
			landed = func() ([][]byte, bool) { return q.pd.segments(e.wr.SG) }
			if e.corrupt != nil {
				if segs, ok := landed(); ok {
					flipSegs(segs, int(wc.ByteLen), e.corrupt)
				}
			}
		}
	}
	if q.failed.Load() && wc.Status == transport.StatusSuccess {
		wc.Status, wc.ByteLen = transport.StatusWRFlushErr, 0
		landed = nil
	}
	ev.WC = &wc
	ev.Len = int(wc.ByteLen)
	ev.corruptible = landed != nil
	if landed != nil {
		ev.payload = func() []byte {
			segs, ok := landed()
			if !ok {
				return nil
			}
			var out []byte
			for _, s := range segs {
				out = append(out, s...)
			}
			return out
		}
	}
	d := c.dev.inj.decide(&ev)
	if d.corrupt != nil && d.status == nil {
		if segs, ok := landed(); ok {
			flipSegs(segs, int(wc.ByteLen), d.corrupt)
		}
	}
	if d.status != nil {
		wc.Status, wc.ByteLen = d.status.Status, 0
		q.failed.Store(true)
		q.inner.SetError()
	}
	if d.qpErr != nil {
		q.inner.SetError()
	}
	it := queued{wc: wc}
	if d.delay != nil {
		it.due = now.Add(d.delay.Delay)
	}
	c.queue = append(c.queue, it)
}

// clip shortens a receive's scatter list to the n bytes that landed.
func clip(sg []transport.SGE, n uint32) []transport.SGE {
	out := make([]transport.SGE, 0, len(sg))
	for _, s := range sg {
		if n == 0 {
			break
		}
		s.Length = min(s.Length, n)
		n -= s.Length
		out = append(out, s)
	}
	return out
}

// Wait returns when the inner queue notifies, or when a completion held
// back by a rule becomes due on an armed queue: for the caller that is a
// completion arriving after ReqNotify.
func (c *cq) Wait(ctx context.Context) error {
	for {
		c.mu.Lock()
		var due time.Time
		if len(c.queue) > 0 {
			due = c.queue[0].due
		}
		armed := c.armed
		if armed && len(c.queue) > 0 && !due.After(time.Now()) {
			c.armed = false
			c.mu.Unlock()
			return nil
		}
		c.mu.Unlock()
		if due.IsZero() || !armed {
			err := c.inner.Wait(ctx)
			if err == nil {
				c.disarm()
			}
			return err
		}
		wctx, cancel := context.WithDeadline(ctx, due)
		err := c.inner.Wait(wctx)
		cancel()
		switch {
		case err == nil:
			c.disarm()
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, context.DeadlineExceeded):
			continue // the held completion is due: the loop returns
		default:
			return err
		}
	}
}

func (c *cq) disarm() {
	c.mu.Lock()
	c.armed = false
	c.mu.Unlock()
}
