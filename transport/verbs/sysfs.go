package verbs

import (
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
