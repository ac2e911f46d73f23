package conn

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"
)

// Both sides write a rendezvous message, small ones, and another
// rendezvous message before either reads: each ring fills with the other
// side's data behind an advert, and each reader must then ask for the
// advert at the head of its stream with a read request, a record that
// needs a credit. The last credit is kept for it; taken by the second
// advert, both readers waited forever (found by the soak).
func TestRendezvousBothWaysFullRings(t *testing.T) {
	for i := range 24 {
		// Four large slots (128 KiB, the rendezvous threshold): the
		// 200 KiB messages go by rendezvous and the rings fill.
		a, b := conns(t, WithLargeBuffers(DefaultLargeSize, 4), WithAckTimeout(50*time.Millisecond, 2))
		var msgs [][]byte
		switch i % 4 {
		case 0:
			msgs = [][]byte{random(100), random(200 << 10), random(100), random(64 << 10), random(100), random(200 << 10), random(10)}
		case 1:
			msgs = [][]byte{random(200 << 10), random(64 << 10), random(200 << 10), random(10)}
		case 2:
			msgs = [][]byte{random(100), random(100), random(200 << 10), random(5000), random(200 << 10), random(10)}
		case 3:
			// Advert, data, advert, enlargement request: the ring of
			// each side full, the acks and read requests waiting.
			msgs = [][]byte{random(200 << 10), random(100), random(100), random(200 << 10), random(64 << 10), random(10)}
		}
		exchangeBothWays(t, i, a, b, msgs, time.Duration(i%8)*10*time.Millisecond)
	}
}

// Each side's read requests (one per advert: a message above the chunk
// size is several adverts) take ring slots of the peer's, and a record's
// slot is only released after the data slots before it are read. With
// both readers at an advert and each ring holding the other side's data
// behind it, the last credit is gone after the first read request, and
// neither reader could ask for its next advert (found by the soak). A
// reader stuck so spills the data queued behind its advert to memory of
// its own, releasing those slots.
func TestRendezvousChunksBothWaysFullRings(t *testing.T) {
	var spilled uint64
	defer func() {
		if !t.Failed() && spilled == 0 {
			t.Error("no round spilled: the case this test is for did not happen")
		}
		t.Logf("%d bytes spilled over the rounds", spilled)
	}()
	// At least 16 rounds, more until one spilled: whether the rings fill
	// before the readers start is timing (a writer short of credits polls
	// for them itself, and drains sooner: 1 run in 15
	// went 16 rounds without a spill).
	for i := 0; i < 64 && (i < 16 || spilled == 0); i++ {
		// Four large slots: the rings must fill for the case to happen.
		a, b := conns(t, WithLargeBuffers(DefaultLargeSize, 4), WithRendezvousThreshold(64<<10), WithRendezvousChunk(64<<10), WithAckTimeout(50*time.Millisecond, 2))
		msgs := [][]byte{random(20 << 10), random(128 << 10), random(20 << 10), random(20 << 10), random(20 << 10),
			random(128 << 10), random(100), random(20 << 10), random(20 << 10), random(20 << 10), random(128 << 10), random(10)}
		exchangeBothWays(t, i, a, b, msgs, time.Duration(i%4)*20*time.Millisecond)
		spilled += a.Stats().SpilledBytes + b.Stats().SpilledBytes
	}
}

// exchangeBothWays writes msgs on a and on b at once, lets the rings fill
// for delay before either side reads, and checks that each side reads
// exactly the other's stream within 10 s.
func exchangeBothWays(t *testing.T, round int, a, b *rdmaConn, msgs [][]byte, delay time.Duration) {
	t.Helper()
	want := bytes.Join(msgs, nil)
	errc := make(chan error, 4)
	for _, c := range []*rdmaConn{a, b} {
		go func() {
			for _, m := range msgs {
				if _, err := c.Write(m); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
	}
	time.Sleep(delay) // fixed: the rings fill with nobody reading, the case under test
	for _, c := range []*rdmaConn{a, b} {
		go func() {
			got := make([]byte, len(want))
			_, err := io.ReadFull(c, got)
			if err == nil && !bytes.Equal(got, want) {
				err = errors.New("data differs")
			}
			errc <- err
		}()
	}
	for range 4 {
		select {
		case err := <-errc:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d stuck 10 s:\n%s\n%s", round, a.debugState(), b.debugState())
		}
	}
}
