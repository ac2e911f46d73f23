//go:build cgo

package verbs

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
)

func TestResolveHostPort(t *testing.T) {
	lo, err := net.InterfaceByIndex(1)
	if err != nil {
		t.Skipf("no interface 1: %v", err)
	}
	ctx := context.Background()
	for _, tc := range []struct {
		addr   string
		listen bool
		want   string
	}{
		{"10.0.0.1:7000", false, "10.0.0.1:7000"},
		{"[::ffff:10.0.0.1]:7000", false, "10.0.0.1:7000"},
		// The zone stays: link-local addresses need it.
		{"[fe80::1%" + lo.Name + "]:7000", false, "[fe80::1%" + lo.Name + "]:7000"},
		{":7000", true, "0.0.0.0:7000"},
		// Listen and Dial of one name pick the same address (IPv4 first).
		{"localhost:7000", true, "127.0.0.1:7000"},
		{"localhost:7000", false, "127.0.0.1:7000"},
	} {
		got, err := resolveHostPort(ctx, tc.addr, tc.listen)
		if err != nil || got.String() != tc.want {
			t.Errorf("resolveHostPort(%q, listen=%v) = %v, %v; want %s", tc.addr, tc.listen, got, err, tc.want)
		}
	}
	if _, err := resolveHostPort(ctx, ":7000", false); err == nil {
		t.Error("dialing an empty host resolved")
	}
	if _, err := resolveHostPort(ctx, "no-such-host.invalid:7000", true); !errors.Is(err, syscall.EADDRNOTAVAIL) {
		t.Errorf("listening on an unknown name: %v, want EADDRNOTAVAIL", err)
	}
}
