package verbs

import (
	"net/netip"
	"strings"
	"testing"
)

// On a real device (the Soft-RoCE guest): sysfs shows it with an ACTIVE
// Ethernet port, the network device behind it with its MTU, and a RoCE v2
// GID for the address the tests use, as rdmatrace doctor prints them.
func TestSysfsShowsDevice(t *testing.T) {
	d := openOrSkip(t)
	ip, err := netip.ParseAddr(hostIP(t, d))
	if err != nil {
		t.Fatal(err)
	}
	var dev *DeviceInfo
	devs := Sysfs("/sys")
	for i := range devs {
		if devs[i].Name == d.Name() {
			dev = &devs[i]
		}
	}
	if dev == nil {
		t.Fatalf("device %s not in sysfs's %+v", d.Name(), devs)
	}
	if len(dev.Ports) == 0 {
		t.Fatalf("%s: no ports", dev.Name)
	}
	p := dev.Ports[0]
	if !strings.Contains(p.State, "ACTIVE") || p.LinkLayer != "Ethernet" {
		t.Errorf("%s port %d: state %q link layer %q, want ACTIVE Ethernet (rxe)", dev.Name, p.Num, p.State, p.LinkLayer)
	}
	found := false
	for _, g := range p.GIDs {
		if g.Addr.Unmap() == ip && g.Type == "RoCE v2" {
			found = true
			if mtu := p.NetdevMTU[g.Netdev]; mtu < 1024 {
				t.Errorf("GID %d's network device %q: MTU %d", g.Index, g.Netdev, mtu)
			}
		}
	}
	if !found {
		t.Errorf("%s port %d: no RoCE v2 GID for %v among %+v", dev.Name, p.Num, ip, p.GIDs)
	}
}
