package conn

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/net/nettest"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Checksummed transfers from 1 MiB to 64 MiB, each between small messages
// on the same connection, in one stream: order and content both checked.
func TestRendezvousTransfers(t *testing.T) {
	a, b := conns(t)
	sizes := []int{1 << 20, 3<<20 + 17, 16 << 20, 64 << 20}
	var msgs [][]byte
	for i, n := range sizes {
		msgs = append(msgs, random(100+i), random(n))
	}
	msgs = append(msgs, random(7))
	total := 0
	for _, m := range msgs {
		total += len(m)
	}
	want := sha256.New()
	for _, m := range msgs {
		want.Write(m)
	}
	done := make(chan error, 1)
	go func() {
		got := sha256.New()
		_, err := io.CopyN(got, b, int64(total))
		if err == nil && !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
			err = errors.New("checksum differs")
		}
		done <- err
	}()
	for _, m := range msgs {
		if _, err := a.Write(m); err != nil {
			t.Fatalf("write %d bytes: %v", len(m), err)
		}
	}
	if err := <-done; err != nil {
		t.Fatalf("read: %v", err)
	}
	sa, sb := a.Stats(), b.Stats()
	// 1 + 1 + 4 + 16 adverts of at most 4 MiB.
	if sa.Rendezvous != 22 || sb.RendezvousIn != 22 || sb.RendezvousBytesIn != uint64(total-100-101-102-103-7) {
		t.Fatalf("writer %d adverts, reader %d adverts and %d bytes; want 22, 22, %d", sa.Rendezvous, sb.RendezvousIn, sb.RendezvousBytesIn, total-413)
	}
	if sb.SmallDataIn != 5 {
		t.Fatalf("%d small messages, want 5", sb.SmallDataIn)
	}
	if sa.Enlargements != 0 {
		t.Fatalf("rendezvous alone enlarged the connection: %+v", sa)
	}
	t.Logf("last 4 MiB read request took %v", sb.LastRendezvousDuration)
}

// Both directions at once, vectored writes mixing every path: no
// deadlock, every byte in order. Rounds, because the race it once lost
// (a read request posted between a writer's slot choice and its post)
// showed in one round of about twenty-five.
func TestRendezvousBothWaysVectored(t *testing.T) {
	for round := range 20 {
		if t.Failed() {
			return
		}
		t.Run(fmt.Sprint(round), testRendezvousBothWaysVectored)
	}
}

func testRendezvousBothWaysVectored(t *testing.T) {
	a, b := conns(t, WithLargeBuffers(DefaultLargeSize, 4)) // 200 KiB goes by rendezvous
	mk := func() (net.Buffers, []byte) {
		v := net.Buffers{random(10), random(5000), random(1 << 20), random(300), random(200 << 10), random(9)}
		return v, bytes.Join(v, nil)
	}
	va, wa := mk()
	vb, wb := mk()
	errc := make(chan error, 4)
	read := func(c *rdmaConn, want []byte) {
		got := make([]byte, len(want))
		_, err := io.ReadFull(c, got)
		if err == nil && !bytes.Equal(got, want) {
			err = errors.New("data differs")
		}
		errc <- err
	}
	go read(a, wb)
	go read(b, wa)
	go func() { _, err := a.WriteBuffers(va); errc <- err }()
	go func() { _, err := b.WriteBuffers(vb); errc <- err }()
	for range 4 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []*rdmaConn{a, b} {
		if s := c.Stats(); s.Rendezvous != 2 || s.SendPhase != "large" || s.BadRecords != 0 {
			t.Fatalf("%d adverts in phase %s, %d bad records; want 2 in large, none bad", s.Rendezvous, s.SendPhase, s.BadRecords)
		}
	}
}

