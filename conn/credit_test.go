package conn

import "testing"

func TestTxCreditsReserve(t *testing.T) {
	for _, tc := range []struct {
		credits              int
		data, record, readOK bool
	}{
		{credits: 0},
		{credits: 1, readOK: true}, // the last credit: read requests only
		{credits: 2, data: true, record: true, readOK: true},
		{credits: 3, data: true, record: true, readOK: true},
	} {
		g := txCredits{credits: tc.credits}
		if got := g.canSendData(); got != tc.data {
			t.Errorf("%d credits: canSendData = %v, want %v", tc.credits, got, tc.data)
		}
		if got := g.canSendRecord(false); got != tc.record {
			t.Errorf("%d credits: canSendRecord(record) = %v, want %v", tc.credits, got, tc.record)
		}
		if got := g.canSendRecord(true); got != tc.readOK {
			t.Errorf("%d credits: canSendRecord(read) = %v, want %v", tc.credits, got, tc.readOK)
		}
	}
}

func TestTxCreditsGrantUseReturn(t *testing.T) {
	for _, tc := range []struct {
		name          string
		count         int // the ring's slots, granted
		use           int // messages posted
		back          []int
		want          int
		wantOverCount bool
	}{
		{name: "grant", count: 4, want: 4},
		{name: "use", count: 4, use: 3, want: 1},
		{name: "zero returned", count: 4, use: 2, back: []int{0}, want: 2},
		{name: "all returned", count: 4, use: 3, back: []int{1, 2}, want: 4},
		{name: "one too many", count: 4, use: 3, back: []int{4}, want: 5, wantOverCount: true},
		{name: "none used, one returned", count: 16, back: []int{1}, want: 17, wantOverCount: true},
		{name: "most a message carries", count: maxCredits, use: maxCredits, back: []int{maxCredits}, want: maxCredits},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var g txCredits
			g.grant(tc.count)
			for range tc.use {
				g.use()
			}
			over := false
			for _, n := range tc.back {
				if !g.returned(n, tc.count) {
					over = true
				}
			}
			if g.credits != tc.want || over != tc.wantOverCount {
				t.Fatalf("credits %d, over the count %v; want %d, %v", g.credits, over, tc.want, tc.wantOverCount)
			}
		})
	}
}

// A phase change: the ack of a large ring grants its count, whatever was
// held for the ring before it.
func TestTxCreditsPhaseChange(t *testing.T) {
	var small, large txCredits
	small.grant(4)
	small.use()
	large.grant(2)
	large.use()
	large.grant(16) // a later ack (climb): a new ring
	if small.credits != 3 || large.credits != 16 {
		t.Fatalf("small %d, large %d credits; want 3, 16", small.credits, large.credits)
	}
	large = txCredits{} // shrunk away: no credits, nothing may go
	if large.canSendData() || large.canSendRecord(true) {
		t.Fatal("a ring with no credits takes messages")
	}
}

// step is one event on a receive ring: a message lands (slot -1: expect
// it to be refused), a slot is consumed, or credits are taken.
type step struct {
	op   string // "land", "refused", "consume", "now", "take", "park", "retire"
	slot int
}

