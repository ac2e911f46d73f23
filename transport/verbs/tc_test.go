package verbs

import (
	"errors"
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
