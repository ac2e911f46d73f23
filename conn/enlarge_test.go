package conn

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// faults wraps shm; tests add rules to it and remove them when done.
var faults = wrapShm("conn-test-fault")

func conns(t *testing.T, opts ...Option) (*rdmaConn, *rdmaConn) {
	t.Helper()
	return connsOf(t, pipe, opts...)
}

// connsOf is the two Conns of a pipe made by p (pipe, earlyPipe), closed
// when the test ends.
func connsOf(t *testing.T, p func(testing.TB, ...Option) (net.Conn, net.Conn, func(), error), opts ...Option) (*rdmaConn, *rdmaConn) {
	t.Helper()
	a, b, stop, err := p(t, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return unwrap(t, a), unwrap(t, b)
}

// unwrap is the connection a dial's Conn hands its calls to once its
// negotiation is over (lazy.go): the upgraded one, for tests that look
// inside it.
func unwrap(t testing.TB, nc net.Conn) *rdmaConn {
	t.Helper()
	c := nc.(*Conn)
	if c.rdma != nil {
		return c.rdma
	}
	if c.tcp.neg == nil {
		t.Fatalf("the connection is over TCP: %s", c.Stats().ProviderReason)
	}
	r, err := c.tcp.settled(context.Background())
	if err != nil {
		t.Fatalf("the dial's negotiation: %v", err)
	}
	if r == nil {
		t.Fatalf("the dial stayed on TCP: %s", c.Stats().ProviderReason)
	}
	return r
}

// transfer writes data on w with write and checks r reads exactly it.
func transfer(t *testing.T, w, r net.Conn, data []byte, write func([]byte) error) {
	t.Helper()
	got := make(chan []byte, 1)
	go func() {
		b := make([]byte, len(data))
		if _, err := io.ReadFull(r, b); err != nil {
			t.Errorf("read: %v", err)
		}
		got <- b
	}()
	if err := write(data); err != nil {
		t.Fatalf("write: %v", err)
	}
	if b := <-got; !bytes.Equal(b, data) {
		t.Fatal("data differs after the transfer")
	}
}

func random(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func writeAll(c net.Conn) func([]byte) error {
	return func(b []byte) error { _, err := c.Write(b); return err }
}

const smallBytes = 2 * DefaultSlotSize * DefaultSlotCount // ring + staging
const largeBytes = DefaultLargeSize * DefaultLargeCount

// stagedLarge is what c registers to stage large sends: nothing where the
// provider sends inline from the caller's memory (shm).
func stagedLarge(c *rdmaConn) int {
	if c.inlineMax >= DefaultLargeSize {
		return 0
	}
	return largeBytes
}

func TestEnlargeBothDirections(t *testing.T) {
	a, b := conns(t)
	for _, c := range []*rdmaConn{a, b} {
		if s := c.Stats(); s.RegisteredBytes != smallBytes || s.SendPhase != "small" || s.RecvPhase != "small" {
			t.Fatalf("idle connection: %+v, want %d registered bytes, small phases", s, smallBytes)
		}
	}
	transfer(t, a, b, random(100), writeAll(a)) // below the threshold
	if s := a.Stats(); s.SendPhase != "small" || s.Enlargements != 0 {
		t.Fatalf("small write enlarged: %+v", s)
	}
	transfer(t, a, b, random(100<<10), writeAll(a))
	sa, sb := a.Stats(), b.Stats()
	if sa.SendPhase != "large" || sa.Enlargements != 1 || sa.LastEnlargeFrom != DefaultSlotSize || sa.LastEnlargeTo != DefaultLargeSize || sa.LastEnlargeOutcome != "enlarged" {
		t.Fatalf("writer after a large write: %+v", sa)
	}
	if sb.RecvPhase != "large" || sb.EnlargementsServed != 1 || sb.SendPhase != "small" {
		t.Fatalf("reader after a large write: %+v", sb)
	}
	if sa.RegisteredBytes != int64(smallBytes+stagedLarge(a)) || sb.RegisteredBytes != smallBytes+largeBytes {
		t.Fatalf("registered bytes %d and %d, want %d and %d", sa.RegisteredBytes, sb.RegisteredBytes, smallBytes+stagedLarge(a), smallBytes+largeBytes)
	}
	t.Logf("enlargement took %v", sa.LastEnlargeDuration)
	transfer(t, b, a, random(100<<10), writeAll(b)) // the other direction, on its own
	if sb := b.Stats(); sb.SendPhase != "large" || sb.Enlargements != 1 || sb.RegisteredBytes != int64(smallBytes+largeBytes+stagedLarge(b)) {
		t.Fatalf("second direction: %+v", sb)
	}
	transfer(t, a, b, random(1<<20), writeAll(a)) // no second enlargement
	if sa := a.Stats(); sa.Enlargements != 1 {
		t.Fatalf("enlarged twice: %+v", sa)
	}
}

func TestWriteBuffersFigure5(t *testing.T) {
	t.Run("LargeFirst", func(t *testing.T) {
		a, b := conns(t)
		v := net.Buffers{random(5000), random(100), random(200)}
		transfer(t, a, b, bytes.Join(v, nil), func([]byte) error { _, err := a.WriteBuffers(v); return err })
		if s := b.Stats(); s.SmallDataIn != 0 || s.LargeDataIn != 3 {
			t.Fatalf("large element first: %d small and %d large data messages, want 0 and 3", s.SmallDataIn, s.LargeDataIn)
		}
	})
	t.Run("SmallPrefix", func(t *testing.T) {
		a, b := conns(t)
		v := net.Buffers{random(100), random(300), random(5000), random(50)}
		transfer(t, a, b, bytes.Join(v, nil), func([]byte) error { _, err := a.WriteBuffers(v); return err })
		// The prefix went through the small buffers before the
		// enlargement; the large element and what follows, after it.
		if s := b.Stats(); s.SmallDataIn != 2 || s.LargeDataIn != 2 {
			t.Fatalf("small prefix: %d small and %d large data messages, want 2 and 2", s.SmallDataIn, s.LargeDataIn)
		}
	})
}

// isRecord matches the control record of type typ on its way out into
// the peer's small ring.
func isRecord(typ byte) func(*fault.Event) bool { return isRecordIn(kindControl, typ) }

// isRecordIn matches a control record of type typ on its way out, sent
// as kind (kindControl: into the small ring; kindRecordL: the large).
func isRecordIn(kind int, typ byte) func(*fault.Event) bool {
	return func(ev *fault.Event) bool {
		if ev.Send == nil || ev.Send.Opcode != transport.OpWriteWithImm {
			return false
		}
		if k, _, _, _ := decodeImm(ev.Send.Imm); k != kind {
			return false
		}
		p := ev.Payload()
		return len(p) == recordLen && p[4] == typ
	}
}

// isRecordArrival matches the arrival of a control record (its receive
// completion).
func isRecordArrival(ev *fault.Event) bool {
	if ev.WC == nil || ev.WC.Status != transport.StatusSuccess || ev.WC.Opcode != transport.WCRecvRDMAWithImm {
		return false
	}
	kind, _, _, _ := decodeImm(ev.WC.Imm)
	return kind == kindControl
}

// A late control record (here the request, so the ack comes late) makes
// the writer time out and ask again; the late answer is recognised as
// stale and the retry's acknowledgement is used.
func TestAckTimeoutIsRetried(t *testing.T) {
	h := faults.MustAdd(fault.Rule{Op: fault.OpCompletion, Action: fault.ActDelay, Delay: 500 * time.Millisecond, Match: isRecordArrival, Nth: 1})
	defer h.Remove()
	a, b := conns(t, WithProvider(faults.Name()), WithAckTimeout(200*time.Millisecond, 3))
	transfer(t, a, b, random(100<<10), writeAll(a))
	if h.Fired() != 1 {
		t.Fatalf("delay fired %d times, want 1", h.Fired())
	}
	sa := a.Stats()
	if sa.SendPhase != "large" || sa.Enlargements != 1 || sa.LastEnlargeDuration < 200*time.Millisecond {
		t.Fatalf("after a late ack: %+v", sa)
	}
	if sb := b.Stats(); sb.EnlargementsServed != 1 { // every answer names the same buffers
		t.Fatalf("receiver provisioned %d times", sb.EnlargementsServed)
	}
	t.Logf("writer: %d stale answers ignored, enlargement took %v", sa.StaleRecords, sa.LastEnlargeDuration)
}

func TestAckCorruptTailIsRetried(t *testing.T) {
	h := faults.MustAdd(fault.Rule{Op: fault.OpPostSend, Action: fault.ActCorrupt, Offset: -1, Match: isRecord(recAck), Nth: 1})
	defer h.Remove()
	a, b := conns(t, WithProvider(faults.Name()), WithAckTimeout(200*time.Millisecond, 2))
	transfer(t, a, b, random(100<<10), writeAll(a))
	if sa := a.Stats(); h.Fired() != 1 || sa.BadRecords != 1 || sa.SendPhase != "large" {
		t.Fatalf("after a corrupt ack (fired %d): %+v", h.Fired(), sa)
	}
}

func TestEnlargeRefusedByBudget(t *testing.T) {
	// Room for both connections' small buffers, not for a large ring.
	a, b := conns(t, WithBudget(bufpool.NewBudget(2*smallBytes+largeBytes/2)))
	transfer(t, a, b, random(64<<10), writeAll(a))
	sa, sb := a.Stats(), b.Stats()
	if sa.SendPhase != phaseNames[phaseRefused] || sa.EnlargeFailures != 1 || sb.EnlargeRefusals != 1 || sb.RecvPhase != "small" {
		t.Fatalf("refused enlargement: writer %+v reader %+v", sa, sb)
	}
	if sb.SmallDataIn != 64 { // 64 KiB in 1 KiB slots
		t.Fatalf("%d small data messages, want 64", sb.SmallDataIn)
	}
}

func TestEnlargeRegistrationFailure(t *testing.T) {
	h := faults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg, MinLen: largeBytes})
	defer h.Remove()
	a, b := conns(t, WithProvider(faults.Name()))
	transfer(t, a, b, random(64<<10), writeAll(a))
	if sa, sb := a.Stats(), b.Stats(); h.Fired() == 0 || sa.SendPhase != phaseNames[phaseRefused] || sb.EnlargeRefusals != 1 {
		t.Fatalf("registration refused (fired %d): writer %+v reader %+v", h.Fired(), sa, sb)
	}
}