func TestRxCredits(t *testing.T) {
	for _, tc := range []struct {
		name  string
		count int
		steps []step
		// after the steps
		freed                 int
		urgent, due, reserve  bool
		drained, full         bool
		taken                 int // sum of what take and park returned
		arrived, releasedWant uint64
	}{
		{name: "empty", count: 4, drained: true},
		{name: "zero: a ring of 2 wants each credit back", count: 2,
			steps: []step{{"land", 0}, {"consume", 0}},
			freed: 1, due: true, drained: true, arrived: 1, releasedWant: 1},
		{name: "below half a ring", count: 4,
			steps: []step{{"land", 0}, {"consume", 0}},
			freed: 1, drained: true, arrived: 1, releasedWant: 1},
		{name: "half a ring", count: 4,
			steps: []step{{"land", 0}, {"land", 1}, {"consume", 0}, {"consume", 1}},
			freed: 2, due: true, drained: true, arrived: 2, releasedWant: 2},
		{name: "a record is urgent", count: 8,
			steps: []step{{"land", 0}, {"now", 0}},
			freed: 1, urgent: true, due: true, drained: true, arrived: 1, releasedWant: 1},
		{name: "urgent with nothing freed is not due", count: 8,
			steps:  []step{{"land", 0}, {"land", 1}, {"now", 1}},
			urgent: true, arrived: 2},
		{name: "in order: a later slot waits for the earlier", count: 4,
			steps:   []step{{"land", 0}, {"land", 1}, {"land", 2}, {"consume", 2}, {"consume", 1}},
			arrived: 3},
		{name: "in order: the earlier frees all", count: 4,
			steps: []step{{"land", 0}, {"land", 1}, {"land", 2}, {"consume", 2}, {"consume", 1}, {"consume", 0}},
			freed: 3, due: true, drained: true, arrived: 3, releasedWant: 3},
		{name: "full: beyond the credits", count: 2,
			steps: []step{{"land", 0}, {"land", 1}, {"refused", 0}},
			full:  true, reserve: true, arrived: 2},
		{name: "ring wrap", count: 2,
			steps: []step{{"land", 0}, {"land", 1}, {"consume", 0}, {"take", 0}, {"land", 0}, {"consume", 1}, {"consume", 0}},
			freed: 2, due: true, reserve: true, drained: true, taken: 1, arrived: 3, releasedWant: 3},
		{name: "reserve: data into the last credit", count: 4,
			steps: []step{{"land", 0}, {"land", 1}, {"land", 2}, {"land", 3}, {"consume", 0}},
			freed: 1, reserve: true, arrived: 4, releasedWant: 1},
		{name: "reserve: a returned credit counts", count: 4,
			steps: []step{{"land", 0}, {"consume", 0}, {"take", 0}, {"land", 1}, {"land", 2}},
			taken: 1, arrived: 3, releasedWant: 1},
		{name: "take clears urgent", count: 8,
			steps:   []step{{"land", 0}, {"now", 0}, {"take", 0}},
			drained: true, taken: 1, arrived: 1, releasedWant: 1},
		{name: "a park's answer leaves urgent", count: 8,
			steps:  []step{{"land", 0}, {"now", 0}, {"park", 0}},
			urgent: true, drained: true, taken: 1, arrived: 1, releasedWant: 1},
		{name: "retire: owed credits go, nothing more lands", count: 4,
			steps:   []step{{"land", 0}, {"land", 1}, {"consume", 0}, {"retire", 0}, {"consume", 1}, {"refused", 0}},
			drained: true, arrived: 2, releasedWant: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRxCredits(tc.count)
			taken := 0
			for i, s := range tc.steps {
				switch s.op {
				case "land":
					if slot, ok := r.arrive(); !ok || slot != s.slot {
						t.Fatalf("step %d: arrive = %d, %v; want %d, true", i, slot, ok, s.slot)
					}
				case "refused":
					if _, ok := r.arrive(); ok {
						t.Fatalf("step %d: a message landed beyond the credits", i)
					}
				case "consume":
					r.consume(s.slot)
				case "now":
					r.consumeNow(s.slot)
				case "take":
					taken += r.take()
				case "park":
					taken += r.takeForPark()
				case "retire":
					r.retire()
				}
			}
			got := []any{r.freed, r.urgent, r.due(), r.tookReserve(), r.drained(), r.full(), taken, r.arrived, r.released}
			want := []any{tc.freed, tc.urgent, tc.due, tc.reserve, tc.drained, tc.full, tc.taken, tc.arrived, tc.releasedWant}
			for i := range got {
				if got[i] != want[i] {
					t.Fatalf("freed, urgent, due, reserve, drained, full, taken, arrived, released = %v; want %v", got, want)
				}
			}
		})
	}
}

// A message returns at most maxCredits, however many are freed.
func TestRxCreditsTakeBound(t *testing.T) {
	r := rxCredits{count: maxCredits, freed: maxCredits + 3, urgent: true}
	if n := r.take(); n != maxCredits || r.freed != 3 || r.urgent {
		t.Fatalf("take = %d, leaving %d freed, urgent %v; want %d, 3, false", n, r.freed, r.urgent, maxCredits)
	}
}

func TestPiggybackAndCreditDue(t *testing.T) {
	for _, tc := range []struct {
		name                   string
		small, large           rxCredits
		ring, n                int // piggyback
		dueRing                int
		due                    bool
		smallAfter, largeAfter int // freed after piggyback
	}{
		{name: "nothing freed", small: rxCredits{count: 4}, ring: small, dueRing: 0},
		{name: "small only, below half", small: rxCredits{count: 4, freed: 1}, ring: small, n: 1},
		{name: "small, half", small: rxCredits{count: 4, freed: 2}, ring: small, n: 2, dueRing: small, due: true},
		{name: "large first", small: rxCredits{count: 4, freed: 3}, large: rxCredits{count: 16, freed: 1},
			ring: large, n: 1, dueRing: small, due: true, smallAfter: 3},
		{name: "large due first", small: rxCredits{count: 4, freed: 3}, large: rxCredits{count: 16, freed: 8},
			ring: large, n: 8, dueRing: large, due: true, smallAfter: 3},
		{name: "large urgent", large: rxCredits{count: 16, freed: 1, urgent: true},
			ring: large, n: 1, dueRing: large, due: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rx [2]rxRing
			rx[small].rxCredits, rx[large].rxCredits = tc.small, tc.large
			ring, due := creditDue(&rx)
			if ring != tc.dueRing || due != tc.due {
				t.Fatalf("creditDue = %d, %v; want %d, %v", ring, due, tc.dueRing, tc.due)
			}
			ring, n := piggyback(&rx)
			if ring != tc.ring || n != tc.n || rx[small].freed != tc.smallAfter || rx[large].freed != tc.largeAfter {
				t.Fatalf("piggyback = ring %d, %d credits, leaving %d, %d; want %d, %d, leaving %d, %d",
					ring, n, rx[small].freed, rx[large].freed, tc.ring, tc.n, tc.smallAfter, tc.largeAfter)
			}
		})
	}
}
