package conn

import (
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// staged is shm with a NIC's inline limit: connections stage their sends
// in registered memory, as they do over verbs.
var staged = func() *fault.Injector {
	inj := wrapShm("conn-staged")
	inj.SetMaxInline(0)
	return inj
}()

// writeIn writes b in writes of size bytes (grpc-go's are 32 KiB).
func writeIn(c *rdmaConn, size int) func([]byte) error {
	return func(b []byte) error {
		for len(b) > 0 {
			k := min(len(b), size)
			if _, err := c.Write(b[:k]); err != nil {
				return err
			}
			b = b[k:]
		}
		return nil
	}
}

// A stream into a large ring from staging asks for a completion once
// per quarter of the staging slots: most messages go unsignalled, every
// byte arrives, and Close confirms the last ones (a zero-length write)
// at once, leaving nothing behind.
func TestUnsignalledWrites(t *testing.T) {
	a, b := conns(t, WithProvider(staged.Name()))
	if a.inlineMax != 0 {
		t.Fatalf("inline sends up to %d bytes: the staged path is not under test", a.inlineMax)
	}
	const n = 62
	before := unsignaledPosts.Load()
	transfer(t, a, b, random(n*32<<10), writeIn(a, 32<<10))
	got := unsignaledPosts.Load() - before
	// 16 slots: one in 4 signalled, and every post that fills the staging
	// (more of those when the completions are polled late).
	if got < n/4 || got >= n {
		t.Fatalf("%d of %d large messages unsignalled, want at least a quarter and not all", got, n)
	}
	// Close must have unsignalled messages to confirm: one more message
	// at a time until the last went unsignalled (the staging is not full
	// once the reader has everything).
	tail := func() txRing {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.tx[large]
	}
	for i := 0; tail().signaled >= tail().seq; i++ {
		if i == 4 {
			t.Fatalf("4 more messages, each signalled: %+v", tail())
		}
		transfer(t, a, b, random(32<<10), writeAll(a))
	}
	tx := tail()
	t.Logf("%d of %d unsignalled; large ring: %d posted, %d confirmed, signalled up to %d", got, n, tx.seq, tx.done, tx.signaled)

	start := time.Now()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	sent := a.sentLocked()
	a.mu.Unlock()
	if el := time.Since(start); !sent || el >= closeWait {
		t.Fatalf("Close took %v, every write confirmed: %v", el, sent)
	}
}

// Unsignalled messages at the end of a stream do not hold back what
// waits for every write to complete: the idle shrink, then a climb.
func TestUnsignalledThenShrinkAndClimb(t *testing.T) {
	phases := []Phase{{1024, 4}, {8 << 10, 16}, {32 << 10, 16}}
	opts := []Option{WithProvider(staged.Name()), WithBufferPhases(phases...), WithIdleShrink(50 * time.Millisecond)}
	w, r := conns(t, opts...)
	before := unsignaledPosts.Load()
	transfer(t, w, r, random(31*8<<10), writeIn(w, 8<<10))
	if unsignaledPosts.Load() == before {
		t.Fatal("no message went unsignalled")
	}
	testutil.Eventually(t, 5*time.Second, "the writer back in the small phase", testutil.Bool(func() bool { return w.Stats().Shrinks == 1 }))

	// A reader that lags makes the writer stall and climb, with the
	// first phase's last messages unsignalled.
	streamToSlowReader(t, w, r, 4<<20, 256<<10)
	st := w.Stats()
	if st.Climbs == 0 {
		t.Fatalf("writer at phase %d after no climb, want the top", st.SendPhaseIndex)
	}
	// A slow machine can leave the writer idle for the 50 ms of the
	// shrink while the reader drains the ring: the writer is then small
	// again, after a shrink of its own.
	if st.SendPhaseIndex != len(phases)-1 && st.Shrinks < 2 {
		t.Fatalf("writer at phase %d after %d climbs and %d shrinks, want the top", st.SendPhaseIndex, st.Climbs, st.Shrinks)
	}
}