func TestWriteDeadlineWhileWaitingForAck(t *testing.T) {
	h := faults.MustAdd(fault.Rule{Op: fault.OpPostSend, Action: fault.ActDrop, Match: isRecord(recAck)})
	defer h.Remove()
	a, _ := conns(t, WithProvider(faults.Name()), WithAckTimeout(10*time.Second, 0))
	a.SetWriteDeadline(time.Now().Add(150 * time.Millisecond))
	start := time.Now()
	n, err := a.Write(random(64 << 10))
	if n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) > 5*time.Second {
		t.Fatalf("write waiting for a lost ack: %d, %v after %v; want 0, deadline exceeded, promptly", n, err, time.Since(start))
	}
}

func TestCloseUnblocksWriteWaitingForAck(t *testing.T) {
	h := faults.MustAdd(fault.Rule{Op: fault.OpPostSend, Action: fault.ActDrop, Match: isRecord(recAck)})
	defer h.Remove()
	a, _ := conns(t, WithProvider(faults.Name()), WithAckTimeout(10*time.Second, 0))
	errc := make(chan error, 1)
	go func() { _, err := a.Write(random(64 << 10)); errc <- err }()
	testutil.Eventually(t, 10*time.Second, "the write waits for the ack", testutil.Bool(func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.enl.waiting && a.enl.reqSeq > 0
	}))
	a.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("write after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not unblock a write waiting for the ack")
	}
}