// Registration is paid once: after a warm-up, a steady stream of
// rendezvous transfers registers nothing new on either side.
func TestRendezvousSteadyStateNoRegistrations(t *testing.T) {
	a, b := conns(t, WithRendezvousChunk(1<<20))
	data := random(1 << 20)
	// Warm-up: a write of maxAdverts chunks with nobody reading holds
	// every source region a writer ever holds at once (Write returns once
	// they are advertised); the reader holds one destination.
	if _, err := a.Write(random(maxAdverts << 20)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(b, make([]byte, maxAdverts<<20)); err != nil {
		t.Fatal(err)
	}
	ra, rb := a.pool.Stats().Registrations, b.pool.Stats().Registrations
	for range 50 {
		transfer(t, a, b, data, writeAll(a))
	}
	if da, db := a.pool.Stats().Registrations-ra, b.pool.Stats().Registrations-rb; da != 0 || db != 0 {
		t.Fatalf("%d and %d registrations in steady state, want 0", da, db)
	}
	if s := a.Stats(); s.Rendezvous != 50+maxAdverts {
		t.Fatalf("%d adverts, want %d", s.Rendezvous, 50+maxAdverts)
	}
}

// With no registered memory to spare, the data goes through the rings.
func TestRendezvousFallsBackUnderBudget(t *testing.T) {
	a, b := conns(t, WithBudget(bufpool.NewBudget(2*smallBytes+largeBytes)), WithRendezvousThreshold(64<<10))
	transfer(t, a, b, random(1<<20), writeAll(a))
	if s := a.Stats(); s.Rendezvous != 0 || s.RendezvousFallbacks != 1 {
		t.Fatalf("%d adverts and %d fallbacks, want 0 and 1", s.Rendezvous, s.RendezvousFallbacks)
	}
}

// A reader whose deadline passes while the data is on its way gets a
// time-out, and the next Read gets the data.
func TestRendezvousReadDeadline(t *testing.T) {
	a, b := conns(t)
	data := random(2 << 20)
	b.SetReadDeadline(time.Now().Add(-time.Second))
	if _, err := a.Write(data); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(data))
	if _, err := b.Read(buf); !isTimeout(err) {
		t.Fatalf("read past its deadline: %v, want a time-out", err)
	}
	b.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(b, buf); err != nil || !bytes.Equal(buf, data) {
		t.Fatalf("read after the time-out: %v", err)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// nettest's conformance with every write above a tiny rendezvous
// threshold and small chunks: many adverts per write, concurrent reads,
// deadlines and closes in the middle of transfers.
func TestNettestRendezvous(t *testing.T) {
	nettest.TestConn(t, func() (net.Conn, net.Conn, func(), error) {
		return pipe(t, WithRendezvousThreshold(2048), WithRendezvousChunk(8192))
	})
}

// A forged read request is refused and fails the holder's connection;
// the canary bytes around the requester's destination show that nothing
// was written, and a well-formed request writes exactly its segment.
func TestRendezvousForgedReadRequests(t *testing.T) {
	const advertised = 1<<20 - 100 // the source region has 100 bytes beyond the advert
	cases := []struct {
		name  string
		forge func(r *record, a inAdvert)
		ok    bool
	}{
		{"valid", func(r *record, a inAdvert) {}, true},
		{"wrong token", func(r *record, a inAdvert) { r.rkey ^= 1 }, false},
		{"unknown advert", func(r *record, a inAdvert) { r.count = a.seq + 1 }, false},
		{"stale advert", func(r *record, a inAdvert) { r.count = a.seq - 1 }, false},
		{"source before the advert", func(r *record, a inAdvert) { r.addr -= 64 }, false},
		{"source beyond the advert", func(r *record, a inAdvert) { r.addr += advertised - 16; r.size = 116 }, false},
		{"too long", func(r *record, a inAdvert) { r.size = advertised + 100 }, false},
		{"out of order", func(r *record, a inAdvert) { r.addr += 4096 }, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a, b := conns(t)
			if _, err := a.Write(random(1 << 20)); err != nil { // warm: the next advert is the one under test
				t.Fatal(err)
			}
			io.ReadFull(b, make([]byte, 1<<20))
			if _, err := a.Write(random(advertised)); err != nil {
				t.Fatal(err)
			}
			adv := waitAdvert(t, b)
			dst, err := b.pool.Get(1, 3*4096, transport.AccessLocalWrite|transport.AccessRemoteWrite)
			if err != nil {
				t.Fatal(err)
			}
			defer dst.Release()
			canary := bytes.Repeat([]byte{0xCC}, dst.Len())
			copy(dst.Bytes(), canary)
			r := record{typ: recRead, seq: 1, count: adv.seq, rkey: adv.token, addr: adv.addr, size: 4096,
				addr2: dst.Addr() + 4096, rkey2: dst.RKey()}
			tc.forge(&r, adv)
			b.mu.Lock()
			// Stand in for the reader: its state expects this request.
			b.rdv.reqSeq = r.seq
			b.rdv.req = readReq{active: true, seq: r.seq, n: int(r.size), start: time.Now()}
			err = b.sendRecordLocked(r, time.Time{}, false)
			b.mu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			if tc.ok {
				testutil.Eventually(t, 10*time.Second, "b.rdv.req.landed", testutil.Bool(func() bool { b.mu.Lock(); defer b.mu.Unlock(); return b.rdv.req.landed }))
				got := dst.Bytes()
				if !bytes.Equal(got[:4096], canary[:4096]) || !bytes.Equal(got[8192:], canary[8192:]) {
					t.Fatal("bytes outside the destination segment changed")
				}
				if bytes.Equal(got[4096:8192], canary[4096:8192]) {
					t.Fatal("the destination segment was not written")
				}
				b.mu.Lock()
				b.rdv.req = readReq{}
				b.mu.Unlock()
				return
			}
			testutil.Eventually(t, 10*time.Second, "a.err != nil", testutil.Bool(func() bool { a.mu.Lock(); defer a.mu.Unlock(); return a.err != nil }))
			a.mu.Lock()
			err = a.err
			a.mu.Unlock()
			if !errors.Is(err, errRefusedRead) {
				t.Fatalf("holder's error %v, want a refused read request", err)
			}
			if _, werr := a.Write([]byte("x")); werr == nil {
				t.Fatal("the holder's connection still writes after refusing a read request")
			}
			if !bytes.Equal(dst.Bytes(), canary) {
				t.Fatal("a refused read request wrote into the requester's memory")
			}
		})
	}
}

func waitAdvert(t *testing.T, c *rdmaConn) inAdvert {
	t.Helper()
	var a inAdvert
	testutil.Eventually(t, 10*time.Second, "an advertisement to arrive", testutil.Bool(func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		if len(c.rdv.in) == 0 {
			return false
		}
		a = c.rdv.in[0]
		return true
	}))
	return a
}

