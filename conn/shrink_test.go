package conn

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// both moves 256 KiB each way between a and b, checked.
func both(t *testing.T, a, b *rdmaConn) {
	t.Helper()
	transfer(t, a, b, random(256<<10), writeAll(a))
	transfer(t, b, a, random(256<<10), writeAll(b))
}

func registered(c *rdmaConn) int64 { return c.Stats().RegisteredBytes }

// After d of no traffic both directions go back to small, and each side
// holds its idle 8 KiB again; the next large write enlarges afresh.
func TestShrinkOnIdle(t *testing.T) {
	const d = 100 * time.Millisecond
	a, b := conns(t, WithIdleShrink(d))
	both(t, a, b)
	if registered(a) <= smallBytes || registered(b) <= smallBytes {
		t.Fatalf("not enlarged: %d and %d bytes registered", registered(a), registered(b))
	}
	last := time.Now()
	testutil.Eventually(t, 10*time.Second, "registered(a) == smallBytes && registered(b) == smallBytes", testutil.Bool(func() bool { return registered(a) == smallBytes && registered(b) == smallBytes }))
	lag := time.Since(last)
	t.Logf("both sides back to %d bytes %v after the last write (idle shrink %v)", smallBytes, lag.Round(time.Millisecond), d)
	if lag > d+time.Second {
		t.Errorf("shrunk %v after the last write, want about %v", lag, d)
	}
	for _, c := range []*rdmaConn{a, b} {
		s := c.Stats()
		if s.Shrinks != 1 || s.ShrinksServed != 1 || s.SendPhase != "small" || s.RecvPhase != "small" || s.SendPhaseIndex != 0 {
			t.Errorf("after the shrink: %d shrinks, %d served, phases %q/%q (index %d); want 1, 1, small, small, 0",
				s.Shrinks, s.ShrinksServed, s.SendPhase, s.RecvPhase, s.SendPhaseIndex)
		}
	}
	both(t, a, b)
	for _, c := range []*rdmaConn{a, b} {
		if s := c.Stats(); s.Enlargements != 2 || s.EnlargementsServed != 2 || s.SendPhaseIndex != 1 {
			t.Errorf("after more large writes: %d enlargements, %d served, phase %d; want 2, 2, 1", s.Enlargements, s.EnlargementsServed, s.SendPhaseIndex)
		}
	}
}

// WithIdleShrink(-1): large for good, as before shrinking existed.
func TestShrinkOff(t *testing.T) {
	a, b := conns(t, WithIdleShrink(-1))
	both(t, a, b)
	before := registered(a)
	time.Sleep(300 * time.Millisecond) // fixed: no shrink may happen meanwhile
	if s := a.Stats(); s.Shrinks != 0 || s.ShrinksServed != 0 || registered(a) != before {
		t.Fatalf("with shrinking off: %d shrinks, %d served, %d bytes registered (was %d)", s.Shrinks, s.ShrinksServed, registered(a), before)
	}
}

// A peer that frees its small ring once enlarged says so in its ack: the
// direction to it stays large.
func TestShrinkNotToAFreedSmallRing(t *testing.T) {
	a, b := conns(t, WithIdleShrink(50*time.Millisecond), WithFreeSmallOnEnlarge())
	transfer(t, a, b, random(256<<10), writeAll(a))
	time.Sleep(300 * time.Millisecond) // fixed: no shrink may happen meanwhile
	if s := a.Stats(); s.Shrinks != 0 || s.SendPhase != "large" {
		t.Fatalf("shrank towards a freed small ring: %d shrinks, phase %q", s.Shrinks, s.SendPhase)
	}
	transfer(t, a, b, random(64<<10), writeAll(a))
}