// With WithFreeSmallOnEnlarge the receiving side deregisters its
// small ring once the peer writes into the large one; everything still
// works afterwards (records and credits travel in the large ring), in
// both directions, and the registered bytes say so exactly.
func TestFreeSmallOnEnlarge(t *testing.T) {
	a, b := conns(t, WithFreeSmallOnEnlarge())
	transfer(t, a, b, random(100), writeAll(a)) // a small message first
	transfer(t, a, b, random(100<<10), writeAll(a))
	if s := b.Stats(); !s.SmallFreed || s.RegisteredBytes != smallBytes/2+largeBytes {
		t.Fatalf("receiver after enlargement: %+v, want its small ring freed and %d bytes", s, smallBytes/2+largeBytes)
	}
	if s := a.Stats(); s.SmallFreed || s.RegisteredBytes != int64(smallBytes+stagedLarge(a)) {
		t.Fatalf("sender after enlargement: %+v, want %d bytes", s, smallBytes+stagedLarge(a))
	}
	// The other direction enlarges too: its request and ack travel in
	// rings that are large on one side.
	transfer(t, b, a, random(100<<10), writeAll(b))
	for _, c := range []*rdmaConn{a, b} {
		if s := c.Stats(); !s.SmallFreed || s.RegisteredBytes != int64(smallBytes/2+largeBytes+stagedLarge(c)) {
			t.Fatalf("after both enlargements: %+v, want %d bytes", s, smallBytes/2+largeBytes+stagedLarge(c))
		}
	}
	// Small writes, a rendezvous (advert and read request are records)
	// and a half-close, all after the small rings are gone.
	transfer(t, a, b, random(10), writeAll(a))
	transfer(t, b, a, random(1<<20), writeAll(b))
	transfer(t, a, b, random(1<<20+5), writeAll(a))
	if err := a.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if n, err := b.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("read after the peer's CloseWrite: %d, %v; want io.EOF", n, err)
	}
}

