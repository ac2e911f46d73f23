package conn

import (
	"encoding/binary"
	"net"
	"sync"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// stubQP takes what a Conn posts and does nothing with it: the fuzz
// target below checks what would have been sent.
type stubQP struct{ sent []transport.SendWR }

func (q *stubQP) Num() uint32              { return 1 }
func (q *stubQP) State() transport.QPState { return transport.QPSRTS }
func (q *stubQP) PostSend(wrs ...transport.SendWR) (int, error) {
	q.sent = append(q.sent, wrs...)
	return len(wrs), nil
}
func (q *stubQP) PostRecv(wrs ...transport.RecvWR) (int, error) { return len(wrs), nil }
func (q *stubQP) SetError() error                               { return nil }
func (q *stubQP) LocalAddr() net.Addr                           { return &net.TCPAddr{} }
func (q *stubQP) RemoteAddr() net.Addr                          { return &net.TCPAddr{} }
func (q *stubQP) PeerPrivate() []byte                           { return nil }
func (q *stubQP) Disconnected() <-chan struct{}                 { return nil }
func (q *stubQP) Disconnect() error                             { return nil }
func (q *stubQP) Close() error                                  { return nil }

// fuzzMemory is registered memory shared by every run of FuzzPeerInput
// in a process: rings to land messages in and a message held for the
// peer, as a connection in the middle of its life has, and the pool
// they come from, which lends each run its large ring (a shrink record
// discards it).
var fuzzMemory = sync.OnceValues(func() (fm fuzzMem, err error) {
	p, err := transport.Get("shm")
	if err != nil {
		return fm, err
	}
	dev, err := p.Open("")
	if err != nil {
		return fm, err
	}
	pd, err := dev.AllocPD()
	if err != nil {
		return fm, err
	}
	if fm.pool, err = bufpool.New(dev, pd, bufpool.Options{Budget: bufpool.NewBudget(0)}); err != nil {
		return fm, err
	}
	for i, sz := range []int{DefaultSlotSize * DefaultSlotCount, 64 << 10, DefaultSlotSize * DefaultSlotCount} {
		if fm.mem[i], err = fm.pool.Get(1, sz, rwAccess); err != nil {
			return fm, err
		}
	}
	return fm, nil
})

type fuzzMem struct {
	pool *bufpool.Pool
	mem  [3]*bufpool.Buffer // small ring, rendezvous message, small staging
}

const rwAccess = transport.AccessLocalWrite | transport.AccessRemoteWrite

// fuzzConn is a connection enlarged in both directions, waiting for the
// ack of its enlargement request 1 (the answer is then ignored: it has
// its large ring already, as after a retry), holding a 40,000-byte
// rendezvous message for the peer (advert 1, token 7), whose completion
// loop is fed by the fuzzer.
func fuzzConn(t *testing.T) (*rdmaConn, *stubQP, *advert) {
	fm, err := fuzzMemory()
	if err != nil {
		t.Skip("no shm device:", err)
	}
	mem := fm.mem
	o := defaults()
	if err := o.validate(); err != nil {
		t.Fatal(err)
	}
	largeRing, err := fm.pool.Get(1, o.largeSize*o.largeCount, rwAccess)
	if err != nil {
		t.Fatal(err)
	}
	// A shrink record discards it first: a second give-back is counted
	// by the pool, nothing more.
	t.Cleanup(largeRing.Release)
	clear(mem[0].Bytes()) // what earlier runs landed
	clear(largeRing.Bytes())
	q := &stubQP{}
	// offered: our hello offered parking, so the fuzzer reaches it.
	c := &rdmaConn{connCore: connCore{id: 1, o: &o}, qp: q, pool: fm.pool, changed: make(chan struct{}), offered: true}
	c.rx[small] = newRxRing(mem[0], o.slotSize, o.slotCount)
	c.rx[large] = newRxRing(largeRing, o.largeSize, o.largeCount)
	c.tx[small] = txRing{addr: 1 << 20, rkey: 5, size: o.slotSize, count: o.slotCount, txCredits: txCredits{credits: 1}, stage: mem[2], stageSize: o.slotSize, stageSlots: o.slotCount - 1}
	c.tx[large] = txRing{addr: 1 << 30, rkey: 6, size: o.largeSize, count: o.largeCount, txCredits: txCredits{credits: 1}}
	c.sending = large
	c.enl = enlargement{sendPhase: sendPhase{phase: phaseSmall, waiting: true}, reqSeq: 1, recvPhase: recvPhase{ring: ringProvisioned, serving: true}}
	a := &advert{seq: 1, token: 7, buf: mem[1], size: 40000}
	c.rdv.seq = 1
	c.rdv.out = []*advert{a}
	return c, q, a
}

// FuzzPeerInput feeds a connection's completion loop a sequence of
// messages from the peer: an immediate and the bytes that landed with it
// (or, with flag bit 0, a well-framed, checksummed record built from
// those bytes, so that the fuzzer reaches the handling of each record
// type). Whatever comes, no panic, and while the connection accepts
// input: credits never above a ring's size, no slot used twice, every
// queued message inside its ring, and every rendezvous write sent from
// inside the advertised message only.
//
// Input: repeated [imm:4][flag:1][n:1][n bytes]; a record's bytes are its
// fields in wire order (type, seq, addr, rkey, size, count, addr2, rkey2).
func FuzzPeerInput(f *testing.F) {
	rec := func(r record) []byte {
		b := make([]byte, 0, 64)
		b = binary.BigEndian.AppendUint32(b, encodeImm(kindControl, small, 0, recordLen))
		b = append(b, 1, 37, r.typ)
		b = binary.BigEndian.AppendUint32(b, r.seq)
		b = binary.BigEndian.AppendUint64(b, r.addr)
		b = binary.BigEndian.AppendUint32(b, r.rkey)
		b = binary.BigEndian.AppendUint32(b, r.size)
		b = binary.BigEndian.AppendUint32(b, r.count)
		b = binary.BigEndian.AppendUint64(b, r.addr2)
		return binary.BigEndian.AppendUint32(b, r.rkey2)
	}
	msg := func(kind, ring, credits, n int, payload ...byte) []byte {
		b := binary.BigEndian.AppendUint32(nil, encodeImm(kind, ring, credits, n))
		return append(append(b, 0, byte(len(payload))), payload...)
	}
	fm, err := fuzzMemory()
	if err != nil {
		f.Skip("no shm device:", err)
	}
	src := fm.mem[1].Addr()
	f.Add(msg(kindSmall, small, 1, 5, 'h', 'e', 'l', 'l', 'o'))
	f.Add(msg(kindLarge, large, 3, 40000))
	f.Add(msg(kindCredit, small, 3, 0))
	f.Add(append(msg(kindEOF, small, 0, 0), msg(kindSmall, small, 0, 1, 'x')...))
	f.Add(msg(kindClose, small, 0, 0))
	f.Add(msg(kindCredit, small, 0, lenPark))
	f.Add(msg(kindCredit, small, 2, lenDecline))
	f.Add(rec(record{typ: recShrink}))
	f.Add(msg(kindReadEnd, small, 0, 1))
	f.Add(rec(record{typ: recRequest, seq: 1, size: DefaultLargeSize, count: DefaultLargeCount}))
	f.Add(rec(record{typ: recAck, seq: 1, addr: 1 << 32, rkey: 9, size: DefaultLargeSize, count: DefaultLargeCount}))
	f.Add(rec(record{typ: recRefuse, seq: 1}))
	f.Add(rec(record{typ: recAdvert, seq: 1, addr: 1 << 32, rkey: 3, size: 1 << 20}))
	f.Add(rec(record{typ: recRead, seq: 1, count: 1, rkey: 7, addr: src, size: 40000, addr2: 1 << 32, rkey2: 9}))
	f.Add(append(rec(record{typ: recRead, seq: 1, count: 1, rkey: 7, addr: src, size: 100, addr2: 1 << 32, rkey2: 9}),
		rec(record{typ: recRead, seq: 2, count: 1, rkey: 7, addr: src + 100, size: 39900, addr2: 1 << 32, rkey2: 9})...))
	f.Fuzz(func(t *testing.T, in []byte) {
		c, q, a := fuzzConn(t)
		c.mu.Lock()
		defer c.mu.Unlock()
		for len(in) >= 6 {
			imm, flag, n := binary.BigEndian.Uint32(in), in[4], int(in[5])
			in = in[6:]
			n = min(n, len(in))
			payload := in[:n]
			in = in[n:]
			if flag&1 != 0 {
				var p [37]byte
				copy(p[:], payload)
				r := record{typ: p[0], seq: binary.BigEndian.Uint32(p[1:]), addr: binary.BigEndian.Uint64(p[5:]),
					rkey: binary.BigEndian.Uint32(p[13:]), size: binary.BigEndian.Uint32(p[17:]), count: binary.BigEndian.Uint32(p[21:]),
					addr2: binary.BigEndian.Uint64(p[25:]), rkey2: binary.BigEndian.Uint32(p[33:])}
				payload = r.encode(make([]byte, recordLen))
			}
			// The bytes land where the peer would have written them: the
			// next slot of the ring the immediate names.
			if kind, _, _, _ := decodeImm(imm); kind == kindSmall || kind == kindLarge || kind == kindControl || kind == kindRecordL {
				r := &c.rx[small]
				if kind == kindLarge || kind == kindRecordL {
					r = &c.rx[large]
				}
				if r.buf != nil { // gone after a shrink: receivedLocked refuses it
					slot := int(r.arrived % uint64(r.count))
					copy(r.buf.Bytes()[slot*r.size:(slot+1)*r.size], payload)
				}
			}
			sent := len(q.sent)
			if err := c.receivedLocked(imm); err != nil {
				return // the connection is reset: nothing more is read
			}
			checkInvariants(t, c, a, q.sent[sent:])
		}
	})
}

func checkInvariants(t *testing.T, c *rdmaConn, a *advert, sent []transport.SendWR) {
	t.Helper()
	for i := range c.tx {
		if tx := &c.tx[i]; tx.credits > tx.count {
			t.Fatalf("ring %d: %d credits for %d slots", i, tx.credits, tx.count)
		}
	}
	for i := range c.rx {
		if r := &c.rx[i]; r.arrived-r.released > uint64(r.count) {
			t.Fatalf("ring %d: %d messages held in %d slots", i, r.arrived-r.released, r.count)
		}
	}
	held := map[[2]int32]bool{}
	for _, e := range c.recvQ {
		if e.ring == rdvRing {
			continue
		}
		if e.spill != nil { // copied out: its slot is free again
			if len(e.spill) != int(e.n) {
				t.Fatalf("spilled message of %d bytes, queued as %d", len(e.spill), e.n)
			}
			continue
		}
		r := &c.rx[e.ring]
		if e.slot < 0 || int(e.slot) >= r.count || e.n <= 0 || int(e.n) > r.size {
			t.Fatalf("queued message %+v outside ring %d (%d slots of %d bytes)", e, e.ring, r.count, r.size)
		}
		k := [2]int32{int32(e.ring), e.slot}
		if held[k] {
			t.Fatalf("slot %d of ring %d queued twice", e.slot, e.ring)
		}
		held[k] = true
	}
	if len(c.rdv.in) > maxAdverts+2 || len(c.rdv.serving) > maxServing {
		t.Fatalf("%d adverts in, %d requests served at once", len(c.rdv.in), len(c.rdv.serving))
	}
	for _, wr := range sent {
		for _, sg := range wr.SG {
			if wr.ID&idRdv != 0 && (sg.Addr < a.buf.Addr() || sg.Addr+uint64(sg.Length) > a.buf.Addr()+uint64(a.size) || sg.LKey != a.buf.LKey()) {
				t.Fatalf("rendezvous write from %#x+%d, outside the advertised %#x+%d", sg.Addr, sg.Length, a.buf.Addr(), a.size)
			}
		}
	}
	if a.requested > a.size {
		t.Fatalf("%d bytes of a %d-byte advert requested", a.requested, a.size)
	}
}
