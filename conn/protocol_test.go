package conn

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/internal/protodoc"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// TestProtocolVectors holds the negotiation, the hello, the immediates and
// the control records to the test vectors of doc/protocol.md: each
// vector's fields encode to its bytes, and its bytes decode to its fields.
// Vectors named shm-* are transport/shm's (TestProtocolVectorsShm).
func TestProtocolVectors(t *testing.T) {
	vs := protodoc.Load(t)
	checks := []struct {
		prefix string
		min    int // vectors the document must have
		check  func(*testing.T, *protodoc.Vector)
	}{
		{"client-start-", 3, checkClientStart},
		{"offers-", 2, checkOffers},
		{"reply-", 3, checkReply},
		{"stay-tcp", 1, checkStayTCP},
		{"hello-", 2, checkHello},
		{"reject-backlog", 1, checkRejectBacklog},
		{"imm-", 11, checkImm},
		{"record-", 8, checkRecord},
	}
	claimed := map[string]bool{}
	for _, c := range checks {
		names := protodoc.Names(vs, c.prefix)
		if len(names) < c.min {
			t.Errorf("doc/protocol.md has %d vectors %s*, want at least %d", len(names), c.prefix, c.min)
		}
		for _, n := range names {
			claimed[n] = true
			v := vs[n]
			t.Run(n, func(t *testing.T) {
				c.check(t, v)
				v.Done(t)
			})
		}
	}
	for n, v := range vs {
		if !claimed[n] && !strings.HasPrefix(n, "shm-") {
			t.Errorf("vector %s (doc line %d) is checked by no test", n, v.Line)
		}
	}
}

func checkClientStart(t *testing.T, v *protodoc.Vector) {
	provider := v.String(t, "provider")
	code := uint32(v.Uint(t, "provider_code"))
	if got := providerCode(provider); got != code {
		t.Errorf("providerCode(%q) = %#x, doc says %#x", provider, got, code)
	}
	want := clientHello{magic: settingMagic, provider: code}
	var also []string
	if v.Has("also") {
		also = []string{v.String(t, "also")}
		want.also = []uint32{uint32(v.Uint(t, "also_code"))}
		if got := providerCode(also[0]); got != want.also[0] {
			t.Errorf("providerCode(%q) = %#x, doc says %#x", also[0], got, want.also[0])
		}
	}
	if v.Has("host") {
		want.host = v.Uint(t, "host")
	}
	if got := clientStart(provider, also, want.host); !bytes.Equal(got, v.Bytes) {
		t.Errorf("clientStart(%q, %q, %#x) = %x, doc says %x", provider, also, want.host, got, v.Bytes)
	}
	read, h, err := sniff(bytes.NewReader(v.Bytes))
	if err != nil || !bytes.Equal(read, v.Bytes) || h.magic != want.magic || h.provider != want.provider || h.host != want.host || !slices.Equal(h.also, want.also) {
		t.Errorf("sniff = read %x, %+v, %v; want all read, %+v", read, h, err, want)
	}
}

// checkOffers: a reply 'O', its offers encoded and decoded.
func checkOffers(t *testing.T, v *protodoc.Vector) {
	host := v.Uint(t, "host")
	var codes []uint32
	var addrs []string
	for i := 1; v.Has(fmt.Sprintf("offer%d_code", i)); i++ {
		codes = append(codes, uint32(v.Uint(t, fmt.Sprintf("offer%d_code", i))))
		addrs = append(addrs, v.String(t, fmt.Sprintf("offer%d_addr", i)))
	}
	if got := encodeReply(verdictOffers, encodeOffers(host, codes, addrs)); !bytes.Equal(got, v.Bytes) {
		t.Errorf("encodeReply('O', offers) = %x, doc says %x", got, v.Bytes)
	}
	r := bytes.NewReader(bytes.TrimPrefix(v.Bytes, []byte(replyMagic)))
	k, p, err := readReply(r)
	if err != nil || k != verdictOffers || r.Len() != 0 {
		t.Fatalf("readReply = %q, %v (%d bytes left)", k, err, r.Len())
	}
	gh, gc, ga, err := decodeOffers(p)
	if err != nil || gh != host || !slices.Equal(gc, codes) || !slices.Equal(ga, addrs) {
		t.Errorf("decodeOffers = %#x, %x, %q, %v; doc says %#x, %x, %q", gh, gc, ga, err, host, codes, addrs)
	}
}

