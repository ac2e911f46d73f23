package conn

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A malicious peer is played by a real Conn, the puppet, whose queue pair
// the test drives by hand: it posts whatever the test forges (records with
// a valid frame and checksum, immediates, raw RDMA writes and reads),
// while its own completion loop keeps running. Everything the victim
// does in answer is its real code.

// forge makes the puppet c post one RDMA write with immediate imm into
// its peer's ring (small or large), in the slot the puppet's own count
// says is next, as a real message would; payload comes from c's record
// staging slot. The completion is taken as a control record's.
func forge(t *testing.T, c *rdmaConn, ring int, imm uint32, payload []byte) {
	t.Helper()
	helloed(t, c) // the puppet posts on an open connection only
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.recordOut && c.err == nil {
		c.waitLocked(c.changed, time.Now().Add(100*time.Millisecond))
	}
	tr := &c.tx[ring]
	if tr.count == 0 { // the peer has no such ring: aim at the small one
		tr = &c.tx[small]
	}
	addr := tr.addr
	switch kind, _, _, _ := decodeImm(imm); kind {
	case kindSmall, kindLarge, kindControl, kindRecordL: // these take a slot
		addr += tr.msgs % uint64(tr.count) * uint64(tr.size)
		tr.msgs++
		tr.credits--
	}
	post(t, c, transport.SendWR{Opcode: transport.OpWriteWithImm, RemoteAddr: addr, RKey: tr.rkey, Imm: imm}, payload)
}

// post posts wr from the puppet c with payload (if any) in c's record
// staging slot; c.mu is held.
func post(t *testing.T, c *rdmaConn, wr transport.SendWR, payload []byte) {
	t.Helper()
	st := &c.tx[small]
	off := st.stageSlots * st.stageSize
	copy(st.stage.Bytes()[off:], payload)
	wr.ID, wr.Signaled = idRecord, true
	if len(payload) > 0 {
		wr.SG = []transport.SGE{{Addr: st.stage.Addr() + uint64(off), Length: uint32(len(payload)), LKey: st.stage.LKey()}}
	}
	if _, err := c.qp.PostSend(wr); err != nil {
		t.Fatalf("puppet: post: %v", err)
	}
	c.recordOut = true
}

// forgeRecord sends r, well framed and checksummed, as a control record
// of the given kind (kindControl: small ring, kindRecordL: large).
func forgeRecord(t *testing.T, c *rdmaConn, kind int, r record) {
	t.Helper()
	ring := small
	if kind == kindRecordL {
		ring = large
	}
	forge(t, c, ring, encodeImm(kind, small, 0, recordLen), r.encode(make([]byte, recordLen)))
}

// bait is registered memory of the puppet's, remotely writable, full of
// canary bytes: a forgery that reaches it shows.
func bait(t *testing.T, e *env) (*bufpool.Buffer, []byte) {
	t.Helper()
	c := e.puppet
	b, err := c.pool.Get(bufpool.Owner(c.id), 3*4096, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	e.release = append(e.release, b.Release)
	canary := bytes.Repeat([]byte{0xCC}, b.Len())
	copy(b.Bytes(), canary)
	return b, canary
}

// snapshot copies registered memory for a later comparison.
func snapshot(b *bufpool.Buffer) []byte { return bytes.Clone(b.Bytes()) }

// connErr waits for c's connection to fail and returns why.
func connErr(t *testing.T, c *rdmaConn) error {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "c.err != nil", testutil.Bool(func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.err != nil }))
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// readsFail checks that c's Read, after whatever data was delivered
// before, fails with an error that is neither a clean end (unless eofOK)
// nor a time-out, within 5 s.
func readsFail(t *testing.T, c *rdmaConn, eofOK bool) error {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 64<<10)
	for {
		_, err := c.Read(buf)
		switch {
		case err == nil:
			continue
		case err == io.EOF && eofOK:
			return err
		case err == io.EOF || isTimeout(err):
			t.Fatalf("read: %v, want the connection failed", err)
		}
		return err
	}
}

