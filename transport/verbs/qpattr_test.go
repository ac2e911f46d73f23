package verbs

import (
	"errors"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func TestEncodeTimeout(t *testing.T) {
	tests := []struct {
		d    time.Duration
		want uint8
	}{
		{time.Nanosecond, 1},
		{8192 * time.Nanosecond, 1}, // 4.096 µs·2 exactly
		{8193 * time.Nanosecond, 2}, // just above
		{67 * time.Millisecond, 14}, // brpc's choice: 4.096 µs·2^14 = 67.1 ms
		{68 * time.Millisecond, 15},
		{time.Hour, 30},     // 4.096 µs·2^30 ≈ 73 min
		{3 * time.Hour, 31}, // clamped: 0 would mean "forever"
	}
	for _, tc := range tests {
		if got := encodeTimeout(tc.d); got != tc.want {
			t.Errorf("encodeTimeout(%v) = %d, want %d", tc.d, got, tc.want)
		}
	}
}

func TestEncodeRNRTimer(t *testing.T) {
	tests := []struct {
		d    time.Duration
		want uint8
	}{
		{time.Nanosecond, 1},
		{10 * time.Microsecond, 1},
		{11 * time.Microsecond, 2},
		{time.Millisecond, 14}, // 1.28 ms
		{1280 * time.Microsecond, 14},
		{491520 * time.Microsecond, 31},
		{500 * time.Millisecond, 0}, // code 0 is the longest, 655.36 ms
		{time.Second, 0},
	}
	for _, tc := range tests {
		if got := encodeRNRTimer(tc.d); got != tc.want {
			t.Errorf("encodeRNRTimer(%v) = %d, want %d", tc.d, got, tc.want)
		}
	}
	for i := 2; i < len(rnrTimerTable); i++ {
		if rnrTimerTable[i] <= rnrTimerTable[i-1] {
			t.Fatalf("rnrTimerTable not increasing at %d", i)
		}
	}
}

func TestResolveQPAttrs(t *testing.T) {
	dev := transport.DeviceAttr{MaxQPWR: 1024, MaxSGE: 8}
	a, err := resolveQPAttrs(transport.QPConfig{}, dev)
	if err != nil {
		t.Fatal(err)
	}
	want := qpAttrs{maxSendWR: 64, maxRecvWR: 64, maxSendSGE: 1, maxRecvSGE: 1,
		timeout: 14, retryCnt: 7, rnrRetry: 6, minRNRTimer: 14}
	if a != want {
		t.Fatalf("defaults = %+v, want %+v", a, want)
	}
	a, err = resolveQPAttrs(transport.QPConfig{MaxSendWR: 8, MaxRecvWR: 16, MaxSendSGE: 2, MaxRecvSGE: 3, MaxInline: 64,
		RetryCount: 3, RNRRetry: 7, MinRNRTimer: 10 * time.Millisecond, Timeout: time.Second}, dev)
	if err != nil {
		t.Fatal(err)
	}
	want = qpAttrs{maxSendWR: 8, maxRecvWR: 16, maxSendSGE: 2, maxRecvSGE: 3, maxInline: 64,
		timeout: 18, retryCnt: 3, rnrRetry: 7, minRNRTimer: 20}
	if a != want {
		t.Fatalf("explicit = %+v, want %+v", a, want)
	}
	for _, bad := range []transport.QPConfig{{RetryCount: 8}, {RNRRetry: -1}, {MaxSendWR: 2048}, {MaxRecvSGE: 9}, {MaxInline: -1}} {
		if _, err := resolveQPAttrs(bad, dev); err == nil {
			t.Errorf("resolveQPAttrs(%+v) accepted", bad)
		}
	}
	if _, err := resolveQPAttrs(transport.QPConfig{RetryCount: 9}, dev); !errors.Is(err, transport.ErrInvalidWR) {
		t.Errorf("RetryCount 9: %v", err)
	}
}
