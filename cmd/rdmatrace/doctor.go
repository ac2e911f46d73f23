package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

// rdmatrace doctor: what an operator pastes into an issue. It reads the
// RDMA devices, ports and GID tables from sysfs (so it needs neither
// rdma-core nor root), the memlock limit against what rdmagrpc pins, the
// providers as conn would find them, the RDMAGRPC_* settings, and with
// --connect it dials an address the way a service would. Every problem it
// finds is printed with its symptom and its fix.

const doctorUsage = `rdmatrace doctor: check this machine for rdmagrpc over RDMA.

Usage: rdmatrace doctor [--connect host:port] [--loopback] [--sysfs DIR]

Prints the RDMA devices, their ports and GID tables (with RoCE versions
and the network device behind each), the memlock limit against what
rdmagrpc pins per connection, the providers conn can use here and the
RDMAGRPC_* settings in effect, then the problems found, each with its fix.
With --connect it dials the address with rdmagrpc (no fall-back to TCP)
and reports what the connection runs on. Exit status 1 when a problem was
found.

Flags:
%s`

type doctorConfig struct {
	sysfs    string
	connect  string
	loopback bool
	timeout  time.Duration
}

func runDoctor(args []string, out, stderr io.Writer) int {
	var c doctorConfig
	fs := flag.NewFlagSet("rdmatrace doctor", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.sysfs, "sysfs", "/sys", "sysfs `root` to read devices from")
	fs.StringVar(&c.connect, "connect", "", "dial this rdmagrpc `host:port` and report the connection")
	fs.BoolVar(&c.loopback, "loopback", false, "listen on this machine's first RDMA address (127.0.0.1 without one) and dial it, as --connect does")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Second, "limit of the --connect dial")
	setUsage(fs, stderr, doctorUsage)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "rdmatrace doctor: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	r := &report{w: out}
	r.host()
	devs := verbs.Sysfs(c.sysfs)
	r.devices(devs, c.sysfs)
	r.counters(c.sysfs)
	r.memlock()
	r.providers()
	r.settings()
	if c.connect != "" {
		r.dial(c.connect, c.timeout)
	}
	if c.loopback {
		r.loopback(devs, c.timeout)
	}
	return r.verdict()
}

// report prints as it goes and collects the problems for the end.
type report struct {
	w        io.Writer
	problems []string
}

func (r *report) printf(format string, a ...any) { fmt.Fprintf(r.w, format, a...) }

func (r *report) problem(format string, a ...any) {
	r.problems = append(r.problems, fmt.Sprintf(format, a...))
}

func (r *report) host() {
	var u unix.Utsname
	kernel := "?"
	if unix.Uname(&u) == nil {
		kernel = unix.ByteSliceToString(u.Release[:])
	}
	name, _ := os.Hostname()
	r.printf("rdmagrpc doctor on %s, Linux %s, %s\n\n", name, kernel, time.Now().UTC().Format(time.RFC3339))
}

// roceMTU is the path MTU RoCE can use over a network device of mtu
// bytes: the largest IB MTU that fits with the RoCE v2 headers (IP, UDP,
// BTH, ICRC and extended headers: rdma-core rounds with 256 bytes spare).
func roceMTU(mtu int) int {
	best := 0
	for _, m := range []int{256, 512, 1024, 2048, 4096} {
		if m+256 <= mtu || (m == 4096 && mtu >= 4200) {
			best = m
		}
	}
	return best
}

