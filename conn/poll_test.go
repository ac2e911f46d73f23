package conn

import (
	"testing"
	"time"
)

// A completion loop spins only while its connection can still carry
// traffic: once the peer closed, what completes is its receives flushing,
// and a spin then would hold a processor for WithPollSpin after every
// close (here 10 s, so that a spin would show).
func TestNoSpinOnceThePeerClosed(t *testing.T) {
	a, b := conns(t, WithPollSpin(10*time.Second))
	transfer(t, a, b, random(100), writeAll(a)) // both loops have run
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.err != nil
	})
	deadline := time.Now().Add(2 * time.Second)
	for spinners.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d completion loops still spin 2 s after the peer closed", spinners.Load())
		}
		time.Sleep(time.Millisecond)
	}
}
