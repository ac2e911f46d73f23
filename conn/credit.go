package conn

// The credit scheme (doc/protocol.md, section 4.4), per ring and per side:
//
//   - txCredits, the writer's: how many slots of one ring of the peer's it
//     may still write into. The ring's announcement (the hello for the
//     small ring, the ack for a large one) grants every slot; each message
//     with a payload uses one; the peer returns them in its immediates.
//   - rxCredits, the receiver's: which slots of one of its rings the
//     writer filled, which the reader freed (in order), and the credits of
//     freed slots not yet returned, with the rule for when they must go
//     back in a credit message of their own.
//
// Both are embedded in the ring they account for (txRing, rxRing), so
// their fields are the ring's. They are part of the Conn's state and
// guarded by c.mu: every method is called with c.mu held.

// The reserve rule: a writer keeps the last credit of a ring for read
// requests and its last two for other records.
const (
	dataReserve = 1 // credits a data message must leave
	recordNeed  = 2 // credits a record other than a read request needs
	readNeed    = 1 // credits a read request needs
)

// txCredits is a writer's credit count for one ring of the peer's.
// Guarded by c.mu.
type txCredits struct {
	credits int // slots of the peer's ring we may still write into
}

// grant gives the writer every slot of a ring just announced (hello or
// ack); what it held for a previous ring is gone.
func (g *txCredits) grant(count int) { g.credits = count }

// canSendData reports whether a data message may go: it must leave the
// reserve for records.
func (g *txCredits) canSendData() bool { return g.credits > dataReserve }

// canSendRecord reports whether a record may go: a read request may take
// the last credit, any other record needs two.
func (g *txCredits) canSendRecord(read bool) bool {
	if read {
		return g.credits >= readNeed
	}
	return g.credits >= recordNeed
}

// use takes the credit of the message being posted.
func (g *txCredits) use() { g.credits-- }

// returned adds n credits the peer gave back for a ring of count slots;
// false means the peer returned more than the ring holds (a protocol
// error).
func (g *txCredits) returned(n, count int) bool {
	g.credits += n
	return g.credits <= count
}

// rxCredits is a receiver's account of one of its rings. The writer picks
// slots in order (its message count modulo count), so a slot's credit may
// go back only once every slot before it is free too: a control record,
// consumed on arrival, must not let the writer overwrite unread data
// before it. Guarded by c.mu.
type rxCredits struct {
	count    int
	arrived  uint64 // messages landed: the next one takes slot arrived%count
	released uint64 // slots before this one are free
	consumed []bool // per slot: consumed, waiting for the slots before it
	freed    int    // released, credit not yet returned
	urgent   bool   // a record's slot was released: return credits now
	// retiring: the writer shrank away from this ring (shrink.go); it
	// takes nothing more and returns no credits, and goes once drained.
	retiring bool
}

func newRxCredits(count int) rxCredits {
	return rxCredits{count: count, consumed: make([]bool, count)}
}

// arrive takes the next slot for an arriving message; ok is false when
// the writer wrote past the credits it was given or into a retired ring.
func (r *rxCredits) arrive() (slot int, ok bool) {
	if r.retiring || r.arrived-r.released >= uint64(r.count) {
		return 0, false
	}
	slot = int(r.arrived % uint64(r.count))
	r.arrived++
	return slot, true
}

// consume frees a slot and releases every slot, from the oldest on, that
// is free; their credits are owed to the writer unless the ring retires.
func (r *rxCredits) consume(slot int) {
	r.consumed[slot] = true
	for r.released < r.arrived && r.consumed[r.released%uint64(r.count)] {
		r.consumed[r.released%uint64(r.count)] = false
		r.released++
		if !r.retiring {
			r.freed++
		}
	}
}

// consumeNow frees a slot whose credit goes back at once: a record's
// (the writer keeps its last credits for records), one dropped after
// Close, one spilled to unblock a reader.
func (r *rxCredits) consumeNow(slot int) {
	r.consume(slot)
	r.urgent = true
}

// tookReserve reports whether the last message left its writer no credit
// for this ring, counting every credit already returned: data may not do
// that (the reserve rule).
func (r *rxCredits) tookReserve() bool {
	returned := r.released - uint64(r.freed)
	return r.arrived-returned >= uint64(r.count)
}

// pending is what the next message returns of this ring's credits.
func (r *rxCredits) pending() int { return min(r.freed, maxCredits) }

// due reports whether the ring's credits need a credit message of their
// own: once half the ring is free, or at once after a record.
func (r *rxCredits) due() bool {
	return r.freed != 0 && (r.freed >= max(1, r.count/2) || r.urgent)
}

// take hands pending credits to a message that returns them; nothing
// is urgent any more.
func (r *rxCredits) take() int {
	n := r.pending()
	r.freed -= n
	r.urgent = false
	return n
}

// takeForPark is take for the answer to a park, which has always left
// urgent as it was.
func (r *rxCredits) takeForPark() int {
	n := r.pending()
	r.freed -= n
	return n
}

// forgo drops the credits not yet returned: the writer writes into this
// ring no more.
func (r *rxCredits) forgo() { r.freed = 0 }

// retire is the writer's shrink record: the ring takes nothing more and
// returns no credits, from now on or owed.
func (r *rxCredits) retire() {
	r.retiring = true
	r.freed = 0
}

// drained reports whether every slot that landed was read.
func (r *rxCredits) drained() bool { return r.released == r.arrived }

// full reports whether every slot holds a message not yet read.
func (r *rxCredits) full() bool { return r.arrived-r.released >= uint64(r.count) }

// piggyback picks the credits an outgoing message carries: those of the
// large ring first, else of the small one.
func piggyback(rx *[2]rxRing) (ring, n int) {
	for _, r := range []int{large, small} {
		if rx[r].freed > 0 {
			return r, rx[r].take()
		}
	}
	return small, 0
}

// creditDue picks the ring whose credits need a credit message now, the
// large one first; ok is false when none does.
func creditDue(rx *[2]rxRing) (ring int, ok bool) {
	for _, r := range []int{large, small} {
		if rx[r].due() {
			return r, true
		}
	}
	return 0, false
}

// takeCreditsLocked picks freed slots to piggyback on an outgoing message.
func (c *rdmaConn) takeCreditsLocked() (ring, n int) { return piggyback(&c.rx) }

// returnCreditsLocked sends freed slots back in a credit message once
// half a ring is free and no credit message is on its way already (data
// messages carry credits too).
func (c *rdmaConn) returnCreditsLocked() {
	if c.creditOut || c.err != nil || c.qp == nil {
		return
	}
	r, ok := creditDue(&c.rx)
	if !ok {
		return
	}
	if err := c.postCtlLocked(kindCredit, r, c.rx[r].pending()); err != nil {
		c.failLocked(err)
		return
	}
	c.rx[r].take()
	c.creditOut = true
}
