package conn

import (
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/hostload"
)

// spinConn is a connection with ceiling as its WithPollSpin, for the
// budget's rules alone (no queue is polled).
func spinConn(ceiling time.Duration) *rdmaConn {
	return &rdmaConn{connCore: connCore{o: &options{pollSpin: ceiling}}}
}

// quietFor is a quiet period of d, from its start to the completion
// that ends it, as the spin clock reads them.
func quietFor(c *rdmaConn, d time.Duration) {
	c.pl.quietAt = 1001
	c.spinQuietEndedAt(1001 + uint32(d/time.Microsecond))
}

func TestSpinBudgetLearns(t *testing.T) {
	const ceil = 200 * time.Microsecond
	spinHint.Store(0)
	t.Cleanup(func() { spinHint.Store(0) })
	c := spinConn(ceil)
	if b := c.spinBudget(); b != ceil {
		t.Fatalf("a first connection spins %v, want the ceiling %v", b, ceil)
	}

	// Spins that run out shrink it by a quarter each, down to the floor.
	c.spinTimedOut()
	if b := c.spinBudget(); b != 150*time.Microsecond {
		t.Fatalf("after one spin ran out: %v, want 150µs", b)
	}
	for range 20 {
		c.spinTimedOut()
	}
	if b := c.spinBudget(); b != spinFloor {
		t.Fatalf("after many spins ran out: %v, want the floor %v", b, spinFloor)
	}

	// A new connection starts where the process's last one left off.
	if b := spinConn(ceil).spinBudget(); b != spinFloor {
		t.Fatalf("a new connection starts at %v, want the process's %v", b, spinFloor)
	}

	// A quiet period slept through that ended within half the ceiling:
	// spinning twice as long would have caught it.
	quietFor(c, 40*time.Microsecond)
	if b := c.spinBudget(); b != 80*time.Microsecond {
		t.Fatalf("after a 40µs quiet period: %v, want 80µs", b)
	}
	// One longer than half the ceiling teaches nothing: spinning
	// through it costs more than the wake-ups it saves.
	before := c.spinBudget()
	quietFor(c, 150*time.Microsecond)
	if b := c.spinBudget(); b != before {
		t.Fatalf("after a 150µs quiet period: %v, want it unchanged at %v", b, before)
	}

	// A spin that succeeds in the upper half of the budget grows it; one
	// that succeeds early leaves it.
	c.setSpin(100 * time.Microsecond)
	quietFor(c, 70*time.Microsecond)
	if b := c.spinBudget(); b != 125*time.Microsecond {
		t.Fatalf("after a success at 70µs of 100µs: %v, want 125µs", b)
	}
	quietFor(c, 10*time.Microsecond)
	if b := c.spinBudget(); b != 125*time.Microsecond {
		t.Fatalf("after a success at 10µs: %v, want it unchanged", b)
	}
	for range 20 {
		quietFor(c, c.spinBudget()-time.Microsecond)
	}
	if b := c.spinBudget(); b != ceil {
		t.Fatalf("after late successes: %v, want the ceiling %v", b, ceil)
	}

	// A completion with no quiet period open teaches nothing.
	c.setSpin(50 * time.Microsecond)
	c.pl.quietAt = 0
	c.spinQuietEnded()
	if b := c.spinBudget(); b != 50*time.Microsecond {
		t.Fatalf("a completion outside a quiet period moved the budget to %v", b)
	}
}

func TestSpinBudgetUnlearned(t *testing.T) {
	spinHint.Store(0)
	t.Cleanup(func() { spinHint.Store(0) })
	c := spinConn(0)
	c.spinTimedOut()
	quietFor(c, 10*time.Microsecond)
	if b := c.spinBudget(); b != 0 {
		t.Fatalf("WithPollSpin(0) spins %v", b)
	}
	if h := spinHint.Load(); h != 0 {
		t.Fatalf("a connection that never spins set the process's hint to %dµs", h)
	}
	// One beyond what a budget holds is spun in full, as asked.
	long := spinConn(time.Second)
	long.spinTimedOut()
	if b := long.spinBudget(); b != time.Second {
		t.Fatalf("WithPollSpin(1s) spins %v after a spin ran out", b)
	}
	// A ceiling lower than the hint holds a new connection below it.
	spinHint.Store(150)
	if b := spinConn(20 * time.Microsecond).spinBudget(); b != 20*time.Microsecond {
		t.Fatalf("a 20µs ceiling under a 150µs hint: %v", b)
	}
}

// A budget that fell below what the peer needs, on a host where a
// slept-through quiet period ends too late to raise it (its wake-up
// counted in), is found again by a probe: one quiet period in
// spinProbeEvery spins the whole ceiling.
func TestSpinBudgetProbes(t *testing.T) {
	const ceil = 500 * time.Microsecond
	spinHint.Store(0)
	t.Cleanup(func() { spinHint.Store(0) })
	t.Cleanup(hostload.Force(false))
	c := spinConn(ceil)
	for range 30 {
		c.spinTimedOut()
	}
	// open starts a quiet period as the poller does, and reports the
	// budget it spins.
	open := func() time.Duration {
		c.pl.quietAt = 0
		c.spinQuiet()
		return c.spinBudget()
	}
	probes := 0
	for range spinProbeEvery {
		if b := open(); b == ceil {
			probes++
			// The probe ran out: the budget stays where it was.
			c.spinTimedOut()
		} else if b != spinFloor {
			t.Fatalf("a quiet period that is no probe spins %v, want the floor %v", b, spinFloor)
		}
		// Each ended by a wake-up 300µs in: past half the ceiling.
		c.spinQuietEndedAt(c.pl.quietAt + 300)
	}
	if probes != 1 || c.learnedBudget() != spinFloor {
		t.Fatalf("%d probes in %d quiet periods, budget %v after a probe ran out: want 1 and the floor", probes, spinProbeEvery, c.learnedBudget())
	}
	// The next probe catches the completion at 300µs: the budget becomes
	// twice that, held at the ceiling.
	for range spinProbeEvery {
		b := open()
		c.spinQuietEndedAt(c.pl.quietAt + 300)
		if b == ceil {
			break
		}
	}
	if b := c.learnedBudget(); b != ceil {
		t.Fatalf("after a probe caught a 300µs answer: %v, want the ceiling %v", b, ceil)
	}
	// At the ceiling there is nothing to probe for.
	for range 2 * spinProbeEvery {
		if open(); c.pl.probing {
			t.Fatal("a probe with the budget at the ceiling")
		}
		c.spinQuietEndedAt(c.pl.quietAt + 10)
	}
}
