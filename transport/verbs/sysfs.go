package verbs

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// What the kernel shows of RDMA devices in sysfs: enough to say why a
// port cannot carry a connection (state, link layer, GID types, the MTU
// of the network device behind it) with neither libibverbs nor root.
// rdmatrace doctor prints it.

// DeviceInfo is one RDMA device as sysfs shows it.
type DeviceInfo struct {
	Name, NodeType, FW string
	Ports              []PortInfo
}

// PortInfo is one port of a device: its state, link layer, its GID table
// without the empty entries, and the network devices behind those GIDs
// with their MTUs.
type PortInfo struct {
	Num                    int
	State, Phys, LinkLayer string
	Rate                   string
	GIDs                   []GID
	Netdevs                []string
	NetdevMTU              map[string]int
}

// GID is one entry of a port's GID table.
type GID struct {
	Index  int
	Addr   netip.Addr
	Type   string // "IB/RoCE v1" or "RoCE v2"
	Netdev string
}

// Sysfs reads the RDMA devices under sysfs (normally "/sys"); none when
// the kernel has no RDMA stack or no device.
func Sysfs(sysfs string) []DeviceInfo {
	root := filepath.Join(sysfs, "class", "infiniband")
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil
	}
	var devs []DeviceInfo
	for _, e := range entries {
		dir := filepath.Join(root, e.Name())
		d := DeviceInfo{Name: e.Name(), NodeType: readLine(dir, "node_type"), FW: readLine(dir, "fw_ver")}
		ports, _ := os.ReadDir(filepath.Join(dir, "ports"))
		for _, pe := range ports {
			if n, err := strconv.Atoi(pe.Name()); err == nil {
				d.Ports = append(d.Ports, readPort(filepath.Join(dir, "ports", pe.Name()), n, sysfs))
			}
		}
		slices.SortFunc(d.Ports, func(a, b PortInfo) int { return a.Num - b.Num })
		devs = append(devs, d)
	}
	return devs
}

func readPort(dir string, num int, sysfs string) PortInfo {
	p := PortInfo{Num: num, State: readLine(dir, "state"), Phys: readLine(dir, "phys_state"),
		LinkLayer: readLine(dir, "link_layer"), Rate: readLine(dir, "rate"), NetdevMTU: map[string]int{}}
	gids, _ := os.ReadDir(filepath.Join(dir, "gids"))
	for _, ge := range gids {
		i, err := strconv.Atoi(ge.Name())
		if err != nil {
			continue
		}
		a, ok := parseGID(readLine(filepath.Join(dir, "gids"), ge.Name()))
		if !ok || a.IsUnspecified() {
			continue // an empty entry of the table
		}
		g := GID{Index: i, Addr: a,
			Type:   readLine(filepath.Join(dir, "gid_attrs", "types"), ge.Name()),
			Netdev: readLine(filepath.Join(dir, "gid_attrs", "ndevs"), ge.Name())}
		p.GIDs = append(p.GIDs, g)
		if g.Netdev != "" && !slices.Contains(p.Netdevs, g.Netdev) {
			p.Netdevs = append(p.Netdevs, g.Netdev)
			if mtu, err := strconv.Atoi(readLine(filepath.Join(sysfs, "class", "net", g.Netdev), "mtu")); err == nil {
				p.NetdevMTU[g.Netdev] = mtu
			}
		}
	}
	slices.SortFunc(p.GIDs, func(a, b GID) int { return a.Index - b.Index })
	return p
}

// parseGID reads sysfs's "fe80:0000:0000:0000:...:0001" form.
func parseGID(s string) (netip.Addr, bool) {
	h := strings.ReplaceAll(s, ":", "")
	if len(h) != 32 {
		return netip.Addr{}, false
	}
	var b [16]byte
	for i := range b {
		v, err := strconv.ParseUint(h[2*i:2*i+2], 16, 8)
		if err != nil {
			return netip.Addr{}, false
		}
		b[i] = byte(v)
	}
	return netip.AddrFrom16(b), true
}

func readLine(dir, name string) string {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// gidType is the type of GID index of a device's port ("RoCE v2",
// "IB/RoCE v1"), "" where sysfs does not say (InfiniBand has no types).
func gidType(sysfs, dev string, port, index int) string {
	dir := filepath.Join(sysfs, "class", "infiniband", dev, "ports", strconv.Itoa(port), "gid_attrs", "types")
	return readLine(dir, strconv.Itoa(index))
}

// gidOfVersion is the index of the GID with the address of GID index of
// the device's port, in the entry of RoCE version v (1 or 2).
func gidOfVersion(sysfs, dev string, port, index, v int) (int, error) {
	want := "RoCE v2"
	if v == 1 {
		want = "IB/RoCE v1"
	}
	p := readPort(filepath.Join(sysfs, "class", "infiniband", dev, "ports", strconv.Itoa(port)), port, sysfs)
	var addr netip.Addr
	for _, g := range p.GIDs {
		if g.Index == index {
			addr = g.Addr
		}
	}
	if !addr.IsValid() {
		return 0, unusable("%s=%d: GID %d of %s port %d is not in %s", RoCEVersionEnv, v, index, dev, port, sysfs)
	}
	var have []string
	for _, g := range p.GIDs {
		if g.Addr == addr {
			if g.Type == want {
				return g.Index, nil
			}
			have = append(have, fmt.Sprintf("%d (%s)", g.Index, g.Type))
		}
	}
	return 0, unusable("%s=%d: %s port %d has no %s GID for %v (its GIDs for that address: %s)",
		RoCEVersionEnv, v, dev, port, want, addr.Unmap(), strings.Join(have, ", "))
}

// gidHint explains a failure to bind or route a for RDMA when sysfs shows
// why: no port has a GID for a (the address is not on the network device
// of an RDMA port), or only a RoCE v1 one, or its port is not ACTIVE. ""
// when a is a wildcard or sysfs says nothing wrong.
func gidHint(sysfs string, a netip.Addr) string {
	if !a.IsValid() || a.IsUnspecified() {
		return ""
	}
	a = a.Unmap()
	devs := Sysfs(sysfs)
	var all []string
	for _, d := range devs {
		for _, p := range d.Ports {
			for _, g := range p.GIDs {
				all = append(all, fmt.Sprintf("%s/%d: %v", d.Name, p.Num, g.Addr.Unmap()))
				if g.Addr.Unmap() != a {
					continue
				}
				if p.State != "" && !strings.Contains(p.State, "ACTIVE") {
					return fmt.Sprintf(" (%v is on port %d of %s, which is %s, not ACTIVE)", a, p.Num, d.Name, p.State)
				}
				if g.Type == "RoCE v2" || g.Type == "" {
					return ""
				}
			}
		}
	}
	slices.Sort(all)
	all = slices.Compact(all)
	for _, d := range devs {
		for _, p := range d.Ports {
			for _, g := range p.GIDs {
				if g.Addr.Unmap() == a {
					return fmt.Sprintf(" (%v has only a %s GID on %s port %d, no RoCE v2 one: check the kernel's default_roce_mode and the peer's)", a, g.Type, d.Name, p.Num)
				}
			}
		}
	}
	if len(all) == 0 {
		return " (no RDMA port has any GID: is the network device of the RDMA port up with an address?)"
	}
	return fmt.Sprintf(" (no RDMA port has a GID for %v: the address must be on the network device of an RDMA port; the ports' GIDs: %s)", a, strings.Join(all, ", "))
}
