package verbs

import (
	"errors"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func TestParseTrafficClass(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"0", 0, true}, {"106", 106, true}, {" 255 ", 255, true}, {"0x68", 104, true},
		{"256", 0, false}, {"-1", 0, false}, {"lossless", 0, false}, {"1.5", 0, false},
	} {
		got, err := parseTrafficClass(tc.in)
		switch {
		case tc.ok && (err != nil || got != tc.want):
			t.Errorf("%q: %d, %v; want %d", tc.in, got, err, tc.want)
		case !tc.ok && err == nil:
			t.Errorf("%q: accepted as %d", tc.in, got)
		case !tc.ok && !errors.Is(err, transport.ErrUnusable):
			t.Errorf("%q: %v does not wrap ErrUnusable (a bad setting must not fall back silently)", tc.in, err)
		}
	}
	t.Setenv(TrafficClassEnv, "")
	if n, err := trafficClass(); n != -1 || err != nil {
		t.Fatalf("empty: %d, %v; want unset", n, err)
	}
}

func TestReadQPEnv(t *testing.T) {
	t.Setenv(TimeoutEnv, "20")
	t.Setenv(RetryCountEnv, "")
	t.Setenv(RNRRetryEnv, "7")
	t.Setenv(ServiceLevelEnv, "3")
	t.Setenv(GIDIndexEnv, "")
	t.Setenv(RoCEVersionEnv, "2")
	t.Setenv(MinRNRTimerEnv, "12")
	t.Setenv(RecvDepthEnv, "0")
	e, err := readQPEnv()
	if err != nil || e != (qpEnv{timeout: 20, retry: -1, rnr: 7, rnrTimer: 12, sl: 3, gidIndex: -1, roce: 2, sendDepth: defaultSendDepth, cqShare: defaultCQShare, recvPool: defaultRecvPool}) {
		t.Fatalf("readQPEnv: %+v, %v", e, err)
	}
	a := qpAttrs{timeout: 14, retryCnt: 7, rnrRetry: 6, minRNRTimer: 14}
	e.apply(&a)
	if a.timeout != 20 || a.retryCnt != 7 || a.rnrRetry != 7 || a.minRNRTimer != 12 {
		t.Fatalf("applied: %+v", a)
	}
	for _, bad := range []struct{ name, v string }{
		{TimeoutEnv, "32"}, {RetryCountEnv, "8"}, {RNRRetryEnv, "-1"}, {TimeoutEnv, "fast"},
		{ServiceLevelEnv, "16"}, {GIDIndexEnv, "256"}, {RoCEVersionEnv, "3"}, {RoCEVersionEnv, "0"}, {MinRNRTimerEnv, "32"},
	} {
		for _, name := range []string{TimeoutEnv, RetryCountEnv, RNRRetryEnv, ServiceLevelEnv, GIDIndexEnv, RoCEVersionEnv, MinRNRTimerEnv} {
			t.Setenv(name, "")
		}
		t.Setenv(bad.name, bad.v)
		if _, err := readQPEnv(); err == nil || !strings.Contains(err.Error(), bad.name) {
			t.Errorf("%s=%q: %v, want an error naming it", bad.name, bad.v, err)
		}
	}
}