func checkReply(t *testing.T, v *protodoc.Vector) {
	verdict, payload := v.String(t, "verdict"), v.String(t, "payload")
	if len(verdict) != 1 {
		t.Fatalf("verdict %q: want one byte", verdict)
	}
	if got := encodeReply(verdict[0], payload); !bytes.Equal(got, v.Bytes) {
		t.Errorf("encodeReply = %x, doc says %x", got, v.Bytes)
	}
	magic, rest, ok := bytes.Cut(v.Bytes, []byte(replyMagic))
	if !ok || len(magic) != 0 {
		t.Fatalf("%x does not start with %q", v.Bytes, replyMagic)
	}
	r := bytes.NewReader(rest)
	k, p, err := readReply(r)
	if err != nil || k != verdict[0] || p != payload || r.Len() != 0 {
		t.Errorf("readReply = %q, %q, %v (%d bytes left); doc says %q, %q", k, p, err, r.Len(), verdict, payload)
	}
}

func checkStayTCP(t *testing.T, v *protodoc.Vector) {
	if b := v.String(t, "byte"); b != string(rune(stayTCP)) || !bytes.Equal(v.Bytes, []byte{stayTCP}) {
		t.Errorf("stayTCP is %q; doc says %q, bytes %x", stayTCP, b, v.Bytes)
	}
}

func checkHello(t *testing.T, v *protodoc.Vector) {
	h := hello{
		ringAddr: v.Uint(t, "ring_addr"), ringRKey: uint32(v.Uint(t, "ring_rkey")),
		slotSize: uint32(v.Uint(t, "slot_size")), slotCount: uint32(v.Uint(t, "slot_count")), flags: uint8(v.Uint(t, "flags")),
	}
	if got := h.encode(); !bytes.Equal(got, v.Bytes) {
		t.Errorf("hello %+v encodes to %x, doc says %x", h, got, v.Bytes)
	}
	// As a peer receives it: padded to the connect request's private data.
	got, err := decodeHello(transport.PadPrivate(v.Bytes, transport.PrivateLenConnect))
	if err != nil || got != h {
		t.Errorf("decodeHello = %+v, %v; doc says %+v", got, err, h)
	}
}

func checkRejectBacklog(t *testing.T, v *protodoc.Vector) {
	if v.String(t, "reason") != "backlog full" {
		t.Errorf("reason: the vector is the backlog's")
	}
	if !bytes.Equal(transport.RejectBacklogFull, v.Bytes) {
		t.Errorf("transport.RejectBacklogFull = %x, doc says %x", transport.RejectBacklogFull, v.Bytes)
	}
	if !isBacklogFull(transport.PadPrivate(v.Bytes, transport.PrivateLenReject)) {
		t.Errorf("isBacklogFull does not take the doc's reject")
	}
}

func checkImm(t *testing.T, v *protodoc.Vector) {
	kind, ring, credits, length := int(v.Uint(t, "kind")), int(v.Uint(t, "ring")), int(v.Uint(t, "credits")), int(v.Uint(t, "length"))
	if got := binary.BigEndian.AppendUint32(nil, encodeImm(kind, ring, credits, length)); !bytes.Equal(got, v.Bytes) {
		t.Errorf("encodeImm(%d, %d, %d, %d) = %x, doc says %x", kind, ring, credits, length, got, v.Bytes)
	}
	if len(v.Bytes) != 4 {
		t.Fatalf("%d bytes, want 4", len(v.Bytes))
	}
	k, r, c, n := decodeImm(binary.BigEndian.Uint32(v.Bytes))
	if k != kind || r != ring || c != credits || n != length {
		t.Errorf("decodeImm = %d, %d, %d, %d; doc says %d, %d, %d, %d", k, r, c, n, kind, ring, credits, length)
	}
}

func checkRecord(t *testing.T, v *protodoc.Vector) {
	r := record{
		typ: uint8(v.Uint(t, "type")), seq: uint32(v.Uint(t, "seq")), addr: v.Uint(t, "addr"), rkey: uint32(v.Uint(t, "rkey")),
		size: uint32(v.Uint(t, "size")), count: uint32(v.Uint(t, "count")), addr2: v.Uint(t, "addr2"), rkey2: uint32(v.Uint(t, "rkey2")),
	}
	if got := r.encode(make([]byte, recordLen)); !bytes.Equal(got, v.Bytes) {
		t.Errorf("record %+v encodes to %x, doc says %x", r, got, v.Bytes)
	}
	got, err := decodeRecord(v.Bytes)
	if err != nil || got != r {
		t.Errorf("decodeRecord = %+v, %v; doc says %+v", got, err, r)
	}
}