// A stream of adverts, with ring messages between some: the reader asks
// for the next advert while the one before is outstanding, never more
// than two requests at once, and every byte arrives in order.
func TestRendezvousPrefetch(t *testing.T) {
	a, b := conns(t)
	var msgs [][]byte
	for i := range 24 {
		msgs = append(msgs, random(1<<20))
		if i%5 == 0 {
			msgs = append(msgs, random(300+i))
		}
	}
	var all []byte
	for _, m := range msgs {
		all = append(all, m...)
	}
	done := make(chan error, 1)
	go func() {
		got := make([]byte, len(all))
		buf := got
		for len(buf) > 0 {
			n, err := b.Read(buf[:min(len(buf), 256<<10)])
			if err != nil {
				done <- err
				return
			}
			b.mu.Lock()
			out := 0
			if b.rdv.req.active && !b.rdv.req.landed {
				out++
			}
			if q := b.rdv.next; q != nil && q.active && !q.landed {
				out++
			}
			b.mu.Unlock()
			if out > 2 {
				done <- fmt.Errorf("%d read requests outstanding", out)
				return
			}
			buf = buf[n:]
		}
		if !bytes.Equal(got, all) {
			done <- errors.New("the stream differs")
			return
		}
		done <- nil
	}()
	for _, m := range msgs {
		if _, err := a.Write(m); err != nil {
			t.Fatalf("write %d bytes: %v", len(m), err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	sb := b.Stats()
	t.Logf("%d adverts in, %d prefetched", sb.RendezvousIn, sb.RendezvousPrefetches)
	if sb.RendezvousIn != 24 || sb.RendezvousPrefetches == 0 {
		t.Fatalf("reader: %d adverts, %d prefetched; want 24 and some", sb.RendezvousIn, sb.RendezvousPrefetches)
	}
}