func (r *report) devices(devs []verbs.DeviceInfo, sysfs string) {
	r.printf("RDMA devices (%s):\n", filepath.Join(sysfs, "class", "infiniband"))
	if len(devs) == 0 {
		r.printf("  none\n")
		r.problem("no RDMA device: rdmagrpc runs over shm between processes of this host and over TCP to others. " +
			"On a RoCE NIC, load its driver (mlx5_ib, bnxt_re, irdma, ...); to try RoCE without one, Soft-RoCE: " +
			"modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0")
	}
	for _, d := range devs {
		r.printf("  %s  node type %s  firmware %s\n", d.Name, orDash(d.NodeType), orDash(d.FW))
		if len(d.Ports) == 0 {
			r.problem("%s: no ports in sysfs", d.Name)
		}
		for _, p := range d.Ports {
			r.printf("    port %d  %s  %s  link layer %s  rate %s\n", p.Num, orDash(p.State), orDash(p.Phys), orDash(p.LinkLayer), orDash(p.Rate))
			for _, nd := range p.Netdevs {
				if mtu, ok := p.NetdevMTU[nd]; ok {
					r.printf("      network device %s  MTU %d  (RoCE path MTU up to %d)\n", nd, mtu, roceMTU(mtu))
					if p.LinkLayer == "Ethernet" && roceMTU(mtu) < 1024 {
						r.problem("%s port %d: %s has MTU %d, too small for a 1024-byte RoCE path MTU: raise it (ip link set %s mtu 1500 or more; 4200 for 4096)", d.Name, p.Num, nd, mtu, nd)
					}
				}
			}
			v2 := map[bool]bool{} // IPv4-mapped or not → a RoCE v2 GID exists
			for _, g := range p.GIDs {
				a := g.Addr
				kind := "IPv6"
				if a.Is4In6() {
					a, kind = a.Unmap(), "IPv4"
				}
				r.printf("      GID %-3d %-40s %-12s %s\n", g.Index, a, orDash(g.Type), g.Netdev)
				if strings.Contains(g.Type, "v2") {
					v2[kind == "IPv4"] = true
				}
			}
			if !strings.HasPrefix(p.State, "4") {
				r.problem("%s port %d is %s, not ACTIVE: no connection can use it (check the cable or the network device behind it: ip link)", d.Name, p.Num, orDash(p.State))
			}
			if p.LinkLayer == "Ethernet" && !v2[true] {
				r.problem("%s port %d has no RoCE v2 GID for an IPv4 address: rdma_cm cannot route IPv4 over it with RoCE v2 (give the network device an IPv4 address; in a pod, the GID table shows the pod's addresses only when the device plugin shares the namespace)", d.Name, p.Num)
			}
		}
	}
	r.printf("\n")
}

// counters prints each port's hardware and port counters that are not
// zero, and makes a problem of each error counter that is.
func (r *report) counters(sysfs string) {
	ports, err := readHWCounters(sysfs)
	r.printf("port counters (hw_counters and counters):\n")
	switch {
	case err != nil:
		r.printf("  unreadable: %v\n\n", err)
		return
	case len(ports) == 0:
		r.printf("  none: no RDMA device on this host\n\n")
		return
	}
	for _, p := range ports {
		names := slices.Sorted(maps.Keys(p.Values))
		var nonzero []string
		for _, n := range names {
			if v := p.Values[n]; v != 0 {
				nonzero = append(nonzero, fmt.Sprintf("%s %d", n, v))
			}
		}
		r.printf("  %s: %d counters", p.name(), len(names))
		if len(nonzero) == 0 {
			r.printf(", all zero\n")
		} else {
			r.printf(", not zero:\n")
			for _, l := range wrap(strings.Join(nonzero, ", "), 74) {
				r.printf("    %s\n", l)
			}
		}
		for _, c := range errorCounters {
			if v := p.Values[c.name]; v != 0 {
				r.problem("%s: %s is %d: %s (the counter counts since the driver loaded; watch its rate in the live view)", p.name(), c.name, v, c.meaning)
			}
		}
	}
	r.printf("\n")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// Registered memory per connection and side with the default options.
const (
	idleSide     = conn.DefaultSlotSize * conn.DefaultSlotCount * 2 // receive ring and staging
	enlargedSide = idleSide + conn.DefaultLargeSize*conn.DefaultLargeCount
	deepSide     = idleSide + conn.DefaultDeepSize*conn.DefaultDeepCount // the ladder's top
)

func (r *report) memlock() {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		r.printf("memlock: unknown (%v)\n\n", err)
		return
	}
	r.printf("memlock (ulimit -l): ")
	switch {
	case lim.Cur == unix.RLIM_INFINITY:
		r.printf("unlimited\n")
	case hasIPCLock():
		r.printf("%d KiB, not binding: this process has CAP_IPC_LOCK (a service started otherwise may not)\n", lim.Cur>>10)
	default:
		r.printf("%d KiB: room for %d idle connection ends (%d KiB each) or %d enlarged ones (%d KiB each)\n",
			lim.Cur>>10, lim.Cur/idleSide, idleSide>>10, lim.Cur/enlargedSide, enlargedSide>>10)
		if lim.Cur < 64*enlargedSide {
			r.problem("the memlock limit (%d KiB) holds fewer than 64 enlarged connection ends: registrations will fail with ENOMEM under load on verbs (shm does not pin). Raise it (ulimit -l, LimitMEMLOCK= in systemd, the container runtime's or pod's memlock ulimit) or give the process CAP_IPC_LOCK", lim.Cur>>10)
		}
	}
	r.printf("  rdmagrpc pins %d KiB per idle connection end, %d KiB per enlarged direction (%d KiB once a stream climbs to the deepest phase), and rendezvous transfers of large messages for their duration\n\n", idleSide>>10, enlargedSide>>10, deepSide>>10)
}

