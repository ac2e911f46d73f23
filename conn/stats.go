package conn

import (
	"context"
	"fmt"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Stats are a connection's counters, exact at the time of the call.
type Stats struct {
	// Provider is what the connection runs on: "shm", "verbs", "tcp",
	// or ProviderNegotiating until that is known.
	Provider string
	// ProviderReason is why the provider was chosen: "option",
	// "RDMAGRPC_PROVIDER", "RDMA device found", or the reason verbs is
	// unavailable here (no device, rdma-core not installed, ...).
	ProviderReason string
	Device         string // the provider's device the connection lives on (verbs: the HCA its route goes through)
	// Path is the route the connection's traffic takes on an RDMA fabric
	// (verbs): port, source GID index and RoCE version, path MTU, traffic
	// class, service level; zero on shm and TCP.
	Path      transport.Path
	SendPhase string // "small", "large", or why it stayed small
	RecvPhase string // "small" or "large": what the peer writes into
	// RegisteredBytes is the registered memory this connection holds
	// (its pool is its own: one protection domain per connection).
	RegisteredBytes     int64
	Enlargements        int // of our sending direction
	EnlargeFailures     int
	EnlargementsServed  int // of the peer's direction, provisioned here
	EnlargeRefusals     int
	LastEnlargeFrom     int // slot sizes
	LastEnlargeTo       int
	LastEnlargeDuration time.Duration // first large write to usable large buffers
	LastEnlargeOutcome  string
	// EnlargeRetryAt: after a failed enlargement, when the next large
	// write asks again (zero: no failure pending).
	EnlargeRetryAt time.Time
	// SendPhaseIndex is the sending direction's phase: 0 small, 1 the
	// first large one, 2 and on the further steps of WithBufferPhases.
	SendPhaseIndex int
	// Shrinks of our sending direction back to small (WithIdleShrink),
	// and ShrinksServed, the peer's large rings dropped here after its
	// shrink; LastShrinkDuration: the shrink record's wait for a credit.
	Shrinks            int
	ShrinksServed      int
	LastShrinkDuration time.Duration
	// ShrinkDiscardErrors: large buffers a shrink gave back that could
	// not be deregistered (the pool keeps and reports them at Close).
	ShrinkDiscardErrors int
	// PressureShrinks: shrinks of our sending direction the peer asked
	// for, its budget short; ShrinkAsks: asks we sent our peer, ours
	// short (reclaim under pressure).
	PressureShrinks int
	ShrinkAsks      int
	// Climbs: steps of our sending direction up the ladder
	// (WithBufferPhases), each when it kept stalling on credits.
	Climbs int
	// Parks of our small direction after WithIdleShrink of idleness, and
	// ParksServed, the peer's parks here: each gave the pages of a small
	// ring back (park.go). ParksDeclined: parks of the peer's answered
	// without a release, our reader behind.
	Parks, ParksServed, ParksDeclined uint32
	SmallFreed                        bool // our small receive ring is gone (WithFreeSmallOnEnlarge)
	// FreeSmallErrors: our small ring's memory could not be given back,
	// freed after an enlargement or released by a park.
	FreeSmallErrors int
	BadRecords      int // torn or corrupt control records ignored
	StaleRecords    int // answers to requests given up on
	CreditStalls    uint64
	// Rendezvous: messages sent by rendezvous (adverts), received, and chunks
	// that went through the rings because no memory could be registered.
	Rendezvous             uint64
	RendezvousIn           uint64
	RendezvousBytesIn      uint64
	RendezvousFallbacks    uint64
	LastRendezvousDuration time.Duration // read request to its last segment landed
	// SpilledBytes: ring messages queued behind a rendezvous message,
	// copied out so that their slots (and a credit for our read request)
	// could go back to the peer.
	SpilledBytes uint64
	// RendezvousShortReads: read requests made smaller than the advert
	// part they could have asked for, because the registered-memory
	// budget had no room for the whole; BudgetOverdrafts: of those, the
	// ones whose one page was taken beyond the budget (no room at all).
	RendezvousShortReads uint64
	BudgetOverdrafts     uint64
	// RendezvousPrefetches: read requests for the next advert sent as
	// soon as the one before it was, before that one landed.
	RendezvousPrefetches uint64
	// SpillRefusals: spills not made because the copies held reached
	// their bound (a peer refilling the ring behind a rendezvous message).
	SpillRefusals     uint64
	BytesIn, BytesOut uint64
	MessagesIn        uint64
	SmallDataIn       uint64 // data messages that landed in the small ring
	LargeDataIn       uint64 // ... and in the large ring
	MessagesOut       uint64
}

// Stats returns the connection's counters.
func (c *rdmaConn) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.opened.Load() && !c.closed && c.err == nil {
		// An early dial the listener has not answered yet (Handshake
		// waits for that; Stats never waits on a peer).
		return Stats{Provider: ProviderNegotiating, ProviderReason: fmt.Sprintf("waiting for the %s listener's answer", c.st.Provider)}
	}
	if c.opened.Load() && !c.closed {
		c.lookUpPathLocked()
	}
	s := c.st
	s.SendPhase = phaseNames[c.enl.phase]
	if c.enl.phase != phaseSmall && c.enl.phase != phaseLarge {
		s.EnlargeRetryAt = c.enl.retryAt
	}
	if c.sending == large {
		s.SendPhaseIndex = 1 + c.enl.level
	}
	s.RecvPhase = "small"
	if c.rx[large].buf != nil {
		s.RecvPhase = "large"
	}
	s.RegisteredBytes = c.pool.Stats().RegisteredBytes
	return s
}

// SetupSteps: the QP's, once the connection opened (transport.SetupTimer).
func (c *rdmaConn) SetupSteps() []transport.SetupStep {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.awaitOpenLocked(context.Background(), time.Time{})
	if t, ok := c.qp.(transport.SetupTimer); ok {
		return t.SetupSteps()
	}
	return nil
}

// EnlargeOutcome names an outcome code of the enlargement marker, the
// code bpf.Event.Outcome and rdmatrace report for each enlargement.
func EnlargeOutcome(code uint32) string {
	if code == 0 || int(code) >= len(outcomeNames) {
		return fmt.Sprintf("outcome %d", code)
	}
	return outcomeNames[code]
}
