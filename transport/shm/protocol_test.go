package shm

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"reflect"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/internal/protodoc"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// TestProtocolVectorsShm holds the shm socket messages and shared memory
// layouts to the test vectors shm-* of doc/protocol.md: each vector's
// fields encode to its bytes, and its bytes decode to its fields.
func TestProtocolVectorsShm(t *testing.T) {
	vs := protodoc.Load(t)
	one := func(typ byte) func(*testing.T, *protodoc.Vector) {
		return func(t *testing.T, v *protodoc.Vector) { checkOneByte(t, v, typ) }
	}
	checks := map[string]func(*testing.T, *protodoc.Vector){
		"shm-connect":        checkInfo,
		"shm-connect-held":   checkInfo,
		"shm-accept":         checkInfo,
		"shm-accept-named":   checkInfo,
		"shm-reject-peer":    checkReject,
		"shm-reject-empty":   checkReject,
		"shm-ready":          one(msgReady),
		"shm-memreq":         checkMemReq,
		"shm-memrep-ok":      checkMemRep,
		"shm-memrep-refused": checkMemRep,
		"shm-errnote":        one(msgErrNote),
		"shm-disconnect":     one(msgDisconnect),
		"shm-wake":           one(msgWake),
		"shm-needfds":        one(msgNeedFDs),
		"shm-fds":            one(msgFDs),
		"shm-recv-slot":      checkRecvSlot,
		"shm-mr-entry":       checkMREntry,
	}
	for name, check := range checks {
		v, ok := vs[name]
		if !ok {
			t.Errorf("doc/protocol.md has no vector %s", name)
			continue
		}
		t.Run(name, func(t *testing.T) {
			check(t, v)
			v.Done(t)
		})
	}
	for _, n := range protodoc.Names(vs, "shm-") {
		if checks[n] == nil {
			t.Errorf("vector %s (doc line %d) is checked by no test", n, vs[n].Line)
		}
	}
}

func checkInfo(t *testing.T, v *protodoc.Vector) {
	typ := byte(v.Uint(t, "type"))
	addr, err := netip.ParseAddrPort(v.String(t, "addr"))
	if err != nil {
		t.Fatal(err)
	}
	m := qpInfo{
		num: uint32(v.Uint(t, "num")), pd: uint32(v.Uint(t, "pd")),
		recvCap: uint32(v.Uint(t, "recv_cap")), recvSGE: uint32(v.Uint(t, "recv_sge")), cqCap: uint32(v.Uint(t, "cq_cap")),
		ringOff: v.Uint(t, "ring_off"), cqOff: v.Uint(t, "cq_off"), cqID: v.Uint(t, "cq_id"), token: v.Uint(t, "token"),
		addr: addr, private: v.Raw(t, "private"), flags: byte(v.Uint(t, "flags")),
	}
	for i := range int(v.Uint(t, "held_count")) {
		m.held = append(m.held, v.Uint(t, fmt.Sprintf("held.%d", i)))
	}
	for i := range m.ctl {
		m.ctl[i] = v.Uint(t, fmt.Sprintf("ctl.%d", i))
	}
	if got := m.encode(typ); !bytes.Equal(got, v.Bytes) {
		t.Errorf("qpInfo encodes to\n%x\ndoc says\n%x", got, v.Bytes)
	}
	if v.Bytes[0] != typ {
		t.Errorf("type %d, doc says %d", v.Bytes[0], typ)
	}
	got, err := decodeInfo(v.Bytes)
	if err != nil {
		t.Fatalf("decodeInfo: %v", err)
	}
	if len(got.held) == 0 && len(m.held) == 0 {
		got.held = m.held // nil and empty alike
	}
	if !reflect.DeepEqual(got, m) {
		t.Errorf("decodeInfo = %+v\ndoc says %+v", got, m)
	}
}

func checkReject(t *testing.T, v *protodoc.Vector) {
	if typ := v.Uint(t, "type"); typ != msgReject {
		t.Errorf("type %d, want %d", typ, msgReject)
	}
	private := v.Raw(t, "private")
	if got := rejectMsg(private); !bytes.Equal(got, v.Bytes) {
		t.Errorf("rejectMsg = %x, doc says %x", got, v.Bytes)
	}
	if v.Bytes[0] != msgReject {
		t.Errorf("type %d, want %d", v.Bytes[0], msgReject)
	}
	if got := decodeReject(v.Bytes); !bytes.Equal(got, private) {
		t.Errorf("decodeReject = %q, doc says %q", got, private)
	}
	if len(private) > 0 && !bytes.HasPrefix(private, transport.RejectPeerRefused) {
		t.Errorf("private data %q: the vector is meant to show transport.RejectPeerRefused", private)
	}
}

func checkOneByte(t *testing.T, v *protodoc.Vector, typ byte) {
	if got := v.Uint(t, "type"); got != uint64(typ) || !bytes.Equal(v.Bytes, []byte{typ}) {
		t.Errorf("message type %d; doc says type %d, bytes %x", typ, got, v.Bytes)
	}
}

