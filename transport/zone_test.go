package transport

import (
	"net"
	"net/netip"
	"strconv"
	"testing"
)

func TestZoneIndex(t *testing.T) {
	lo, err := net.InterfaceByIndex(1)
	if err != nil {
		t.Skipf("no interface 1: %v", err)
	}
	for _, z := range []string{lo.Name, "1"} {
		if n, err := ZoneIndex(z); err != nil || n != 1 {
			t.Errorf("ZoneIndex(%q) = %d, %v; want 1", z, n, err)
		}
	}
	if _, err := ZoneIndex("no-such-if0"); err == nil {
		t.Error("ZoneIndex of an unknown interface succeeded")
	}
	ap := netip.MustParseAddrPort("[fe80::1%" + strconv.Itoa(1) + "]:1")
	if ap.Addr().Zone() != "1" {
		t.Fatalf("zone lost in parsing: %v", ap)
	}
}
