package shm

import (
	"sync/atomic"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A completion travels through a receive slot as the peer wrote it, and
// what a hostile peer writes into the packed kind word is clamped to a
// status and an opcode the owner knows.
func TestRingSlotCompletion(t *testing.T) {
	if got := slotSize(1); got != 40 {
		t.Fatalf("slot of one SGE is %d bytes, want 40", got)
	}
	mem := make([]byte, qpSegSize(4, 1))
	r := newRing(mem, 4, 1)
	sg := []transport.SGE{{Addr: 0x1122334455667788, Length: 1024, LKey: 7}}
	for i := range uint64(6) { // round the ring once
		r.post(i, sg)
		if got := r.sges(i, nil); len(got) != 1 || got[0] != sg[0] {
			t.Fatalf("slot %d: scatter list %+v, want %+v", i, got, sg)
		}
		var wc transport.WorkCompletion
		if r.completed(i, &wc) {
			t.Fatalf("slot %d completed before the peer wrote it", i)
		}
		want := transport.WorkCompletion{Status: transport.StatusRemAccessErr, Opcode: transport.WCRecvRDMAWithImm, ByteLen: 999, Imm: 0xdeadbeef, HasImm: true}
		if i%2 == 1 {
			want = transport.WorkCompletion{Status: transport.StatusSuccess, Opcode: transport.WCRecv, ByteLen: 5}
		}
		r.complete(i, &want)
		if !r.completed(i, &wc) {
			t.Fatalf("slot %d not completed", i)
		}
		if wc.Status != want.Status || wc.Opcode != want.Opcode || wc.ByteLen != want.ByteLen || wc.Imm != want.Imm || wc.HasImm != want.HasImm {
			t.Fatalf("slot %d: completion %+v, want %+v", i, wc, want)
		}
	}
	// A hostile peer sets every bit of the kind word.
	atomic.StoreUint32(word32(mem, r.slot(6)+slKind), ^uint32(0))
	atomic.StoreUint64(word64(mem, r.slot(6)+slFlag), 7)
	var wc transport.WorkCompletion
	if !r.completed(6, &wc) {
		t.Fatal("hostile slot not completed")
	}
	if wc.Status != transport.StatusGeneralErr || wc.Opcode != transport.WCRecv || !wc.HasImm {
		t.Fatalf("hostile kind word read as %+v", wc)
	}
}
