package conn

import (
	"bytes"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// A direction that keeps stalling climbs the ladder one phase at a time,
// with every byte intact; an idle shrink takes it back to the small phase
// and the next large write starts again at the first large phase.
func TestLadderClimbs(t *testing.T) {
	phases := []Phase{{1024, 4}, {8 << 10, 4}, {16 << 10, 8}, {32 << 10, 16}}
	opts := []Option{WithBufferPhases(phases...), WithIdleShrink(200 * time.Millisecond)}
	w, r := pipe2(t, opts, opts)
	streamToSlowReader(t, w, r, 8<<20, 256<<10)
	st := w.Stats()
	t.Logf("writer: phase %d, climbs %d, enlargements %d, stalls %d; reader registered %d bytes", st.SendPhaseIndex, st.Climbs, st.Enlargements, st.CreditStalls, r.Stats().RegisteredBytes)
	if st.SendPhaseIndex != len(phases)-1 || st.Climbs != len(phases)-2 || st.Shrinks != 0 {
		t.Fatalf("writer at phase %d after %d climbs and %d shrinks, want the top (%d) after %d climbs and no shrink",
			st.SendPhaseIndex, st.Climbs, st.Shrinks, len(phases)-1, len(phases)-2)
	}
	if rs := r.Stats(); rs.ShrinksServed != 0 || rs.EnlargementsServed != len(phases)-1 {
		t.Fatalf("reader: %d shrinks served, %d enlargements served; want 0 and %d", rs.ShrinksServed, rs.EnlargementsServed, len(phases)-1)
	}

	// Idle: back to small, then the first large phase again.
	testutil.Eventually(t, 5*time.Second, "the writer back in the small phase", testutil.Bool(func() bool { return w.Stats().SendPhaseIndex == 0 }))
	if st := w.Stats(); st.SendPhaseIndex != 0 || st.Shrinks != 1 {
		t.Fatalf("after idle: phase %d, %d shrinks; want 0 and 1", st.SendPhaseIndex, st.Shrinks)
	}
	more := random(16 << 10)
	transfer(t, w, r, more, writeAll(w))
	if st := w.Stats(); st.SendPhaseIndex != 1 || st.LastEnlargeTo != phases[1].Size {
		t.Fatalf("the next large write: phase %d, to %d bytes; want phase 1 of %d-byte slots", st.SendPhaseIndex, st.LastEnlargeTo, phases[1].Size)
	}
}

// Two ends with different ladders: the receiver provisions the largest
// of its own phases that fits what is asked, and the writer stops
// climbing once given less than it asked for.
func TestLadderReceiverCaps(t *testing.T) {
	w, r := pipe2(t, []Option{WithBufferPhases(Phase{1024, 4}, Phase{8 << 10, 4}, Phase{16 << 10, 8}, Phase{32 << 10, 16})},
		[]Option{WithBufferPhases(Phase{1024, 4}, Phase{8 << 10, 4}, Phase{16 << 10, 4})})
	streamToSlowReader(t, w, r, 4<<20, 128<<10)
	st := w.Stats()
	t.Logf("writer: phase %d, climbs %d, last enlargement to %d-byte slots", st.SendPhaseIndex, st.Climbs, st.LastEnlargeTo)
	if st.Climbs != 1 || st.LastEnlargeTo != 16<<10 {
		t.Fatalf("writer climbed %d times to %d-byte slots; want once, to the receiver's top (16 KiB × 4)", st.Climbs, st.LastEnlargeTo)
	}
}

// streamToSlowReader writes n random bytes in 16 KiB writes to a reader
// that pauses a millisecond every pause bytes, so the writer stalls on
// credits, and checks every byte arrived.
func streamToSlowReader(t *testing.T, w, r *rdmaConn, n, pause int) {
	t.Helper()
	data := random(n)
	got := make(chan []byte, 1)
	go func() {
		b := make([]byte, len(data))
		for off := 0; off < len(b); {
			k, err := r.Read(b[off:min(off+4096, len(b))])
			off += k
			if err != nil {
				t.Errorf("read: %v", err)
				break
			}
			if off%pause < 4096 {
				time.Sleep(time.Millisecond) // a slow reader: the writer stalls and climbs
			}
		}
		got <- b
	}()
	for off := 0; off < len(data); off += 16 << 10 {
		if _, err := w.Write(data[off : off+16<<10]); err != nil {
			t.Fatalf("write: %v", err)
		}
	}
	if b := <-got; !bytes.Equal(b, data) {
		t.Fatal("data differs")
	}
}

// A step up the ladder that the receiver's budget has no room for gets
// the first large phase again, not a refusal: the writer stays large and
// stops climbing.
func TestLadderStepUpShortOfBudget(t *testing.T) {
	phases := []Phase{{1024, 4}, {8 << 10, 4}, {64 << 10, 16}}
	budget := bufpool.NewBudget(2*smallBytes + 64<<10) // room for phase 1, not for 1 MiB
	w, r := pipe2(t, []Option{WithBufferPhases(phases...)}, []Option{WithBufferPhases(phases...), WithBudget(budget)})
	streamToSlowReader(t, w, r, 4<<20, 128<<10)
	st := w.Stats()
	t.Logf("writer: phase %d, climbs %d, enlargements %d, failures %d, last to %d", st.SendPhaseIndex, st.Climbs, st.Enlargements, st.EnlargeFailures, st.LastEnlargeTo)
	if st.Climbs != 1 || st.EnlargeFailures != 0 || st.LastEnlargeTo != phases[1].Size || st.SendPhaseIndex != 1 {
		t.Fatalf("writer: %d climbs, %d failures, last enlargement to %d-byte slots, phase %d; want one climb answered with the first large phase",
			st.Climbs, st.EnlargeFailures, st.LastEnlargeTo, st.SendPhaseIndex)
	}
}

// Stalls count towards a climb only while they come within climbWindow
// of the first: a ring that fills now and then over a long life never
// climbs, one that keeps filling does.
func TestLadderStallsWindow(t *testing.T) {
	var e enlargement
	at := epoch.Add(time.Hour)
	for range 40 {
		e.stall(at)
		at = at.Add(climbWindow / 4)
	}
	if e.stalls >= climbStalls {
		t.Fatalf("40 stalls a quarter of the window apart: %d counted, a climb", e.stalls)
	}
	for range climbStalls {
		e.stall(at)
		at = at.Add(climbWindow / 100)
	}
	if e.stalls < climbStalls {
		t.Fatalf("%d stalls within the window: %d counted, no climb", climbStalls, e.stalls)
	}
}