// hasIPCLock reports whether CAP_IPC_LOCK is in this process's effective
// set: pinning is then not bounded by the memlock limit.
func hasIPCLock() bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<unix.CAP_IPC_LOCK) != 0
		}
	}
	return false
}

func (r *report) providers() {
	r.printf("providers (in conn's order of choice):\n")
	for _, name := range []string{"verbs", "shm"} {
		p, err := transport.Get(name)
		if err != nil {
			r.printf("  %-6s not in this binary\n", name)
			continue
		}
		d, err := p.Open("")
		if err != nil {
			r.printf("  %-6s unavailable: %v\n", name, err)
			continue
		}
		a := d.Attr()
		r.printf("  %-6s device %s  (max QP WR %d, max inline %d)\n", name, d.Name(), a.MaxQPWR, a.MaxInline)
		d.Close()
	}
	r.printf("\n")
}

func (r *report) settings() {
	var set []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "RDMAGRPC_") {
			set = append(set, kv)
		}
	}
	slices.Sort(set)
	r.printf("settings: ")
	if len(set) == 0 {
		r.printf("no RDMAGRPC_* variable set (the defaults)\n\n")
		return
	}
	r.printf("\n")
	for _, kv := range set {
		r.printf("  %s\n", kv)
	}
	r.printf("\n")
}

func (r *report) dial(addr string, timeout time.Duration) {
	r.printf("dial %s (rdmagrpc, no fall-back to TCP):\n", addr)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start := time.Now()
	nc, err := conn.Dial(ctx, addr, conn.WithoutFallback())
	took := time.Since(start)
	if err != nil {
		r.printf("  failed after %v: %v\n\n", took.Round(time.Microsecond), err)
		r.problem("dial %s failed: %v", addr, err)
		return
	}
	defer nc.Close()
	c := nc.(*conn.Conn)
	if err := c.Handshake(ctx); err != nil {
		r.printf("  failed after %v: %v\n\n", time.Since(start).Round(time.Microsecond), err)
		r.problem("dial %s failed: %v", addr, err)
		return
	}
	st := c.Stats()
	r.printf("  connected in %v over %s (device %s), %v → %v\n", took.Round(time.Microsecond), st.Provider, orDash(st.Device), c.LocalAddr(), c.RemoteAddr())
	if p := st.Path; p.Port != 0 {
		r.printf("  path: port %d, source GID %d (%s), path MTU %d, traffic class %d, service level %d\n",
			p.Port, p.GIDIndex, orDash(p.GIDType), p.MTU, p.TrafficClass, p.ServiceLevel)
	}
	r.printf("\n")
}

// loopback listens on the first IPv4 address of an ACTIVE RDMA port (or
// 127.0.0.1, shm, where there is none) and dials it: the whole path
// through this machine's device, both ends here.
func (r *report) loopback(devs []verbs.DeviceInfo, timeout time.Duration) {
	host := "127.0.0.1"
found:
	for _, d := range devs {
		for _, p := range d.Ports {
			if !strings.Contains(p.State, "ACTIVE") {
				continue
			}
			for _, g := range p.GIDs {
				if g.Addr.Is4In6() && g.Type == "RoCE v2" {
					host = g.Addr.Unmap().String()
					break found
				}
			}
		}
	}
	l, err := conn.Listen(context.Background(), host+":0")
	if err != nil {
		r.printf("loopback: listen on %s: %v\n\n", host, err)
		r.problem("listen on %s failed: %v", host, err)
		return
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	r.printf("loopback, listening on %s:\n", l.Addr())
	r.dial(l.Addr().String(), timeout)
}

func (r *report) verdict() int {
	if len(r.problems) == 0 {
		r.printf("no problem found\n")
		return 0
	}
	r.printf("problems (%d):\n", len(r.problems))
	for _, p := range r.problems {
		r.printf("  - %s\n", p)
	}
	return 1
}
