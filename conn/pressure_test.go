package conn

import (
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
)

// Under a budget that fits two enlarged connections, four busy ones all
// get large buffers in turn: the side short of budget asks the writers of
// its least recently used idle large rings to shrink, and serves once the
// memory is back, instead of refusing until their idle shrink (30 s).
func TestReclaimUnderPressure(t *testing.T) {
	const n = 4
	large := int64(DefaultLargeSize * DefaultLargeCount)
	budget := bufpool.NewBudget(n*smallBytes + 2*large + 16<<10)
	ws, rs := make([]*rdmaConn, n), make([]*rdmaConn, n)
	for i := range n {
		ws[i], rs[i] = pipe2(t, nil, []Option{WithBudget(budget)})
	}
	msg := random(256 << 10)
	deadline := time.Now().Add(20 * time.Second)
	rounds := 0
	for ; time.Now().Before(deadline); rounds++ {
		for i := range n {
			transfer(t, ws[i], rs[i], msg, writeAll(ws[i]))
		}
		done := true
		for i := range n {
			if ws[i].Stats().Enlargements < 2 {
				done = false // each enlarged at least twice: in turn, again and again
			}
		}
		if done {
			break
		}
		time.Sleep(20 * time.Millisecond) // idle long enough to be asked
	}
	var asks, pressureShrinks int
	for i := range n {
		w, r := ws[i].Stats(), rs[i].Stats()
		t.Logf("connection %d: enlargements %d (failures %d), shrinks %d (%d asked for); reader: asks %d, served %d, shrinks served %d",
			i, w.Enlargements, w.EnlargeFailures, w.Shrinks, w.PressureShrinks, r.ShrinkAsks, r.EnlargementsServed, r.ShrinksServed)
		if w.Enlargements < 2 {
			t.Errorf("connection %d enlarged %d times in %d rounds under pressure, want every connection at least twice", i, w.Enlargements, rounds)
		}
		asks += r.ShrinkAsks
		pressureShrinks += w.PressureShrinks
	}
	if asks == 0 || pressureShrinks == 0 {
		t.Errorf("%d asks, %d shrinks under pressure: the memory did not move by asking", asks, pressureShrinks)
	}
	if used, limit := budget.Used(), budget.Limit(); used > limit {
		t.Errorf("budget overdrawn: %d of %d", used, limit)
	}
}
