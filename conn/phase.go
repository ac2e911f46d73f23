package conn

import "time"

// sendPhase is the writer's state machine of our sending direction
// (doc/protocol.md, 4.6.1): S small (phaseSmall), E enlarging (waiting),
// L large (phaseLarge), B back-off (a failure phase until retryAt), P
// parked (parked), and the two kinds of leaving L: a shrink (shrunk until
// the next ack) and a climb (climbing while its shrink record goes). Its
// methods are the transitions; what each one sends, registers or reports
// stays with its caller (enlarge.go, shrink.go, ladder.go, park.go).
//
// It is part of the enlargement state (embedded in enlargement, so its
// fields are c.enl's) and guarded by c.mu: every method is called with
// c.mu held.
type sendPhase struct {
	phase   int           // phaseSmall, phaseLarge, or why the direction stays small
	backoff time.Duration // after the last failure (0: none in a row)
	retryAt time.Time     // a failed direction asks again from then on
	// stalls are the credit stalls of the large phase, counted from
	// stallsFrom (ms since epoch): the ladder's signal (ladder.go).
	stalls     uint32
	stallsFrom uint32
	waiting    bool // E: our enlargement request is outstanding
	parked     bool // P: our small direction is parked until the peer's answer
	climbing   bool // the shrink under way is a step up the ladder
	// shrunk: credits for the large ring the peer sent before it saw our
	// shrink record are dropped until the next ack.
	shrunk bool
}

// retry reports whether a direction that is not small may ask for large
// buffers: a failed one (B) once its back-off ended, which takes it back
// to S. A large one never needs to.
func (p *sendPhase) retry() bool {
	if p.phase == phaseLarge || time.Now().Before(p.retryAt) {
		return false
	}
	p.phase = phaseSmall
	return true
}

// enlarged is S/E to L: the ack came and our staging is ready.
func (p *sendPhase) enlarged() {
	p.phase = phaseLarge
	p.backoff = 0
}

// failed is E to B: refused, timed out, or our staging could not be
// had (phase says which). The back-off doubles with each failure in a
// row, from enlargeBackoffMin to enlargeBackoffMax.
func (p *sendPhase) failed(phase int, now time.Time) {
	p.phase = phase
	p.backoff = min(max(2*p.backoff, enlargeBackoffMin), enlargeBackoffMax)
	p.retryAt = now.Add(p.backoff)
}

// acked notes a valid ack for our latest request: credits for a large
// ring we shrank away from all came before it.
func (p *sendPhase) acked() { p.shrunk = false }

// shrank is L to S: our shrink record was the last message into the
// peer's large ring.
func (p *sendPhase) shrank() {
	p.phase = phaseSmall
	p.shrunk = true
}

// stall counts a credit stall of the large phase at now; stalls further
// apart than climbWindow start the count again.
func (p *sendPhase) stall(now time.Time) {
	ms := uint32(now.Sub(epoch) / time.Millisecond)
	if p.stalls == 0 || ms-p.stallsFrom > uint32(climbWindow/time.Millisecond) {
		p.stalls, p.stallsFrom = 0, ms
	}
	p.stalls++
}

// stallsCounted starts the count of stalls again: a new large ring, or a
// climb under way.
func (p *sendPhase) stallsCounted() { p.stalls = 0 }

// stalling reports whether the large phase stalled enough to climb.
func (p *sendPhase) stalling() bool { return p.phase == phaseLarge && p.stalls >= climbStalls }

// mayPark reports whether the direction is in S and not parked already.
func (p *sendPhase) mayPark() bool { return !p.parked && p.phase != phaseLarge }

// The receiver's states of the peer's large ring (doc/protocol.md, 4.6.2).
const (
	ringNone        = iota // N: none
	ringProvisioned        // A: acknowledged, the writer writes into it
	ringDraining           // D: the writer shrank away; freed once read
)

// recvPhase is the receiver's state machine of the peer's large ring,
// and its account of the peer's enlargement requests. Its methods are
// the transitions; what each one registers, sends or reports stays with
// its caller (serveEnlarge, retireLargeLocked, maybeDropLargeLocked).
//
// Embedded in enlargement, so its fields are c.enl's; guarded by c.mu.
type recvPhase struct {
	ring      uint8  // ringNone, ringProvisioned, ringDraining
	climb     bool   // D: the writer left the ring to climb, not to shrink
	serving   bool   // the enlargement server goroutine runs
	reqIn     uint32 // the latest request seen
	answered  uint32 // the newest request answered
	rxRefused error  // why the latest provisioning failed
	retiredAt time.Time
}

// requested notes a request; start reports whether a server must start
// to answer it (none runs).
func (p *recvPhase) requested(seq uint32) (start bool) {
	p.reqIn = seq
	start = !p.serving
	p.serving = true
	return start
}

// tornShrink reports whether the latest request, new (not a replay of
// one answered) while something landed in the provisioned ring, means
// the writer shrank away and its shrink record was torn: a retry after
// a lost ack comes before any write, since the writer takes only the
// answer to its latest request.
func (p *recvPhase) tornShrink(landed bool) bool {
	return p.ring == ringProvisioned && landed && p.reqIn > p.answered
}

// draining reports whether the ring is in D.
func (p *recvPhase) draining() bool { return p.ring == ringDraining }

// mayProvision reports whether request seq may have a ring provisioned:
// none is (N), and the request is not one refused already (a new one
// after a refusal tries again: the budget may have room now).
func (p *recvPhase) mayProvision(seq uint32) bool {
	return p.ring == ringNone && (p.rxRefused == nil || seq > p.answered)
}

// provisioned is N to A; refused keeps N, with why.
func (p *recvPhase) provisioned()     { p.ring, p.rxRefused = ringProvisioned, nil }
func (p *recvPhase) refuse(err error) { p.rxRefused = err }
func (p *recvPhase) acks() bool       { return p.ring == ringProvisioned }
func (p *recvPhase) serverGone()      { p.serving = false }

// answeredUpTo notes request seq answered; done reports whether it was
// the latest, so that the server may end (a later one came meanwhile
// otherwise).
func (p *recvPhase) answeredUpTo(seq uint32) (done bool) {
	p.answered = max(p.answered, seq)
	if p.reqIn == seq {
		p.serving = false
		return true
	}
	return false
}

// shrinkRecord is A to D: the writer's last message into the ring. In N
// or D there is no ring to shrink away from: a protocol error.
func (p *recvPhase) shrinkRecord(climb bool, now time.Time) error {
	if p.ring != ringProvisioned {
		return errShrinkNoRing
	}
	p.ring, p.climb, p.retiredAt = ringDraining, climb, now
	return nil
}

// freed is D to N once every slot was read: climb says whether the
// writer left to climb, since how long the ring drained.
func (p *recvPhase) freed(now time.Time) (climb bool, drained time.Duration) {
	climb, drained = p.climb, now.Sub(p.retiredAt)
	p.ring, p.climb, p.retiredAt = ringNone, false, time.Time{}
	return climb, drained
}
