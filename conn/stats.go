package conn

import "time"

// Stats are a connection's counters, exact at the time of the call.
type Stats struct {
	Provider  string
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
	BadRecords          int // torn or corrupt control records ignored
	StaleRecords        int // answers to requests given up on
	CreditStalls        uint64
	Rendezvous          int // M5: not implemented yet, always 0
	BytesIn, BytesOut   uint64
	MessagesIn          uint64
	SmallDataIn         uint64 // data messages that landed in the small ring
	LargeDataIn         uint64 // ... and in the large ring
	MessagesOut         uint64
}

// Stats returns the connection's counters.
func (c *Conn) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.st
	s.Provider = c.provider
	s.SendPhase = phaseNames[c.enl.phase]
	s.RecvPhase = "small"
	if c.rx[large].buf != nil {
		s.RecvPhase = "large"
	}
	s.RegisteredBytes = c.pool.Stats().RegisteredBytes
	return s
}
