package conn

import (
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/codes"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// An acknowledgement that never arrives: the sender's span ends in error
// with the reason, after one request per attempt; the receiver served.
func TestTelemetryAckTimeout(t *testing.T) {
	hr := faults.MustAdd(fault.Rule{Op: fault.OpPostSend, Action: fault.ActDrop, Match: isRecord(recAck)})
	defer hr.Remove()
	h := newOtelSDK(t)
	a, b := conns(t, h.opts(WithProvider(faults.Name()), WithAckTimeout(100*time.Millisecond, 1))...)
	transfer(t, a, b, random(64<<10), writeAll(a))
	if s := a.Stats(); s.SendPhase != phaseNames[phaseTimedOut] {
		t.Fatalf("writer after lost acks: %+v", s)
	}
	send := h.spansNamed(telemetry.SpanEnlargeSender)
	if len(send) != 1 {
		t.Fatalf("%d sender enlargement spans, want 1", len(send))
	}
	s := send[0]
	if s.Status().Code != codes.Error || s.Status().Description != "no acknowledgement after 2 requests, 100ms each" {
		t.Errorf("sender span status %+v", s.Status())
	}
	checkAttrs(t, "timed-out enlargement", s.Attributes(), with(peerAttrs(t, a),
		"rdmagrpc.enlargement.side", "sender", "rdmagrpc.enlargement.from_size", DefaultSlotSize,
		"rdmagrpc.enlargement.to_size", DefaultLargeSize, "rdmagrpc.enlargement.to_count", DefaultLargeCount,
		"rdmagrpc.enlargement.outcome", "timed_out", "rdmagrpc.buffer.phase", "small",
		"rdmagrpc.enlargement.attempts", 2, "error.type", "timed_out"))
	if ev := eventNames(s); !slices.Equal(ev, []string{telemetry.EventEnlargeRequest, telemetry.EventEnlargeRequest}) {
		t.Errorf("sender events %v, want two requests", ev)
	}
	if recv := h.spansNamed(telemetry.SpanEnlargeReceiver); len(recv) != 1 || recv[0].Status().Code != codes.Unset {
		t.Errorf("receiver spans %v, want one served", recv)
	}
	checkPoints(t, "after time-out", h.metrics(t), telemetry.MetricEnlargements, map[string]int64{
		"rdmagrpc.enlargement.outcome=timed_out,rdmagrpc.enlargement.side=sender": 1,
		"rdmagrpc.enlargement.outcome=served,rdmagrpc.enlargement.side=receiver":  1,
	})
}

// A registration the device refuses: the receiver's span and the
// sender's both end in error with the reason, and the failed
// registration is counted with its error.type.
func TestTelemetryRegistrationRefused(t *testing.T) {
	ReleaseKits() // both ends register their small rings, as a first connection does
	hr := faults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg, MinLen: largeBytes})
	defer hr.Remove()
	h := newOtelSDK(t)
	a, b := conns(t, h.opts(WithProvider(faults.Name()))...)
	transfer(t, a, b, random(64<<10), writeAll(a))
	if hr.Fired() != 1 {
		t.Fatalf("registration fault fired %d times, want 1", hr.Fired())
	}
	send, recv := h.spansNamed(telemetry.SpanEnlargeSender), h.spansNamed(telemetry.SpanEnlargeReceiver)
	if len(send) != 1 || len(recv) != 1 {
		t.Fatalf("%d sender and %d receiver spans, want 1 each", len(send), len(recv))
	}
	if st := send[0].Status(); st.Code != codes.Error || st.Description != errPeerRefused.Error() {
		t.Errorf("sender status %+v", st)
	}
	if ev := eventNames(send[0]); !slices.Equal(ev, []string{telemetry.EventEnlargeRequest, telemetry.EventEnlargeRefusal}) {
		t.Errorf("sender events %v", ev)
	}
	ra := attrsOf(recv[0].Attributes())
	if st := recv[0].Status(); st.Code != codes.Error || !strings.HasPrefix(st.Description, "large receive buffers: ") ||
		ra["rdmagrpc.enlargement.outcome"].AsString() != "serve_refused" || ra["error.type"].AsString() != "serve_refused" || ra["rdmagrpc.buffer.phase"].AsString() != "small" {
		t.Errorf("receiver status %+v, attributes %v", st, recv[0].Attributes())
	}
	t.Logf("receiver's reason: %s", recv[0].Status().Description)
	m := h.metrics(t)
	checkPoints(t, "after refusal", m, telemetry.MetricEnlargements, map[string]int64{
		"rdmagrpc.enlargement.outcome=refused,rdmagrpc.enlargement.side=sender":         1,
		"rdmagrpc.enlargement.outcome=serve_refused,rdmagrpc.enlargement.side=receiver": 1,
	})
	regs := m[telemetry.MetricRegistrations]
	if len(regs) != 2 || regs[""] != 4 {
		t.Fatalf("registrations %v, want 4 without error and 1 with an error.type", regs)
	}
	for k, v := range regs {
		if k != "" && (!strings.HasPrefix(k, "error.type=") || v != 1) {
			t.Errorf("failed registrations: %s = %d, want one with an error.type", k, v)
		}
	}
	// Bytes count what was registered: the refused 128 KiB is not.
	checkPoints(t, "after refusal", m, telemetry.MetricRegBytes, map[string]int64{"": 2 * smallBytes})
}