// shrinkStream writes n bytes of a seeded stream in pieces of random sizes
// (1 B to 1 MiB, log-uniform) with random pauses around d; shrinkCheck reads
// it back and compares.
func shrinkStream(seed uint64, n int, d time.Duration, w io.Writer) error {
	r := rand.New(rand.NewPCG(seed, 1))
	src := rand.New(rand.NewPCG(seed, 2))
	for n > 0 {
		k := min(n, 1<<r.IntN(21))
		b := make([]byte, k)
		for i := range b {
			b[i] = byte(src.Uint32())
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
		n -= k
		if r.IntN(3) == 0 {
			time.Sleep(time.Duration(r.Int64N(int64(3 * d)))) // idle, at times past the idle shrink
		}
	}
	return nil
}

func shrinkCheck(seed uint64, n int, rd io.Reader) error {
	src := rand.New(rand.NewPCG(seed, 2))
	got := make([]byte, 64<<10)
	for n > 0 {
		k, err := rd.Read(got[:min(len(got), n)])
		for i := range k {
			if got[i] != byte(src.Uint32()) {
				return errShrinkCorrupt
			}
		}
		n -= k
		if err != nil && n > 0 {
			return err
		}
	}
	return nil
}

var errShrinkCorrupt = errors.New("a byte differs from the stream written")

// Shrinks racing writes of every size, both ways, with pauses around the
// idle time: every byte arrives, in order, once, and nothing leaks.
func TestShrinkRacingWrites(t *testing.T) {
	const d = 5 * time.Millisecond
	budget := bufpool.NewBudget(64 << 20)
	a, b := conns(t, WithIdleShrink(d), WithBudget(budget))
	total := 48 << 20
	if testing.Short() || os.Getenv("RXE_ADDR") != "" {
		// In the rxe guest (TCG) the emulator would set the time.
		total = 8 << 20
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i, pair := range [][2]*rdmaConn{{a, b}, {b, a}} {
		seed := uint64(i + 1)
		wg.Go(func() { errs <- shrinkStream(seed, total, d, pair[0]) })
		wg.Go(func() { errs <- shrinkCheck(seed, total, pair[1]) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	sa, sb := a.Stats(), b.Stats()
	t.Logf("a: %d enlargements, %d shrinks, %d served; b: %d enlargements, %d shrinks, %d served",
		sa.Enlargements, sa.Shrinks, sa.ShrinksServed, sb.Enlargements, sb.Shrinks, sb.ShrinksServed)
	if sa.Shrinks == 0 || sb.Shrinks == 0 || sa.Enlargements < 2 || sb.Enlargements < 2 {
		t.Errorf("the writes did not race shrinks: want shrinks and re-enlargements on both sides")
	}
	testutil.Eventually(t, 10*time.Second, "registered(a) == smallBytes && registered(b) == smallBytes", testutil.Bool(func() bool { return registered(a) == smallBytes && registered(b) == smallBytes }))
	if sa.Shrinks != sb.ShrinksServed && a.Stats().Shrinks != b.Stats().ShrinksServed {
		t.Errorf("a shrank %d times, b served %d", a.Stats().Shrinks, b.Stats().ShrinksServed)
	}
}

// isLargeRecord matches a control record of type typ going into the
// peer's large ring.
func isLargeRecord(typ byte) func(*fault.Event) bool { return isRecordIn(kindRecordL, typ) }

// A torn shrink record counts as not received: the receiver keeps the
// ring until the writer asks to enlarge again, and then retires it before
// it serves new buffers (the writer starts a new ring from its first
// slot): no byte lost or misplaced, and the memory comes back after.
func TestShrinkRecordCorrupt(t *testing.T) {
	h := faults.MustAdd(fault.Rule{Op: fault.OpPostSend, Action: fault.ActCorrupt, Offset: -1, Match: isLargeRecord(recShrink), Nth: 1})
	defer h.Remove()
	a, b := conns(t, WithProvider(faults.Name()), WithIdleShrink(50*time.Millisecond))
	transfer(t, a, b, random(256<<10), writeAll(a))
	testutil.Eventually(t, 10*time.Second, "a.Stats().Shrinks == 1", testutil.Bool(func() bool { return a.Stats().Shrinks == 1 }))
	if h.Fired() != 1 {
		t.Fatalf("corruption fired %d times, want 1", h.Fired())
	}
	testutil.Eventually(t, 10*time.Second, "b.Stats().BadRecords == 1", testutil.Bool(func() bool { return b.Stats().BadRecords == 1 }))
	if s := b.Stats(); s.ShrinksServed != 0 || s.RecvPhase != "large" {
		t.Fatalf("receiver after a torn shrink record: %d served, phase %s", s.ShrinksServed, s.RecvPhase)
	}
	transfer(t, a, b, random(256<<10), writeAll(a))
	if s := b.Stats(); s.EnlargementsServed != 2 || s.ShrinksServed != 1 {
		t.Fatalf("receiver after the next enlargement: %d served, %d shrinks served; want 2, 1", s.EnlargementsServed, s.ShrinksServed)
	}
	testutil.Eventually(t, 10*time.Second, "registered(a) == smallBytes && registered(b) == smallBytes", testutil.Bool(func() bool { return registered(a) == smallBytes && registered(b) == smallBytes }))
}

// A writer that goes on writing into the large ring it shrank away from
// (a malicious one: the puppet posts by hand with the old address and
// key) is refused, and the memory the ring was is not reached: a
// buffer registered after the ring went holds its canaries.
func TestShrunkRingRefusesWrites(t *testing.T) {
	puppet, victim := conns(t, WithIdleShrink(50*time.Millisecond))
	transfer(t, puppet, victim, random(256<<10), writeAll(puppet))
	puppet.mu.Lock()
	old := puppet.tx[large]
	puppet.mu.Unlock()
	testutil.Eventually(t, 10*time.Second, "victim.Stats().ShrinksServed == 1", testutil.Bool(func() bool { return victim.Stats().ShrinksServed == 1 }))
	canary, err := victim.pool.Get(bufpool.Owner(1<<41), largeBytes, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer canary.Release()
	for i := range canary.Bytes() {
		canary.Bytes()[i] = 0xa5
	}
	want := bytes.Clone(canary.Bytes())
	puppet.mu.Lock()
	for puppet.recordOut && puppet.err == nil {
		puppet.waitLocked(puppet.changed, time.Now().Add(100*time.Millisecond))
	}
	post(t, puppet, transport.SendWR{Opcode: transport.OpWriteWithImm, RemoteAddr: old.addr, RKey: old.rkey,
		Imm: encodeImm(kindLarge, small, 0, 8)}, []byte("12345678"))
	puppet.mu.Unlock()
	verr, perr := connErr(t, victim), connErr(t, puppet)
	t.Logf("victim: %v; puppet: %v", verr, perr)
	mustEqual(t, "a buffer registered after the ring went", canary.Bytes(), want)
}

// The same while the ring is still retiring (the victim has not read
// what is in it): the victim itself refuses the message.
func TestRetiringRingRefusesWrites(t *testing.T) {
	puppet, victim := conns(t, WithIdleShrink(50*time.Millisecond))
	if _, err := puppet.Write(random(64 << 10)); err != nil { // enlarges; the victim reads nothing yet
		t.Fatal(err)
	}
	puppet.mu.Lock()
	old := puppet.tx[large]
	puppet.mu.Unlock()
	testutil.Eventually(t, 10*time.Second, "puppet.Stats().Shrinks == 1", testutil.Bool(func() bool { return puppet.Stats().Shrinks == 1 }))
	testutil.Eventually(t, 10*time.Second, "victim.rx[large].retiring", testutil.Bool(func() bool { victim.mu.Lock(); defer victim.mu.Unlock(); return victim.rx[large].retiring }))
	puppet.mu.Lock()
	for puppet.recordOut && puppet.err == nil {
		puppet.waitLocked(puppet.changed, time.Now().Add(100*time.Millisecond))
	}
	slot := old.msgs % uint64(old.count)
	post(t, puppet, transport.SendWR{Opcode: transport.OpWriteWithImm, RemoteAddr: old.addr + slot*uint64(old.size), RKey: old.rkey,
		Imm: encodeImm(kindLarge, small, 0, 8)}, []byte("12345678"))
	puppet.mu.Unlock()
	if err := connErr(t, victim); !strings.Contains(err.Error(), "after the writer shrank away") {
		t.Fatalf("victim: %v, want the write refused as after the shrink", err)
	}
}

// Idle time counts from the end of a write: one blocked on credits for
// longer than the idle shrink is not followed by a shrink at once.
func TestShrinkCountsFromTheWriteEnd(t *testing.T) {
	const d = 200 * time.Millisecond
	a, b := conns(t, WithIdleShrink(d), WithRendezvousThreshold(-1))
	data := random(4 << 20)
	go func() {
		time.Sleep(2 * d) // the writer waits for credits meanwhile
		io.ReadFull(b, make([]byte, len(data)))
	}()
	if _, err := a.Write(data); err != nil {
		t.Fatal(err)
	}
	time.Sleep(d / 2) // fixed: no shrink may happen meanwhile
	if s := a.Stats(); s.Shrinks != 0 {
		t.Fatalf("shrank %d times within %v of a write's end (idle shrink %v)", s.Shrinks, d/2, d)
	}
	testutil.Eventually(t, 10*time.Second, "a.Stats().Shrinks == 1", testutil.Bool(func() bool { return a.Stats().Shrinks == 1 }))
}

// A request that arrives while the old large ring is still full of
// unread data is refused (not for good) rather than served late: the
// writer backs off, and no ring is provisioned for a request it gave up
// on; once the reader drains the old ring, the receiver is back to small.
func TestEnlargeWhileRetiringIsRefused(t *testing.T) {
	a, b := conns(t, WithIdleShrink(50*time.Millisecond), WithAckTimeout(200*time.Millisecond, 1))
	first := random(64 << 10)
	if _, err := a.Write(first); err != nil { // enlarges; b reads nothing yet
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "a.Stats().Shrinks == 1", testutil.Bool(func() bool { return a.Stats().Shrinks == 1 }))
	second := random(64 << 10)
	done := make(chan error, 1)
	go func() { _, err := a.Write(second); done <- err }()
	testutil.Eventually(t, 10*time.Second, "a.Stats().EnlargeFailures == 1", testutil.Bool(func() bool { return a.Stats().EnlargeFailures == 1 }))
	got := make([]byte, len(first)+len(second))
	if _, err := io.ReadFull(b, got); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, append(first, second...)) {
		t.Fatal("data differs")
	}
	if s := a.Stats(); s.SendPhase != phaseNames[phaseRefused] || s.EnlargeRetryAt.IsZero() {
		t.Fatalf("writer: phase %q, retry at %v; want refused for now", s.SendPhase, s.EnlargeRetryAt)
	}
	testutil.Eventually(t, 10*time.Second, "registered(b) == smallBytes", testutil.Bool(func() bool { return registered(b) == smallBytes }))
}
