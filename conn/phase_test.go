package conn

import (
	"errors"
	"testing"
	"time"
)

// The writer's transitions of doc/protocol.md 4.6.1, on the type alone.
func TestSendPhaseEnlargeAndBackoff(t *testing.T) {
	now := time.Now()
	var p sendPhase
	if p.phase != phaseSmall || !p.mayPark() {
		t.Fatalf("zero sendPhase: phase %d, mayPark %v; want small, true", p.phase, p.mayPark())
	}
	// E to B: the back-off doubles with each failure in a row, capped.
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second} {
		p.failed(phaseRefused+i%3, now)
		if p.backoff != want || !p.retryAt.Equal(now.Add(want)) {
			t.Fatalf("failure %d: back-off %v until %v; want %v", i+1, p.backoff, p.retryAt, want)
		}
	}
	for range 10 {
		p.failed(phaseTimedOut, now)
	}
	if p.backoff != enlargeBackoffMax {
		t.Fatalf("back-off %v after many failures; want %v", p.backoff, enlargeBackoffMax)
	}
	// B: no new request before retryAt; after it, back to S.
	p.retryAt = time.Now().Add(time.Hour)
	if p.retry() || p.phase != phaseTimedOut {
		t.Fatalf("retry within the back-off: phase %d", p.phase)
	}
	p.retryAt = time.Now().Add(-time.Millisecond)
	if !p.retry() || p.phase != phaseSmall {
		t.Fatalf("retry after the back-off: phase %d; want small", p.phase)
	}
	// E to L: a success ends the run of failures.
	p.enlarged()
	if p.phase != phaseLarge || p.backoff != 0 || p.mayPark() {
		t.Fatalf("enlarged: phase %d, back-off %v, mayPark %v", p.phase, p.backoff, p.mayPark())
	}
	p.retryAt = time.Time{}
	if p.retry() || p.phase != phaseLarge {
		t.Fatal("a large direction asked again")
	}
	p.failed(phaseLocalErr, now)
	if p.backoff != enlargeBackoffMin {
		t.Fatalf("first failure after a success: back-off %v; want %v", p.backoff, enlargeBackoffMin)
	}
}

func TestSendPhaseShrinkAndAck(t *testing.T) {
	p := sendPhase{phase: phaseLarge}
	p.shrank()
	if p.phase != phaseSmall || !p.shrunk {
		t.Fatalf("shrank: phase %d, shrunk %v; want small, true", p.phase, p.shrunk)
	}
	// Credits for the old large ring are dropped until the next ack.
	p.acked()
	if p.shrunk {
		t.Fatal("an ack left shrunk set")
	}
}

func TestSendPhasePark(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    sendPhase
		want bool
	}{
		{"small", sendPhase{phase: phaseSmall}, true},
		{"backing off: small too", sendPhase{phase: phaseRefused}, true},
		{"large", sendPhase{phase: phaseLarge}, false},
		{"parked already", sendPhase{phase: phaseSmall, parked: true}, false},
	} {
		if got := tc.p.mayPark(); got != tc.want {
			t.Errorf("%s: mayPark = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestSendPhaseStalls(t *testing.T) {
	at := epoch.Add(time.Hour)
	window := climbWindow
	for _, tc := range []struct {
		name  string
		phase int
		gaps  []time.Duration // between stalls
		want  uint32
		climb bool
	}{
		{"none", phaseLarge, nil, 0, false},
		{"one short", phaseLarge, make([]time.Duration, climbStalls-1), climbStalls - 1, false},
		{"enough", phaseLarge, make([]time.Duration, climbStalls), climbStalls, true},
		{"enough, but small", phaseSmall, make([]time.Duration, climbStalls), climbStalls, false},
		{"a gap past the window starts again", phaseLarge,
			append(make([]time.Duration, climbStalls-1), window+time.Millisecond), 1, false},
		{"spread within the window", phaseLarge,
			[]time.Duration{0, window / 8, window / 8, window / 8, window / 8, window / 8, window / 8, window / 8}, climbStalls, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := sendPhase{phase: tc.phase}
			now := at
			for _, gap := range tc.gaps {
				now = now.Add(gap)
				p.stall(now)
			}
			if p.stalls != tc.want || p.stalling() != tc.climb {
				t.Fatalf("stalls %d, stalling %v; want %d, %v", p.stalls, p.stalling(), tc.want, tc.climb)
			}
			p.stallsCounted()
			if p.stalling() {
				t.Fatal("stalling after the count started again")
			}
		})
	}
}

// The receiver's transitions of doc/protocol.md 4.6.2 for the large ring,
// on the type alone: N, a request, A, retries, a shrink record, D, the
// drain, N again; and the shrink records that are protocol errors.
func TestRecvPhaseLargeRing(t *testing.T) {
	var p recvPhase
	now := time.Now()
	if err := p.shrinkRecord(false, now); err != errShrinkNoRing {
		t.Fatalf("shrink record in N: %v; want errShrinkNoRing", err)
	}
	if !p.requested(1) {
		t.Fatal("first request: no server started")
	}
	if p.requested(2) {
		t.Fatal("a request while a server runs started another")
	}
	if !p.mayProvision(2) || p.acks() {
		t.Fatalf("N: mayProvision %v, acks %v; want true, false", p.mayProvision(2), p.acks())
	}
	// No memory: refused, N kept; the same request is not tried again,
	// a newer one is.
	p.refuse(errors.New("no memory"))
	if p.answeredUpTo(1) {
		t.Fatal("answered 1 of 2 requests: the server ended")
	}
	if !p.answeredUpTo(2) || p.serving {
		t.Fatal("answered the latest request: the server goes on")
	}
	if p.mayProvision(2) || !p.mayProvision(3) {
		t.Fatalf("after refusing 2: mayProvision(2) %v, (3) %v; want false, true", p.mayProvision(2), p.mayProvision(3))
	}
	p.requested(3)
	p.provisioned()
	if !p.acks() || p.rxRefused != nil || p.mayProvision(4) {
		t.Fatalf("A: acks %v, refused %v, mayProvision %v", p.acks(), p.rxRefused, p.mayProvision(4))
	}
	p.answeredUpTo(3)
	// A retry before anything landed is answered with the same ring; a
	// new request after data landed is a torn shrink record.
	p.requested(4)
	if p.tornShrink(false) {
		t.Fatal("a retry before any write taken for a torn shrink")
	}
	if !p.tornShrink(true) {
		t.Fatal("a new request after data landed not taken for a torn shrink")
	}
	p.answeredUpTo(4)
	if p.tornShrink(true) {
		t.Fatal("an answered request taken for a torn shrink")
	}
	// A to D, by a climb; a second shrink record is an error.
	if err := p.shrinkRecord(true, now); err != nil || !p.draining() || p.acks() {
		t.Fatalf("shrink record in A: %v, draining %v, acks %v", err, p.draining(), p.acks())
	}
	if err := p.shrinkRecord(false, now); err != errShrinkNoRing {
		t.Fatalf("shrink record in D: %v; want errShrinkNoRing", err)
	}
	if p.mayProvision(5) {
		t.Fatal("D: a request may provision before the drain")
	}
	climb, d := p.freed(now.Add(time.Second))
	if !climb || d != time.Second || p.ring != ringNone || !p.mayProvision(5) {
		t.Fatalf("freed: climb %v after %v, ring %d; want a climb after 1s, N", climb, d, p.ring)
	}
}