func checkMemReq(t *testing.T, v *protodoc.Vector) {
	if typ := v.Uint(t, "type"); typ != msgMemReq {
		t.Errorf("type %d, want %d", typ, msgMemReq)
	}
	req, id, key := v.Uint(t, "req"), v.Uint(t, "memfd_id"), uint32(v.Uint(t, "rkey"))
	if got := encodeMemReq(req, id, key); !bytes.Equal(got, v.Bytes) {
		t.Errorf("encodeMemReq = %x, doc says %x", got, v.Bytes)
	}
	r, i, k, ok := decodeMemReq(v.Bytes)
	if !ok || r != req || i != id || k != key || v.Bytes[0] != msgMemReq {
		t.Errorf("decodeMemReq = %d, %d, %#x, %v; doc says %d, %d, %#x", r, i, k, ok, req, id, key)
	}
}

func checkMemRep(t *testing.T, v *protodoc.Vector) {
	if typ := v.Uint(t, "type"); typ != msgMemRep {
		t.Errorf("type %d, want %d", typ, msgMemRep)
	}
	req, granted := v.Uint(t, "req"), v.Uint(t, "ok") == 1
	if got := encodeMemRep(req, granted); !bytes.Equal(got, v.Bytes) {
		t.Errorf("encodeMemRep = %x, doc says %x", got, v.Bytes)
	}
	r, g, ok := decodeMemRep(v.Bytes)
	if !ok || r != req || g != granted || v.Bytes[0] != msgMemRep {
		t.Errorf("decodeMemRep = %d, %v, %v; doc says %d, %v", r, g, ok, req, granted)
	}
}

// littleEndianHost: the shared memory vectors are in host order, written
// for little-endian hosts.
func littleEndianHost(t *testing.T) {
	if binary.NativeEndian.Uint16([]byte{1, 0}) != 1 {
		t.Skip("the shared memory vectors are little-endian; this host is not")
	}
}

func checkRecvSlot(t *testing.T, v *protodoc.Vector) {
	littleEndianHost(t)
	seq := v.Uint(t, "seq")
	sge := transport.SGE{Addr: v.Uint(t, "sge.addr"), Length: uint32(v.Uint(t, "sge.length")), LKey: uint32(v.Uint(t, "sge.lkey"))}
	nsge := v.Uint(t, "nsge")
	wc := transport.WorkCompletion{
		Status: transport.Status(v.Uint(t, "status")), Opcode: transport.WCOpcode(v.Uint(t, "opcode")),
		HasImm: v.Uint(t, "has_imm") == 1, ByteLen: uint32(v.Uint(t, "byte_len")), Imm: uint32(v.Uint(t, "imm")),
	}
	if nsge != 1 {
		t.Fatalf("nsge %d: the vector shows one SGE", nsge)
	}
	// A ring of one slot of one SGE: receive seq takes its only slot.
	mem := make([]byte, qpSegSize(1, 1))
	r := newRing(mem, 1, 1)
	r.post(seq, []transport.SGE{sge})
	r.complete(seq, &wc)
	if got := mem[r.slot(seq):]; !bytes.Equal(got, v.Bytes) {
		t.Errorf("posted and completed slot is %x, doc says %x", got, v.Bytes)
	}

	mem = make([]byte, qpSegSize(1, 1))
	copy(mem[qpSlots:], v.Bytes)
	r = newRing(mem, 1, 1)
	var got transport.WorkCompletion
	if !r.completed(seq, &got) || got != wc {
		t.Errorf("completed(%d) = %+v, doc says %+v", seq, got, wc)
	}
	if sg := r.sges(seq, nil); len(sg) != 1 || sg[0] != sge {
		t.Errorf("sges(%d) = %+v, doc says %+v", seq, sg, sge)
	}
}

func checkMREntry(t *testing.T, v *protodoc.Vector) {
	littleEndianHost(t)
	e := mrEntry{
		key: uint32(v.Uint(t, "key")), pd: uint32(v.Uint(t, "pd")), access: transport.Access(v.Uint(t, "access")),
		addr: v.Uint(t, "addr"), length: v.Uint(t, "length"), memfdID: v.Uint(t, "memfd_id"), memfdOff: v.Uint(t, "memfd_off"),
	}
	seq, pins := uint32(v.Uint(t, "seq")), uint32(v.Uint(t, "pins"))
	idx := int(e.key >> 8)
	tab := mrTable(make([]byte, mrTableSize))
	for range seq / 2 { // each store is two steps of the seqlock
		tab.store(idx, e)
	}
	off := idx * mrEntrySize
	if got := tab[off : off+mrEntrySize]; !bytes.Equal(got, v.Bytes) {
		t.Errorf("stored entry is %x, doc says %x", got, v.Bytes)
	}

	tab = mrTable(make([]byte, mrTableSize))
	copy(tab[off:], v.Bytes)
	got, ok := tab.lookup(e.key)
	if !ok || got != e {
		t.Errorf("lookup(%#x) = %+v, %v; doc says %+v", e.key, got, ok, e)
	}
	if s, p := *word32(tab, off+mrSeq), *word32(tab, off+mrPins); s != seq || p != pins {
		t.Errorf("seq %d, pins %d; doc says %d, %d", s, p, seq, pins)
	}
}
