package conn

import (
	"errors"
	"time"
)

// The ladder (WithBufferPhases): a large
// direction that keeps stalling on credits, its writer waiting for the
// peer's reader, climbs to the next, deeper phase. A step up is a shrink
// record that says so (the peer retires the ring without counting a
// shrink) followed by an enlargement request for the next phase: the
// same records and the same guarantees as an idle shrink and the first
// enlargement (shrink.go, enlarge.go), so nothing new can race a write. The peer
// provisions the deeper ring once the old one is drained.

const (
	// climbStalls: credit stalls in a large phase, within climbWindow,
	// before its writer asks for the next one. A stall is a full ring:
	// the peer's reader is behind by the whole ring.
	climbStalls = 8
	// climbWindow: stalls count towards a climb while they come this
	// close together: a writer that keeps stalling, not one that stalled
	// now and then over a long life. Stalls counted over a connection's
	// whole life would make a connection whose ring fills once every few
	// seconds climb, registering 2 MiB more on each side at an arbitrary
	// moment long after its traffic warmed up.
	climbWindow = time.Second
)

// epoch is what stallsFrom counts from.
var epoch = time.Now()

// climb takes the sending direction one phase up the ladder when it keeps
// stalling, and says whether it did (the write then enlarges). c.wmu is
// held (a write is starting, which saw the stalls); an error only when
// the connection is done.
func (c *rdmaConn) climb() (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.enl.stalling() || c.enl.capped ||
		c.enl.level+1 >= len(c.o.largePhases()) || !c.enl.peerKeepsSmall {
		return false, nil
	}
	c.enl.stallsCounted()
	// Every large write completed: the shrink record is the last message
	// into the ring, after all of them.
	t := &c.tx[large]
	deadline := time.Now().Add(c.o.ackTimeout)
	c.confirmLocked()
	for t.done != t.seq && c.err == nil && !c.closed && time.Now().Before(deadline) {
		c.waitLocked(c.changed, deadline)
	}
	if err := c.writeErrLocked(); err != nil {
		return false, err
	}
	if t.done != t.seq {
		return false, nil // still in flight: climb at a later write
	}
	c.enl.climbing = true
	err := c.shrinkLocked()
	c.enl.climbing = false
	switch {
	case err == nil:
		c.enl.level++
		c.st.Climbs++
		return true, nil
	case errors.Is(err, errShrinkBusy):
		return false, nil // no credit for the record: later
	default:
		return false, err
	}
}
