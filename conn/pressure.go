package conn

import (
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
)

// Reclaim under pressure, so that busy connections take turns with the
// budget's memory. A side asked
// to enlarge whose budget has no room for the large ring asks the writers
// into the least recently used idle large rings of its other connections
// on that budget to shrink now, rather than at their idle shrink, and
// waits a little for the memory to come back before it answers. The
// writer shrinks as it does on idle (shrink.go): only the writer knows
// whether a write is under way, and its shrink record is what makes the
// ring safe to drop. So memory moves to the connections that have
// traffic, and a refusal is no longer final for anyone: a refused writer
// asks again after its back-off, and finds the room the others gave back.
//
// An ask is a control record (recShrinkAsk). Only peers that said, in
// their enlargement request, that they know it are sent one; an older
// peer would take an unknown record for a protocol violation.

const (
	// pressureIdle: a large ring that took nothing for this long may be
	// asked for under pressure, and a writer asked to shrink does so once
	// it wrote nothing for this long. Short: busy connections take turns
	// (a writer between two messages gives its ring up), as long as none
	// is taken from a message in flight.
	pressureIdle = time.Millisecond
	// askAgain: a writer asked to shrink that stays busy gives up after
	// this, and may be asked again then.
	askAgain = time.Second
)

// holders are the connections holding a large receive ring, the
// candidates for a shrink under pressure.
var holders = struct {
	sync.Mutex
	m map[*rdmaConn]struct{}
}{m: map[*rdmaConn]struct{}{}}

func (c *rdmaConn) holdingLarge(on bool) {
	holders.Lock()
	if on {
		holders.m[c] = struct{}{}
	} else {
		delete(holders.m, c)
	}
	holders.Unlock()
}

// askShrinks asks the writers into the least recently used idle large
// rings of other connections on budget b to shrink, until what they hold
// covers need bytes. It returns how many it asked. No lock of c's is held:
// it takes the others' one at a time.
func askShrinks(c *rdmaConn, b *bufpool.Budget, need int64) int {
	holders.Lock()
	others := make([]*rdmaConn, 0, len(holders.m))
	for o := range holders.m {
		if o != c {
			others = append(others, o)
		}
	}
	holders.Unlock()
	type cand struct {
		c     *rdmaConn
		last  time.Time
		bytes int64
	}
	var cands []cand
	now := time.Now()
	for _, o := range others {
		o.mu.Lock()
		r := &o.rx[large]
		if o.pool != nil && o.pool.Budget() == b && o.enl.peerTakesAsks && r.buf != nil && !r.retiring && now.Sub(r.askedAt) > askAgain &&
			!o.closed && o.err == nil && now.Sub(r.lastLanding) >= pressureIdle {
			cands = append(cands, cand{o, r.lastLanding, int64(r.buf.Len())})
		}
		o.mu.Unlock()
	}
	slices.SortFunc(cands, func(a, b cand) int { return a.last.Compare(b.last) })
	asked := 0
	var covered int64
	for _, k := range cands {
		if covered >= need {
			break
		}
		o := k.c
		o.mu.Lock()
		r := &o.rx[large]
		if r.buf != nil && !r.retiring && now.Sub(r.askedAt) > askAgain && !o.closed && o.err == nil {
			// Bounded: a peer that returns no credit is not waited for.
			if err := o.sendRecordLocked(record{typ: recShrinkAsk}, time.Now().Add(pressureIdle), true); err == nil {
				r.askedAt = now
				o.st.ShrinkAsks++
				asked++
				covered += k.bytes
			}
		}
		o.mu.Unlock()
	}
	return asked
}

// shrinkAskedLocked is the peer's ask (poller): shrink the sending
// direction once it is idle for pressureIdle, on the shrink timer.
func (c *rdmaConn) shrinkAskedLocked() {
	if c.enl.phase != phaseLarge || !c.enl.peerKeepsSmall || c.closed {
		return
	}
	c.enl.pressure, c.enl.pressureUntil = true, time.Now().Add(askAgain)
	c.parkArmed = false
	c.armIdleLocked(0)
}

// shrinkAfter is how long the sending direction must be idle to shrink:
// the idle shrink's time, or pressureIdle when the peer asked.
func (c *rdmaConn) shrinkAfter() time.Duration {
	if c.enl.pressure && time.Now().After(c.enl.pressureUntil) {
		c.enl.pressure = false // busy all along: the asker asks again
	}
	if c.enl.pressure {
		return pressureIdle
	}
	return c.o.idleShrink
}

// awaitRoom retries get until it succeeds, fails otherwise than for the
// budget, c closes, or the deadline passes: the shrinks askShrinks asked
// for give memory back as the peers' shrink records are read.
func (c *rdmaConn) awaitRoom(get func() (*bufpool.Buffer, error), deadline time.Time) (*bufpool.Buffer, error) {
	for {
		buf, err := get()
		if err == nil || !isBudgetErr(err) || c.isClosed() || time.Now().After(deadline) {
			return buf, err
		}
		time.Sleep(time.Millisecond)
	}
}

func isBudgetErr(err error) bool { return errors.Is(err, bufpool.ErrBudget) }
