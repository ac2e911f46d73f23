package conn

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// resident counts the pages of b in memory (mincore): for shm's memfd
// arenas, whether they are in the file at all, in either process.
func resident(t *testing.T, b []byte) int {
	t.Helper()
	ps := unix.Getpagesize()
	if uintptr(unsafe.Pointer(&b[0]))%uintptr(ps) != 0 {
		t.Fatalf("ring at %p is not page-aligned", &b[0])
	}
	vec := make([]byte, (len(b)+ps-1)/ps)
	_, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0])))
	if e != 0 {
		t.Fatalf("mincore: %v", e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

// helloed waits for the peer's hello, which says whether it parks: a
// dial returns before it arrives.
func helloed(t *testing.T, cs ...*rdmaConn) {
	t.Helper()
	for _, c := range cs {
		if err := c.Handshake(context.Background()); err != nil {
			t.Fatalf("handshake: %v", err)
		}
	}
}

func parkable(t *testing.T, cs ...*rdmaConn) {
	t.Helper()
	helloed(t, cs...)
	for _, c := range cs {
		if !c.offersParks() || !c.peerParks {
			t.Skipf("provider %s cannot give a registered ring's pages back (verbs pins them): no parking", c.Stats().Provider)
		}
	}
}

// small messages each way: enough to write into every slot of both small
// rings, so that all their pages are in.
func chatter(t *testing.T, a, b *rdmaConn) {
	t.Helper()
	for range 2 * DefaultSlotCount {
		transfer(t, a, b, random(DefaultSlotSize-64), writeAll(a))
		transfer(t, b, a, random(DefaultSlotSize-64), writeAll(b))
	}
}

// After WithIdleShrink of no writes each direction parks, and the pages
// of both small rings leave memory; the next writes wait for the resume,
// find the ring again, and carry their data.
func TestParkReleasesRingPages(t *testing.T) {
	const d = 50 * time.Millisecond
	a, b := conns(t, WithIdleShrink(d))
	parkable(t, a, b)
	chatter(t, a, b)
	ringA, ringB := a.rx[small].buf.Bytes(), b.rx[small].buf.Bytes()
	pages := len(ringA) / unix.Getpagesize()
	if ra, rb := resident(t, ringA), resident(t, ringB); ra != pages || rb != pages {
		t.Fatalf("after the traffic, %d and %d of %d ring pages are in memory; want all", ra, rb, pages)
	}
	last := time.Now()
	testutil.Eventually(t, 10*time.Second, "both directions to park and be served", testutil.Bool(func() bool {
		sa, sb := a.Stats(), b.Stats()
		return sa.Parks == 1 && sb.Parks == 1 && sa.ParksServed == 1 && sb.ParksServed == 1
	}))
	t.Logf("both directions parked %v after the last write (idle %v)", time.Since(last).Round(time.Millisecond), d)
	if ra, rb := resident(t, ringA), resident(t, ringB); ra != 0 || rb != 0 {
		t.Fatalf("parked, %d and %d ring pages are still in memory; want 0", ra, rb)
	}
	if sa, sb := resident(t, a.tx[small].stage.Bytes()), resident(t, b.tx[small].stage.Bytes()); sa != 0 || sb != 0 {
		t.Fatalf("parked, %d and %d pages of the writers' staging are still in memory; want 0", sa, sb)
	}
	if s := a.Stats(); s.FreeSmallErrors != 0 || s.RegisteredBytes != smallBytes {
		t.Errorf("parked: %d release errors, %d bytes registered; want 0 and %d (parking keeps the registration)", s.FreeSmallErrors, s.RegisteredBytes, smallBytes)
	}
	chatter(t, a, b) // each direction resumes and writes into fresh pages
	if sa, sb := a.Stats(), b.Stats(); sa.CreditStalls+sb.CreditStalls != 0 {
		t.Errorf("%d and %d credit stalls: a write waiting for the answer to its park is not one", sa.CreditStalls, sb.CreditStalls)
	}
	testutil.Eventually(t, 10*time.Second, "a.Stats().Parks == 2 && b.Stats().Parks == 2", testutil.Bool(func() bool { return a.Stats().Parks == 2 && b.Stats().Parks == 2 }))
}

// Writes that start while the park is on its way wait for the resume and
// lose nothing: a writer with an idle time of a millisecond parks between
// most of its writes, and the reader checks every sequence number.
func TestParkRacesWrites(t *testing.T) {
	a, b := conns(t, WithIdleShrink(time.Millisecond))
	parkable(t, a, b)
	const n = 3000
	done := make(chan error, 1)
	go func() {
		buf := make([]byte, 8)
		for i := range uint64(n) {
			if _, err := io.ReadFull(b, buf); err != nil {
				done <- err
				return
			}
			if got := binary.LittleEndian.Uint64(buf); got != i {
				done <- errors.New("out of sequence: lost or reordered data")
				return
			}
		}
		done <- nil
	}()
	buf := make([]byte, 8)
	for i := range uint64(n) {
		binary.LittleEndian.PutUint64(buf, i)
		if _, err := a.Write(buf); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if i%4 == 0 {
			time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond) // pauses for parks to start
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// The writer parks once more an idle time after its last write, and
	// that park may still be on its way: wait for the peer to answer it.
	testutil.Eventually(t, 10*time.Second, "!a.isParkPending() && a.Stats().Parks == b.Stats().ParksServed", testutil.Bool(func() bool { return !a.isParkPending() && a.Stats().Parks == b.Stats().ParksServed }))
	s := a.Stats()
	t.Logf("%d writes, %d parks", n, s.Parks)
	if s.Parks == 0 {
		t.Fatal("no parks: the test did not race writes with parks")
	}
}

// A park that finds unread data in the ring is declined, and the pages
// stay: the writer is not held up by its peer's reader, and parks an idle
// period after the reader caught up.
func TestParkDeclinedWithUnreadData(t *testing.T) {
	a, b := conns(t, WithIdleShrink(20*time.Millisecond))
	parkable(t, a, b)
	msg := random(100)
	if _, err := a.Write(msg); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "b.Stats().ParksDeclined >= 1", testutil.Bool(func() bool { return b.Stats().ParksDeclined >= 1 }))
	// The writer may park again an idle time after the decline reached
	// it; each such park is declined while the data stays unread.
	if s := b.Stats(); s.ParksServed != 0 || a.Err() != nil {
		t.Fatalf("after a decline: %d parks served, writer's error %v; want 0 and none", s.ParksServed, a.Err())
	}
	if resident(t, b.rx[small].buf.Bytes()) == 0 {
		t.Fatal("the ring holding unread data was released")
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(b, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("read after the decline: %v, data intact %v", err, bytes.Equal(got, msg))
	}
	testutil.Eventually(t, 10*time.Second, "a.Stats().Parks == 1 && b.Stats().ParksServed == 1", testutil.Bool(func() bool { return a.Stats().Parks == 1 && b.Stats().ParksServed == 1 }))
}

// A park to a receiver that did not offer it, or an answer to a park
// that was not sent, fails the connection.
func TestParkProtocolViolations(t *testing.T) {
	for _, tc := range []struct {
		name    string
		offer   bool
		msg     int
		reverse bool // the server sends it, the client must fail
		// freed: the receiver freed its small ring once the sender
		// enlarged (WithFreeSmallOnEnlarge), so there is nothing to park.
		freed bool
	}{{"not offered", false, lenPark, false, false}, {"answer unasked", true, lenResume, true, false},
		{"small ring freed", true, lenPark, false, true}} {
		t.Run(tc.name, func(t *testing.T) {
			if !tc.offer {
				noOffers(t)
			}
			var opts []Option
			if tc.freed {
				opts = append(opts, WithFreeSmallOnEnlarge())
			}
			from, to := conns(t, opts...)
			helloed(t, from, to) // postParkLocked is for an open connection
			if tc.reverse {
				from, to = to, from
			}
			if tc.freed {
				transfer(t, from, to, random(256<<10), writeAll(from))
				testutil.Eventually(t, 10*time.Second, "to.Stats().SmallFreed", testutil.Bool(func() bool { return to.Stats().SmallFreed }))
			}
			from.mu.Lock()
			err := from.postParkLocked(tc.msg, 0)
			from.mu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			testutil.Eventually(t, 10*time.Second, "to.Err() != nil", testutil.Bool(func() bool { return to.Err() != nil }))
			if !errors.Is(to.Err(), errProtocol) {
				t.Fatalf("error %v, want a protocol error", to.Err())
			}
		})
	}
}

// noOffers makes the connections set up until the test ends offer no
// parking, as over verbs, whose pinned memory cannot give pages back.
func noOffers(t *testing.T) {
	withholdParks.Store(true)
	t.Cleanup(func() { withholdParks.Store(false) })
}

// A receiver that cannot give its ring's pages back offers no parking,
// and its peer never parks.
func TestNoParkWithoutOffer(t *testing.T) {
	noOffers(t)
	a, b := conns(t, WithIdleShrink(10*time.Millisecond))
	helloed(t, a, b)
	if a.offersParks() || a.peerParks || b.peerParks {
		t.Fatalf("offers %v, peers park %v %v; want none", a.offersParks(), a.peerParks, b.peerParks)
	}
	chatter(t, a, b)
	time.Sleep(100 * time.Millisecond) // fixed: no park may happen meanwhile (idle shrink 10 ms)
	if sa, sb := a.Stats(), b.Stats(); sa.Parks+sb.Parks+sa.ParksServed+sb.ParksServed != 0 {
		t.Fatalf("parks %d/%d, served %d/%d; want none", sa.Parks, sb.Parks, sa.ParksServed, sb.ParksServed)
	}
}

// Err is the connection's failure, for the tests.
func (c *rdmaConn) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Each park is counted in rdmagrpc.parks, by side.
func TestParkMetric(t *testing.T) {
	h := newOtelSDK(t)
	a, b := conns(t, h.opts(WithIdleShrink(20*time.Millisecond))...)
	parkable(t, a, b)
	chatter(t, a, b)
	testutil.Eventually(t, 10*time.Second, "a.Stats().Parks == 1 && b.Stats().Parks == 1", testutil.Bool(func() bool { return a.Stats().Parks == 1 && b.Stats().Parks == 1 }))
	testutil.Eventually(t, 10*time.Second, "a.Stats().ParksServed == 1 && b.Stats().ParksServed == 1", testutil.Bool(func() bool { return a.Stats().ParksServed == 1 && b.Stats().ParksServed == 1 }))
	// The writers count theirs when the answer arrives.
	testutil.Eventually(t, 10*time.Second, "!parkedNow(a) && !parkedNow(b)", testutil.Bool(func() bool { return !parkedNow(a) && !parkedNow(b) }))
	// Both ends are in this process: each side counts 2.
	checkPoints(t, "parked", h.metrics(t), telemetry.MetricParks, map[string]int64{
		"rdmagrpc.enlargement.side=" + telemetry.Sender:   2,
		"rdmagrpc.enlargement.side=" + telemetry.Receiver: 2,
	})
}

func parkedNow(c *rdmaConn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.enl.parked
}

// isParkPending says whether a park of ours waits for its answer.
func (c *rdmaConn) isParkPending() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.enl.parked
}
