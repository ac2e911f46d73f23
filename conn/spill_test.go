package conn

import (
	"fmt"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// A's reader is stuck at B's second rendezvous chunk with no credit (B
// never reads, A's data fills B's ring) while B keeps writing small
// messages. The spill that breaks the both-readers deadlock must not give
// B's writer credits: A's ring is never full (B's writer keeps its last
// credit), so nothing is spilled and B's writes meet back-pressure. (A
// first version spilled on every wake-up and buffered B's whole output.)
func TestSpillKeepsBackPressure(t *testing.T) {
	a, b := conns(t, WithRendezvousThreshold(64<<10), WithRendezvousChunk(64<<10))
	go func() { // fill b's ring with a's data; b never reads
		m := random(1000)
		for {
			if _, err := a.Write(m); err != nil {
				return
			}
		}
	}()
	testutil.Eventually(t, 10*time.Second, "b's ring full: a's writer waiting for credits", creditWaiting(a))
	if _, err := b.Write(random(128 << 10)); err != nil { // two adverts
		t.Fatal(err)
	}
	var wrote atomic.Int64
	go func() {
		m := random(1000)
		for {
			n, err := b.Write(m)
			wrote.Add(int64(n))
			if err != nil {
				return
			}
		}
	}()
	go func() {
		buf := make([]byte, 128<<10)
		io.ReadFull(a, buf) // chunk 1 lands; chunk 2 needs a credit
	}()
	// Fixed: the spill must stay bounded all the while b writes on.
	time.Sleep(3 * time.Second)
	s := a.Stats()
	t.Logf("b wrote %d bytes after the rendezvous message; a spilled %d bytes, read %d", wrote.Load(), s.SpilledBytes, s.BytesIn)
	if s.SpilledBytes > 64<<10 {
		t.Errorf("a holds %d spilled bytes (rings: %d): no back-pressure", s.SpilledBytes, DefaultSlotSize*DefaultSlotCount)
	}
}

// A peer that refills the reader's ring after every spill, keeping the
// rule on the last credit (data while it has more than one, else a torn
// record, which the reader consumes and counts as not received), made
// the reader copy without bound (2.9 MB in 2 s against a 4 KiB ring).
// The copies stop at the bound; the connection stays up.
func TestSpillBounded(t *testing.T) {
	a, b := conns(t, WithRendezvousThreshold(64<<10), WithRendezvousChunk(64<<10))
	go func() { // a's data fills b's ring (b never reads): a keeps one credit
		m := random(1000)
		for {
			if _, err := a.Write(m); err != nil {
				return
			}
		}
	}()
	testutil.Eventually(t, 10*time.Second, "b's ring full: a's writer waiting for credits", creditWaiting(a))
	if _, err := b.Write(random(128 << 10)); err != nil { // two adverts
		t.Fatal(err)
	}
	go func() {
		buf := make([]byte, 128<<10)
		io.ReadFull(a, buf) // chunk 1 takes a's last credit; chunk 2 needs one
	}()
	torn := make([]byte, recordLen)
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); {
		b.mu.Lock()
		credits, err := b.tx[small].credits, b.err
		b.mu.Unlock()
		switch {
		case err != nil:
			t.Fatalf("the peer's connection failed: %v", err)
		case credits > 1:
			forge(t, b, small, encodeImm(kindSmall, small, 0, 512), random(512))
		case credits == 1:
			forge(t, b, small, encodeImm(kindControl, small, 0, recordLen), torn)
		default:
			time.Sleep(time.Millisecond)
		}
	}
	s := a.Stats()
	t.Logf("a spilled %d bytes, refused %d spills; %d torn records", s.SpilledBytes, s.SpillRefusals, s.BadRecords)
	if bound := uint64(DefaultSlotSize * DefaultSlotCount); s.SpilledBytes > bound {
		t.Errorf("a copied %d bytes out of its ring behind the rendezvous message, bound %d", s.SpilledBytes, bound)
	}
	a.mu.Lock()
	err := a.err
	a.mu.Unlock()
	if err != nil {
		t.Errorf("a's connection failed: %v", err)
	}
}

// creditWaiting is an Eventually condition: c's writer waits for credits,
// with no more than the one kept for control records left.
func creditWaiting(c *rdmaConn) func() (bool, string) {
	return func() (bool, string) {
		c.mu.Lock()
		defer c.mu.Unlock()
		credits := c.tx[c.sending].credits
		return c.creditWait && credits <= 1, fmt.Sprintf("waiting for credits %v, %d credits", c.creditWait, credits)
	}
}