// The malicious peer matrix: each forgery is refused, the victim's
// connection fails with an error naming the violation, its Read and Write
// fail, the puppet's connection is closed too (the victim resets it), no
// canary byte outside a grant changed, and once both are closed nothing
// is left (no PD, CQ, QP, MR, budget byte or goroutine).
type env struct {
	victim, puppet *rdmaConn
	// writeErr receives the result of a victim's Write started by the
	// case (nil channel: none).
	writeErr chan error
	opts     []Option
	release  []func() // before the connections close
}

func TestMaliciousPeer(t *testing.T) {
	// waitingForAck starts a victim write above the threshold with the
	// puppet's enlargement server muted, and returns once the request
	// arrived: the victim waits for an ack the test forges.
	waitingForAck := func(t *testing.T, e *env) {
		e.writeErr = make(chan error, 1)
		go func() { _, err := e.victim.Write(random(64 << 10)); e.writeErr <- err }()
		testutil.Eventually(t, 10*time.Second, "e.puppet.enl.reqIn == 1", testutil.Bool(func() bool { e.puppet.mu.Lock(); defer e.puppet.mu.Unlock(); return e.puppet.enl.reqIn == 1 }))
	}
	ack := func(addr uint64, rkey, size, count uint32) record {
		return record{typ: recAck, seq: 1, addr: addr, rkey: rkey, size: size, count: count}
	}
	cases := []struct {
		name string
		// attack forges; check (optional) verifies canaries afterwards.
		attack func(t *testing.T, e *env) (check func(t *testing.T))
		want   string // in the victim's error
	}{
		{"credit overflow", func(t *testing.T, e *env) func(*testing.T) {
			// The victim's small ring credits are all with it: one more
			// than it granted.
			forge(t, e.puppet, small, encodeImm(kindCredit, small, 1, 0), nil)
			return nil
		}, "credits for a ring of 4 slots"},
		{"credits for a ring never granted", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindCredit, large, 1, 0), nil)
			return nil
		}, "credits for a ring of 0 slots"},
		{"credits in bulk", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindCredit, small, maxCredits, 0), nil)
			return nil
		}, "credits for a ring of 4 slots"},
		{"data into the credit kept for records", func(t *testing.T, e *env) func(*testing.T) {
			// The victim reads nothing: the last message takes the
			// writer's last credit, which only a record may take (and
			// which lets a spill give back exactly one). A message past
			// the credits is refused the same way, before it.
			for range DefaultSlotCount {
				forge(t, e.puppet, small, encodeImm(kindSmall, small, 0, 8), []byte("12345678"))
			}
			return nil
		}, "into the last credit of ring 0, kept for control records"},
		{"oversized data length", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindSmall, small, 0, DefaultSlotSize+1), []byte("x"))
			return nil
		}, "data message of 1025 bytes"},
		{"maximum length", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindSmall, small, 0, maxLen), []byte("x"))
			return nil
		}, "data message of 1048575 bytes"},
		{"empty data message", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindSmall, small, 0, 0), nil)
			return nil
		}, "data message of 0 bytes"},
		{"large-ring data before enlargement", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, large, encodeImm(kindLarge, small, 0, 8), []byte("12345678"))
			return nil
		}, "data message of 8 bytes into ring 1"},
		{"large-ring record before enlargement", func(t *testing.T, e *env) func(*testing.T) {
			forgeRecord(t, e.puppet, kindRecordL, record{typ: recRequest, seq: 1, size: DefaultLargeSize, count: DefaultLargeCount})
			return nil
		}, "control record of 49 bytes into ring 1"},
		{"record of the wrong length", func(t *testing.T, e *env) func(*testing.T) {
			b := record{typ: recRefuse, seq: 1}.encode(make([]byte, recordLen+8))
			forge(t, e.puppet, small, encodeImm(kindControl, small, 0, recordLen+8), b[:recordLen+8])
			return nil
		}, "control record of 57 bytes"},
		{"record of unknown type", func(t *testing.T, e *env) func(*testing.T) {
			forgeRecord(t, e.puppet, kindControl, record{typ: 9, seq: 1})
			return nil
		}, "type 9"},
		{"request for an impossible ring", func(t *testing.T, e *env) func(*testing.T) {
			forgeRecord(t, e.puppet, kindControl, record{typ: recRequest, seq: 1, size: 1 << 30, count: 1 << 20})
			return nil
		}, "ring of 1048576 slots"},
		{"ack with no request", func(t *testing.T, e *env) func(*testing.T) {
			forgeRecord(t, e.puppet, kindControl, ack(e.puppet.rx[small].buf.Addr(), e.puppet.rx[small].buf.RKey(), DefaultLargeSize, DefaultLargeCount))
			return nil
		}, "enlargement ack for enlargement request 1, 0 made"},
		{"refusal with no request", func(t *testing.T, e *env) func(*testing.T) {
			forgeRecord(t, e.puppet, kindControl, record{typ: recRefuse, seq: 3})
			return nil
		}, "enlargement refusal for enlargement request 3, 0 made"},
		{"ack for a request not yet made", func(t *testing.T, e *env) func(*testing.T) {
			waitingForAck(t, e)
			b, _ := bait(t, e)
			forgeRecord(t, e.puppet, kindControl, record{typ: recAck, seq: 2, addr: b.Addr(), rkey: b.RKey(), size: 4096, count: 3})
			return nil
		}, "enlargement ack for enlargement request 2, 1 made"},
		{"ack with a wrong rkey", func(t *testing.T, e *env) func(*testing.T) {
			waitingForAck(t, e)
			b, canary := bait(t, e)
			forgeRecord(t, e.puppet, kindControl, ack(b.Addr(), b.RKey()^0x5a5a, 4096, 3))
			return func(t *testing.T) { mustEqual(t, "bait", b.Bytes(), canary) }
		}, "remote access error"},
		{"ack past the end of a region", func(t *testing.T, e *env) func(*testing.T) {
			waitingForAck(t, e)
			b, canary := bait(t, e)
			forgeRecord(t, e.puppet, kindControl, ack(b.Addr()+uint64(b.Len())-16, b.RKey(), 4096, 3))
			return func(t *testing.T) { mustEqual(t, "bait", b.Bytes(), canary) }
		}, "remote access error"},
		{"ack with an oversized ring", func(t *testing.T, e *env) func(*testing.T) {
			waitingForAck(t, e)
			b, canary := bait(t, e)
			// Slot 0 is inside the region; the victim's first write (up
			// to 64 KiB into a 1 MiB slot) runs past its end.
			forgeRecord(t, e.puppet, kindControl, ack(b.Addr(), b.RKey(), maxLen, maxCredits))
			return func(t *testing.T) { mustEqual(t, "bait", b.Bytes(), canary) }
		}, "remote access error"},
		{"ack naming another connection's ring", func(t *testing.T, e *env) func(*testing.T) {
			// A third connection in the puppet's process: its ring is
			// registered memory of another protection domain.
			_, c2, stop, err := pipe(t, e.opts...)
			if err != nil {
				t.Fatal(err)
			}
			e.release = append(e.release, stop)
			other := unwrap(t, c2)
			ring := other.rx[small].buf
			before := snapshot(ring)
			waitingForAck(t, e)
			forgeRecord(t, e.puppet, kindControl, ack(ring.Addr(), ring.RKey(), uint32(other.rx[small].size), uint32(other.rx[small].count)))
			return func(t *testing.T) { mustEqual(t, "the other connection's ring", ring.Bytes(), before) }
		}, "remote access error"},
		{"rendezvous advert of 0 bytes", func(t *testing.T, e *env) func(*testing.T) {
			forgeRecord(t, e.puppet, kindControl, record{typ: recAdvert, seq: 1, addr: 4096, rkey: 1})
			return nil
		}, "rendezvous advert of 0 bytes"},
		{"rendezvous adverts beyond the limit", func(t *testing.T, e *env) func(*testing.T) {
			for i := range maxAdverts + 2 { // nobody reads: none is consumed
				forgeRecord(t, e.puppet, kindControl, record{typ: recAdvert, seq: uint32(i + 1), addr: 4096, rkey: 1, size: 1 << 20})
			}
			return nil
		}, "more than 2 rendezvous adverts outstanding"},
		{"rendezvous advert after end of stream", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindEOF, small, 0, 0), nil)
			forgeRecord(t, e.puppet, kindControl, record{typ: recAdvert, seq: 1, addr: 4096, rkey: 1, size: 100})
			return nil
		}, "rendezvous advert after end of stream"},
		{"data after end of stream", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindEOF, small, 0, 0), nil)
			forge(t, e.puppet, small, encodeImm(kindSmall, small, 0, 8), []byte("12345678"))
			return nil
		}, "data message of 8 bytes into ring 0"},
		{"read request with nothing advertised", func(t *testing.T, e *env) func(*testing.T) {
			b, canary := bait(t, e)
			forgeRecord(t, e.puppet, kindControl, record{typ: recRead, seq: 1, count: 1, rkey: 1, addr: e.victim.tx[small].stage.Addr(),
				size: 4096, addr2: b.Addr(), rkey2: b.RKey()})
			return func(t *testing.T) { mustEqual(t, "bait", b.Bytes(), canary) }
		}, "read request 1 with nothing advertised"},
		{"read request for a transfer already served", func(t *testing.T, e *env) func(*testing.T) {
			// A real transfer, then its last read request again.
			transfer(t, e.victim, e.puppet, random(1<<20), writeAll(e.victim))
			b, canary := bait(t, e)
			e.puppet.mu.Lock()
			seq := e.puppet.rdv.reqSeq
			e.puppet.mu.Unlock()
			forgeRecord(t, e.puppet, kindControl, record{typ: recRead, seq: seq, count: 1, rkey: 1, addr: 4096, size: 4096, addr2: b.Addr(), rkey2: b.RKey()})
			return func(t *testing.T) { mustEqual(t, "bait", b.Bytes(), canary) }
		}, "with nothing advertised"},
		{"end of a read never requested", func(t *testing.T, e *env) func(*testing.T) {
			forge(t, e.puppet, small, encodeImm(kindReadEnd, small, 0, 1), nil)
			return nil
		}, "end of read request 1, none such outstanding"},
		{"end of a read replayed", func(t *testing.T, e *env) func(*testing.T) {
			transfer(t, e.puppet, e.victim, random(1<<20), writeAll(e.puppet))
			e.victim.mu.Lock()
			seq := e.victim.rdv.reqSeq
			e.victim.mu.Unlock()
			forge(t, e.puppet, small, encodeImm(kindReadEnd, small, 0, int(seq)), nil)
			return nil
		}, "end of read request 1, none such outstanding"},
		{"write past the end of the victim's ring", func(t *testing.T, e *env) func(*testing.T) {
			ring := e.victim.rx[small].buf
			before := snapshot(ring)
			e.puppet.mu.Lock()
			post(t, e.puppet, transport.SendWR{Opcode: transport.OpWrite, RemoteAddr: ring.Addr() + uint64(ring.Len()) - 8, RKey: ring.RKey()}, random(64))
			e.puppet.mu.Unlock()
			return func(t *testing.T) {
				mustEqual(t, "the victim's ring", ring.Bytes(), before)
				nicRefused(t, e.puppet)
			}
		}, "connection to"},
		{"write into the victim's staging", func(t *testing.T, e *env) func(*testing.T) {
			stage := e.victim.tx[small].stage
			before := snapshot(stage)
			e.puppet.mu.Lock()
			post(t, e.puppet, transport.SendWR{Opcode: transport.OpWrite, RemoteAddr: stage.Addr(), RKey: e.victim.rx[small].buf.RKey()}, random(64))
			e.puppet.mu.Unlock()
			return func(t *testing.T) {
				mustEqual(t, "the victim's staging", stage.Bytes(), before)
				nicRefused(t, e.puppet)
			}
		}, "connection to"},
		{"data into a ring the writer shrank away from", func(t *testing.T, e *env) func(*testing.T) {
			// The puppet enlarges its direction and shrinks it again; the
			// victim drops the ring. Then the puppet writes into it as if
			// it still had it: the memory is deregistered, and the write
			// is refused before it lands.
			transfer(t, e.puppet, e.victim, random(40<<10), writeAll(e.puppet))
			p := e.puppet
			old := shrinkNow(t, p)
			testutil.Eventually(t, 10*time.Second, "e.victim.Stats().ShrinksServed == 1", testutil.Bool(func() bool { return e.victim.Stats().ShrinksServed == 1 }))
			p.mu.Lock()
			p.tx[large] = old
			p.tx[large].credits = old.count
			p.mu.Unlock()
			forge(t, p, large, encodeImm(kindLarge, small, 0, 8), []byte("12345678"))
			return func(t *testing.T) { nicRefused(t, p) }
		}, "connection to"},
		{"data into a ring still draining after the shrink", func(t *testing.T, e *env) func(*testing.T) {
			// As above, but the victim has not read what the puppet wrote
			// before its shrink: the ring is kept until then, and takes
			// nothing more.
			p := e.puppet
			if _, err := p.Write(random(40 << 10)); err != nil {
				t.Fatal(err)
			}
			old := shrinkNow(t, p)
			testutil.Eventually(t, 10*time.Second, "e.victim.rx[large].retiring", testutil.Bool(func() bool { e.victim.mu.Lock(); defer e.victim.mu.Unlock(); return e.victim.rx[large].retiring }))
			p.mu.Lock()
			p.tx[large] = old
			p.mu.Unlock()
			forge(t, p, large, encodeImm(kindLarge, small, 0, 8), []byte("12345678"))
			return nil
		}, "data message into the large ring after the writer shrank away from it"},
		{"read of the victim's ring", func(t *testing.T, e *env) func(*testing.T) {
			// Receive rings are remotely writable, never readable.
			transfer(t, e.puppet, e.victim, random(100), writeAll(e.puppet))
			ring := e.victim.rx[small].buf
			e.puppet.mu.Lock()
			st := &e.puppet.tx[small]
			off := st.stageSlots * st.stageSize
			copy(st.stage.Bytes()[off:off+64], bytes.Repeat([]byte{0xCC}, 64))
			post(t, e.puppet, transport.SendWR{Opcode: transport.OpRead, RemoteAddr: ring.Addr(), RKey: ring.RKey(),
				SG: []transport.SGE{{Addr: st.stage.Addr() + uint64(off), Length: 64, LKey: st.stage.LKey()}}}, nil)
			e.puppet.mu.Unlock()
			return func(t *testing.T) {
				mustEqual(t, "the puppet's read destination", st.stage.Bytes()[off:off+64], bytes.Repeat([]byte{0xCC}, 64))
				nicRefused(t, e.puppet)
			}
		}, "connection to"},
	}
	for _, tc := range cases {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			goroutines := goleak.IgnoreCurrent()
			budget := bufpool.NewBudget(0)
			opts := []Option{WithProvider(leaks.Name()), WithBudget(budget), WithRendezvousThreshold(64 << 10)}
			victim, puppet := conns(t, opts...)
			puppet.mu.Lock()
			puppet.enl.serving = true // muted: the test answers enlargement requests
			puppet.mu.Unlock()
			e := &env{victim: victim, puppet: puppet, opts: opts}
			// A failed case still gives back what it set up, so that the
			// next case's leak check judges only itself.
			t.Cleanup(func() {
				for _, f := range e.release {
					f()
				}
			})
			check := tc.attack(t, e)
			err := connErr(t, victim)
			if e.writeErr != nil {
				// The write waiting for the ack returns: with an error, or
				// with its data posted into memory the NIC then refused
				// (as a TCP write returns before the reset).
				select {
				case <-e.writeErr:
				case <-time.After(5 * time.Second):
					t.Fatal("the victim's write still blocked 5 s after a forged ack")
				}
			}
			// The NIC's refusal may reach the victim's completion loop
			// after the flush of a write posted before it (the puppet,
			// reset, flushes first under load): either way the write was
			// refused, and the canaries below prove nothing landed.
			nicRefused := tc.want == "remote access error" && strings.Contains(err.Error(), "Flushed")
			if !strings.Contains(err.Error(), tc.want) && !nicRefused {
				t.Fatalf("victim's error %q, want one naming %q", err, tc.want)
			}
			// A peer that ended its stream before the violation: Read
			// reports that end, Write the failure.
			eof := strings.HasSuffix(tc.name, "after end of stream")
			if rerr := readsFail(t, victim, eof); rerr == nil {
				t.Fatal("victim still reads")
			}
			if _, werr := victim.Write([]byte("x")); werr == nil {
				t.Fatal("victim still writes")
			}
			readsFail(t, puppet, false) // reset by the victim
			if check != nil {
				check(t)
			}
			t.Logf("refused: %v", err)
			for _, f := range e.release {
				f()
			}
			e.release = nil
			victim.Close()
			puppet.Close()
			noLeaks(t, budget, goroutines)
		})
	}
}

