package conn

import (
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