// A connection whose set-up fails (here its first registration, as when
// the process is out of file descriptors or memory) returns the error
// and releases what it had, without touching a nil connection.
func TestDialSetupFailure(t *testing.T) {
	waitLingering(t) // earlier tests' connections finish their teardown
	ReleaseKits()    // so that the dial registers its rings
	l, err := Listen(t.Context(), testAddr(), WithProvider(faults.Name()))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	h := faults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg, Limit: 1})
	defer h.Remove()
	c, err := Dial(t.Context(), l.Addr().String(), WithProvider(faults.Name()), WithoutTCP())
	if err == nil {
		c.Close()
		t.Fatal("dial succeeded with its registration refused")
	}
	if h.Fired() != 1 {
		t.Fatalf("rule fired %d times", h.Fired())
	}
	// The listener holds nothing before a request: anything live leaked.
	if live := faults.Live(); live.PDs != 0 || live.MRs != 0 || live.CQs != 0 {
		t.Fatalf("live after the failed dial: %+v", live)
	}
}

// A refusal is not for good: large writes during the back-off go through
// the small ring without asking, the first one after it asks again, and
// the budget, with room by then, serves it.
func TestEnlargeRetriedAfterBackoff(t *testing.T) {
	h := faults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg, MinLen: largeBytes, Nth: 1})
	defer h.Remove()
	a, b := conns(t, WithProvider(faults.Name()))
	transfer(t, a, b, random(64<<10), writeAll(a))
	sa := a.Stats()
	if h.Fired() != 1 || sa.SendPhase != phaseNames[phaseRefused] || sa.EnlargeRetryAt.IsZero() {
		t.Fatalf("first enlargement (fired %d): phase %q, retry at %v; want refused with a retry time", h.Fired(), sa.SendPhase, sa.EnlargeRetryAt)
	}
	if wait := time.Until(sa.EnlargeRetryAt); wait < enlargeBackoffMin/2 || wait > enlargeBackoffMin {
		t.Fatalf("retry in %v, want about %v", wait, enlargeBackoffMin)
	}
	transfer(t, a, b, random(64<<10), writeAll(a)) // within the back-off
	if s := a.Stats(); s.EnlargeFailures != 1 || s.Enlargements != 0 {
		t.Fatalf("a write during the back-off asked again: %d failures, %d enlargements", s.EnlargeFailures, s.Enlargements)
	}
	time.Sleep(time.Until(sa.EnlargeRetryAt) + 10*time.Millisecond) // fixed: the back-off must be over
	transfer(t, a, b, random(64<<10), writeAll(a))
	if s, sb := a.Stats(), b.Stats(); s.Enlargements != 1 || s.SendPhase != "large" || !s.EnlargeRetryAt.IsZero() || sb.EnlargementsServed != 1 {
		t.Fatalf("after the back-off: %d enlargements, phase %q, retry at %v, %d served; want 1, large, none, 1",
			s.Enlargements, s.SendPhase, s.EnlargeRetryAt, sb.EnlargementsServed)
	}
}

// A connection posts the receives of its small ring only; a reader posts
// those of a large ring before its acknowledgement tells the writer of
// it, and the large ring's traffic runs on them.
func TestReceivesPostedForTheRingInUse(t *testing.T) {
	a, b := conns(t)
	recvs := func(c *rdmaConn) (posted, count int) {
		c.mu.Lock()
		defer c.mu.Unlock()
		return int(c.recvs), c.rx[large].count
	}
	small := a.smallRecvs()
	if ra, _ := recvs(a); ra != small {
		t.Fatalf("receives posted %d, want %d (the small ring's)", ra, small)
	}
	transfer(t, a, b, random(100<<10), writeAll(a))
	if s := b.Stats(); s.RecvPhase != "large" {
		t.Fatalf("reader after a large write: %+v", s)
	}
	ra, _ := recvs(a)
	rb, count := recvs(b)
	if ra != small || rb != small+count {
		t.Fatalf("receives posted %d (writer) and %d (reader), want %d and %d", ra, rb, small, small+count)
	}
	for range 20 { // the large ring's slots, many times over
		transfer(t, a, b, random(100<<10), writeAll(a))
	}
	// The traffic may have climbed the reader to a deeper phase: its
	// receives follow the ring in use, whichever it is.
	if rb2, count2 := recvs(b); rb2 != small+count2 {
		t.Fatalf("receives posted %d after the traffic, want %d (the small ring's and the %d of the ring in use)", rb2, small+count2, count2)
	}
}
