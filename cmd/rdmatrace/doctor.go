package main

import (
	"context"
	"encoding/json"
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
	"github.com/rdmagrpc/rdmagrpc/internal/settings"
	"github.com/rdmagrpc/rdmagrpc/transport"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm" // what Listen would choose on this host
	"github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

// rdmatrace doctor: what an operator pastes into an issue, and a
// readiness check. It reads the RDMA devices, ports and GID tables from
// sysfs (so it needs neither rdma-core nor root), the memlock limit
// against what rdmagrpc pins, the providers as conn would find them, the
// RDMAGRPC_* settings checked as conn checks them, the provider a service
// would use and why, and with --connect it dials an address the way a
// service would. Every problem it finds is printed with its symptom and
// its fix; what does not stop the service from working (no RDMA device
// where shm is what it uses) is a note.

const doctorUsage = `rdmatrace doctor: check this machine and its RDMAGRPC_* settings for rdmagrpc,
as a report to read or a readiness check.

Usage: rdmatrace doctor [--json] [--connect host:port] [--loopback] [--sysfs DIR]

Prints the RDMA devices, their ports and GID tables (with RoCE versions
and the network device behind each), the memlock limit against what
rdmagrpc pins per connection, the providers conn can use here, the
RDMAGRPC_* settings checked as Listen and Dial check them, and the
provider a service on this host would use and why; then the notes and
the problems found, each with its fix. With --connect it dials the address
with rdmagrpc (no fall-back to TCP) and reports what the connection runs
on.

Exit status: 0 when a service here would work (shm, or TCP to hosts
without RDMA, included: no RDMA device is then a note); 1 when a problem
was found: a bad setting, a provider named but not available, an RDMA
device that is here but unusable, a failed --connect; 2 on bad usage.
--json prints one object instead: {"type":"doctor","ok":...,"provider":
{"name","reason","error"},"settings":[...],"devices":[...],"problems":
[...],"notes":[...]}.

Flags:
%s`

type doctorConfig struct {
	json     bool
	sysfs    string
	connect  string
	loopback bool
	timeout  time.Duration
}

func runDoctor(args []string, out, stderr io.Writer) int {
	var c doctorConfig
	fs := flag.NewFlagSet("rdmatrace doctor", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.BoolVar(&c.json, "json", false, "print one JSON object (settings, provider chosen, devices, problems, notes, ok) instead of the report")
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
	if c.json {
		r.w = io.Discard
	}
	r.choose()
	r.host()
	devs := verbs.Sysfs(c.sysfs)
	r.devices(devs, c.sysfs)
	r.counters(c.sysfs)
	r.memlock()
	r.providers()
	r.settings(nil)
	r.choice()
	if c.connect != "" {
		r.dial(c.connect, c.timeout)
	}
	if c.loopback {
		r.loopback(devs, c.timeout)
	}
	code := r.verdict()
	if c.json {
		if err := r.writeJSON(out, devs); err != nil {
			fmt.Fprintf(stderr, "rdmatrace doctor: %v\n", err)
			return 1
		}
	}
	return code
}

// report prints as it goes and collects the problems and notes for the
// end.
type report struct {
	w        io.Writer
	problems []string
	notes    []string // what is worth knowing but does not stop a service
	// The provider a service here would use (conn.ProviderChoice), or
	// the error its Listen and Dial would return; provider "" and err nil:
	// not asked (a report made for one section).
	provider, reason string
	choiceErr        error
	settingRows      []jsonSetting
}

func (r *report) printf(format string, a ...any) { fmt.Fprintf(r.w, format, a...) }

func (r *report) problem(format string, a ...any) {
	r.problems = append(r.problems, fmt.Sprintf(format, a...))
}

func (r *report) note(format string, a ...any) {
	r.notes = append(r.notes, fmt.Sprintf(format, a...))
}

// rdmaFinding is something wrong with the RDMA side of the host: a
// problem where a service would run over RDMA (verbs, or no working choice
// to say otherwise), a note where it runs on another provider anyway.
func (r *report) rdmaFinding(format string, a ...any) {
	if r.provider != "" && r.provider != "verbs" {
		r.note(format+" (not used here: the provider is %s)", append(a, r.provider)...)
		return
	}
	r.problem(format, a...)
}

// choose asks conn which provider a service would use, before anything
// is printed: whether the device findings are problems depends on it.
func (r *report) choose() {
	r.provider, r.reason, r.choiceErr = conn.ProviderChoice()
}

// choice prints the provider a service here would use and why, or the
// error it would meet, which is a problem (a bad setting is one already,
// named in the settings).
func (r *report) choice() {
	r.printf("provider a service here would use: ")
	switch {
	case r.choiceErr == nil:
		r.printf("%s (%s)\n", r.provider, r.reason)
		switch {
		case r.provider != "verbs":
			r.printf("  it reaches the processes of this host; connections to other hosts stay on TCP\n")
		case r.reason != settings.Provider:
			r.printf("  per connection: shm to the processes of this kernel, verbs to other hosts\n")
		}
		if dir, ok := settings.Get(settings.ShmDir); ok && dir != "" {
			r.printf("  shm across network namespaces through %s (%s)\n", dir, settings.ShmDir)
		}
	case errors.Is(r.choiceErr, conn.ErrBadSetting):
		r.printf("none: Listen and Dial fail on the bad settings above\n")
	default:
		r.printf("none: %v\n", r.choiceErr)
		r.problem("Listen and Dial fail here: %v", r.choiceErr)
	}
	r.printf("\n")
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
		r.note("no RDMA device: rdmagrpc runs over shm between processes of this host and over TCP to others. " +
			"On a RoCE NIC, load its driver (mlx5_ib, bnxt_re, irdma, ...); to try RoCE without one, Soft-RoCE: " +
			"modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0")
	}
	for _, d := range devs {
		r.printf("  %s  node type %s  firmware %s\n", d.Name, orDash(d.NodeType), orDash(d.FW))
		if len(d.Ports) == 0 {
			r.rdmaFinding("%s: no ports in sysfs", d.Name)
		}
		for _, p := range d.Ports {
			r.printf("    port %d  %s  %s  link layer %s  rate %s\n", p.Num, orDash(p.State), orDash(p.Phys), orDash(p.LinkLayer), orDash(p.Rate))
			for _, nd := range p.Netdevs {
				if mtu, ok := p.NetdevMTU[nd]; ok {
					r.printf("      network device %s  MTU %d  (RoCE path MTU up to %d)\n", nd, mtu, roceMTU(mtu))
					if p.LinkLayer == "Ethernet" && roceMTU(mtu) < 1024 {
						r.rdmaFinding("%s port %d: %s has MTU %d, too small for a 1024-byte RoCE path MTU: raise it (ip link set %s mtu 1500 or more; 4200 for 4096)", d.Name, p.Num, nd, mtu, nd)
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
				r.rdmaFinding("%s port %d is %s, not ACTIVE: no connection can use it (check the cable or the network device behind it: ip link)", d.Name, p.Num, orDash(p.State))
			}
			if p.LinkLayer == "Ethernet" && !v2[true] {
				r.rdmaFinding("%s port %d has no RoCE v2 GID for an IPv4 address: rdma_cm cannot route IPv4 over it with RoCE v2 (give the network device an IPv4 address; in a pod, the GID table shows the pod's addresses only when the device plugin shares the namespace)", d.Name, p.Num)
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
				r.rdmaFinding("%s: %s is %d: %s (the counter counts since the driver loaded; watch its rate in the live view)", p.name(), c.name, v, c.meaning)
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
			r.rdmaFinding("the memlock limit (%d KiB) holds fewer than 64 enlarged connection ends: registrations will fail with ENOMEM under load on verbs (shm does not pin). Raise it (ulimit -l, LimitMEMLOCK= in systemd, the container runtime's or pod's memlock ulimit) or give the process CAP_IPC_LOCK", lim.Cur>>10)
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

// settings checks the RDMAGRPC_* variables of environ (the process's
// when nil) with conn's own check: a bad value is a problem, a name that
// is no setting a note, with the setting it was probably meant to be.
func (r *report) settings(environ []string) {
	if environ == nil {
		environ = os.Environ()
	}
	found := map[string]settings.Problem{}
	for _, p := range settings.Check(environ) {
		found[p.Name] = p
	}
	set := map[string]string{}
	for _, kv := range environ {
		name, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(strings.ToUpper(name), "RDMAGRPC_") {
			set[name] = v
		}
	}
	for _, v := range settings.Vars {
		val, ok := set[v.Name]
		row := jsonSetting{Name: v.Name, Value: val, Set: ok, Kind: "library", Meaning: v.Meaning}
		if p, bad := found[v.Name]; bad {
			row.Problem, row.Severity = p.String(), "error"
		}
		r.settingRows = append(r.settingRows, row)
	}
	for _, name := range slices.Sorted(maps.Keys(set)) {
		if _, ok := settings.Lookup(name); ok {
			continue
		}
		row := jsonSetting{Name: name, Value: set[name], Set: true, Kind: "unknown"}
		if settings.IsTool(name) {
			row.Kind = "tool"
		} else if p, ok := found[name]; ok {
			row.Problem, row.Severity = p.String(), "warning"
		}
		r.settingRows = append(r.settingRows, row)
	}
	r.printf("settings (RDMAGRPC_*, checked as Listen and Dial check them):\n")
	if len(set) == 0 {
		r.printf("  none set (the defaults)\n\n")
		return
	}
	for _, row := range r.settingRows {
		if !row.Set {
			continue
		}
		status := "ok"
		switch {
		case row.Severity == "error":
			status = "BAD: " + row.Problem
			r.problem("%s (Listen and Dial fail with conn.ErrBadSetting)", row.Problem)
		case row.Severity == "warning":
			status = "UNKNOWN: " + row.Problem
			r.note("%s", row.Problem)
		case row.Kind == "tool":
			status = "a variable of rdmagrpc's tools or tests, not read by the library"
		}
		r.printf("  %s=%s  %s\n", row.Name, row.Value, status)
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
	if len(r.notes) > 0 {
		r.printf("notes (%d):\n", len(r.notes))
		for _, n := range r.notes {
			r.printf("  - %s\n", n)
		}
	}
	if len(r.problems) == 0 {
		r.printf("no problem found: a service here would run over %s\n", r.provider)
		return 0
	}
	r.printf("problems (%d):\n", len(r.problems))
	for _, p := range r.problems {
		r.printf("  - %s\n", p)
	}
	return 1
}

// writeJSON prints the report as one JSON object.
func (r *report) writeJSON(out io.Writer, devs []verbs.DeviceInfo) error {
	j := jsonDoctor{
		Type: "doctor", OK: len(r.problems) == 0,
		Provider: jsonChoice{Name: r.provider, Reason: r.reason},
		Settings: r.settingRows, Devices: []jsonDevice{},
		Problems: append([]string{}, r.problems...), Notes: append([]string{}, r.notes...),
	}
	if r.choiceErr != nil {
		j.Provider.Error = r.choiceErr.Error()
	}
	for _, d := range devs {
		jd := jsonDevice{Name: d.Name, NodeType: d.NodeType, FW: d.FW, Ports: []jsonPort{}}
		for _, p := range d.Ports {
			jp := jsonPort{Num: p.Num, State: p.State, PhysState: p.Phys, LinkLayer: p.LinkLayer, Rate: p.Rate, NetdevMTU: p.NetdevMTU, GIDs: []jsonGID{}}
			for _, g := range p.GIDs {
				a := g.Addr
				if a.Is4In6() {
					a = a.Unmap()
				}
				jp.GIDs = append(jp.GIDs, jsonGID{Index: g.Index, Addr: a.String(), Type: g.Type, Netdev: g.Netdev})
			}
			jd.Ports = append(jd.Ports, jp)
		}
		j.Devices = append(j.Devices, jd)
	}
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(j)
}