// nicRefused checks that the puppet's own raw access was refused by the
// victim's side (the victim's QP then fails too, its receives flushed).
func nicRefused(t *testing.T, puppet *rdmaConn) {
	t.Helper()
	if err := connErr(t, puppet); !strings.Contains(err.Error(), "remote access error") {
		t.Fatalf("puppet's error %v, want its access refused", err)
	}
}

// shrinkNow shrinks c's sending direction once its large writes have
// completed, and returns the large ring it had.
func shrinkNow(t *testing.T, c *rdmaConn) txRing {
	t.Helper()
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	for tx := &c.tx[large]; tx.done != tx.seq; {
		c.waitLocked(c.changed, time.Now().Add(100*time.Millisecond))
	}
	old := c.tx[large]
	if err := c.shrinkLocked(); err != nil {
		t.Fatalf("shrink: %v", err)
	}
	return old
}

func mustEqual(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("%s changed (first difference at byte %d)", what, i)
	}
}

// Replays that are indistinguishable from a retry's answers are not
// violations: a duplicate ack and a replayed enlargement request change
// nothing, and the stream stays intact.
func TestMaliciousPeerReplaysHarmless(t *testing.T) {
	victim, puppet := conns(t)
	transfer(t, victim, puppet, random(64<<10), writeAll(victim)) // enlarged
	victim.mu.Lock()
	tx, reqSeq := victim.tx[large], victim.enl.reqSeq
	victim.mu.Unlock()
	rx := puppet.rx[large].buf
	forgeRecord(t, puppet, kindControl, record{typ: recAck, seq: reqSeq, addr: rx.Addr() + 4096, rkey: rx.RKey(), size: 512, count: 2})
	// The victim as the puppet's peer: a replayed request is served with
	// the same buffers, not new ones.
	transfer(t, puppet, victim, random(64<<10), writeAll(puppet))
	served := victim.Stats().EnlargementsServed
	forgeRecord(t, puppet, kindControl, record{typ: recRequest, seq: 1, size: DefaultLargeSize, count: DefaultLargeCount})
	testutil.Eventually(t, 10*time.Second, "victim.Stats().StaleRecords+puppet.Stats().StaleRecords >= 2", testutil.Bool(func() bool { return victim.Stats().StaleRecords+puppet.Stats().StaleRecords >= 2 }))
	transfer(t, victim, puppet, random(200<<10+7), writeAll(victim))
	transfer(t, puppet, victim, random(200<<10+7), writeAll(puppet))
	victim.mu.Lock()
	defer victim.mu.Unlock()
	if victim.tx[large].addr != tx.addr || victim.tx[large].rkey != tx.rkey || victim.tx[large].size != tx.size {
		t.Fatal("a replayed ack changed the buffers in use")
	}
	if victim.st.EnlargementsServed != served || victim.err != nil {
		t.Fatalf("after a replayed request: %d served (was %d), error %v", victim.st.EnlargementsServed, served, victim.err)
	}
}
