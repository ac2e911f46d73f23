package conn

// Stats are a connection's counters, exact at the time of the call.
type Stats struct {
	Provider        string
	Phase           string // "small": enlargement (M2–M4) is not implemented yet
	RegisteredBytes int64  // registered memory this connection holds
	Enlargements    int
	CreditStalls    uint64 // writes that had to wait for the peer's credits
	Rendezvous      int
	BytesIn         uint64
	BytesOut        uint64
	MessagesIn      uint64
	MessagesOut     uint64
}

// Stats returns the connection's counters.
func (c *Conn) Stats() Stats {
	c.mu.Lock()
	s := c.st
	c.mu.Unlock()
	s.Provider, s.Phase = c.provider, "small"
	s.RegisteredBytes = c.pool.Stats().RegisteredBytes // the pool is this connection's alone
	return s
}
