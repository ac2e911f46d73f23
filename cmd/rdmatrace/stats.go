package main

import (
	"cmp"
	"fmt"
	"math/bits"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bpf"
)

// latencyWindow is how many recent registration latencies each process
// keeps for its percentiles: exact over the window, bounded in memory.
const latencyWindow = 4096

// histBuckets are power-of-two latency buckets: bucket i holds calls of
// [2^i, 2^(i+1)) ns.
const histBuckets = 40

const maxEnlargements = 64

// proc is what rdmatrace knows about one process.
type proc struct {
	PID    uint32
	Comm   string
	events uint64 // events of this process

	Regs, RegFails, Deregs, Reregs uint64
	Registered                     uint64 // bytes, successful registrations
	live                           int64  // bytes registered minus released, since start
	releasedUnseen                 bool   // released memory registered before we started
	Enlargements                   uint64
	Shrinks                        uint64  // of either direction
	Parks                          uint64  // of either direction: an idle small ring's pages given back
	Rate                           float64 // registrations per second, last interval
	lastRegs                       uint64

	window []time.Duration // ring of recent registration latencies
	next   int
	Hist   [histBuckets]uint64

	// Connections by phase, from the enlargement markers: a connection
	// is counted in the phase its last marker on each side left it in.
	sendPhase, recvPhase map[uint64]bool // conn id → large
	// Open connections, from the connection markers (opened since
	// rdmatrace started, not yet closed): conn id → provider.
	open map[uint64]string
	// why: conn id → why it has its provider, where its open marker said
	// (whyText).
	why map[uint64]string
	// lastReg is the provider of the process's latest registration
	// (provShm: transport/shm's regMR; provVerbs: libibverbs). A
	// connection's buffers are registered just before its open marker,
	// which names only "RDMA", so this tells shm from verbs.
	lastReg string
	// Partial: the process ran before rdmatrace started, so connections
	// it opened earlier are not counted (the counts are lower bounds).
	Partial bool
	// Found: connection ends open before rdmatrace started that a scan
	// of the process's sockets found (see discover), by provider.
	Found  map[string]int
	Exited bool // the process is gone (its row stays until hidden)
}

// Providers as rdmatrace names them; provRDMA is an RDMA connection
// whose provider could not be told (no registration seen before it).
const (
	provShm   = "shm"
	provVerbs = "verbs"
	provTCP   = "tcp"
	provRDMA  = "rdma?"
)

// phases counts the connections whose markers were seen: directions
// sending into large buffers, receiving into large buffers, and those
// whose enlargement failed (small for now).
func (p *proc) phases() (sendLarge, recvLarge, small int) {
	for _, l := range p.sendPhase {
		if l {
			sendLarge++
		} else {
			small++
		}
	}
	for _, l := range p.recvPhase {
		if l {
			recvLarge++
		} else {
			small++
		}
	}
	return
}

// providers counts the open connections seen opening, by provider.
func (p *proc) providers() map[string]int {
	n := map[string]int{}
	for _, prov := range p.open {
		n[prov]++
	}
	return n
}

// connCounts is the process's open connections by provider, e.g.
// "shm 2 verbs 0 tcp 1", each marked "≥" when it may be short (the
// process ran before rdmatrace: its earlier connections were not seen
// opening); ends found by the socket scan are counted in.
func (p *proc) connCounts() string {
	n := p.providers()
	ge := ""
	if p.Partial {
		ge = "≥"
	}
	var parts []string
	for _, prov := range []string{provShm, provVerbs, provTCP} {
		parts = append(parts, fmt.Sprintf("%s %s%d", prov, ge, n[prov]+p.Found[prov]))
	}
	if n[provRDMA] > 0 {
		parts = append(parts, fmt.Sprintf("%s %d", provRDMA, n[provRDMA]))
	}
	return strings.Join(parts, " ")
}

// Live is the registered memory the process holds, as far as seen.
func (p *proc) Live() uint64 { return uint64(max(p.live, 0)) }

// Percentile returns the q-quantile (0..1) of the recent registration
// latencies, or 0 when there are none.
func (p *proc) Percentile(q float64) time.Duration {
	if len(p.window) == 0 {
		return 0
	}
	s := slices.Clone(p.window)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func (p *proc) observe(d time.Duration) {
	if len(p.window) < latencyWindow {
		p.window = append(p.window, d)
	} else {
		p.window[p.next] = d
		p.next = (p.next + 1) % latencyWindow
	}
	b := 0
	if d > 0 {
		b = bits.Len64(uint64(d)) - 1
	}
	p.Hist[min(b, histBuckets-1)]++
}

// stats aggregates events per process.
type stats struct {
	procs    map[uint32]*proc
	enl      []bpf.Event // most recent last
	events   uint64
	lastTick time.Time
	// ranBefore reports whether a process ran before rdmatrace started
	// (its counts of connections are then partial); nil: none did.
	ranBefore func(pid uint32) bool
}

func (s *stats) newProc(pid uint32) *proc {
	p := &proc{PID: pid}
	if s.ranBefore != nil {
		p.Partial = s.ranBefore(pid)
	}
	s.procs[pid] = p
	return p
}

// setFound records the connection ends a socket scan found open since
// before rdmatrace started: pid → provider → count. A process with such
// ends and no event yet gets a row, its command name from comm.
func (s *stats) setFound(found map[uint32]map[string]int, comm func(pid uint32) string) {
	for _, p := range s.procs {
		p.Found = nil
	}
	for pid, n := range found {
		p := s.procs[pid]
		if p == nil {
			p = s.newProc(pid)
			p.Comm = comm(pid)
		}
		p.Found = n
	}
}

func newStats(now time.Time) *stats {
	return &stats{procs: map[uint32]*proc{}, lastTick: now}
}

func (s *stats) add(ev bpf.Event) {
	s.events++
	p := s.procs[ev.PID]
	if p == nil {
		p = s.newProc(ev.PID)
	}
	p.events++
	p.Comm = ev.Comm
	switch ev.Kind {
	case bpf.KindRegister:
		p.observe(ev.Duration)
		p.lastReg = provVerbs
		if strings.Contains(ev.Func, "shm.") {
			p.lastReg = provShm
		}
		if !ev.OK {
			p.RegFails++
			return
		}
		p.Regs++
		p.Registered += ev.Length
		p.live += int64(ev.Length)
	case bpf.KindReregister:
		p.observe(ev.Duration)
		if ev.OK {
			p.Reregs++
			p.live += int64(ev.Length) - int64(ev.PrevLength)
		}
	case bpf.KindDeregister:
		if ev.OK {
			p.Deregs++
			p.live -= int64(ev.Length)
			if p.live < 0 {
				p.releasedUnseen = true
			}
		}
	case bpf.KindConnection:
		if p.open == nil {
			p.open = map[uint64]string{}
		}
		switch ev.Outcome {
		case bpf.OutcomeOpenedRDMA:
			switch ev.FromSize {
			case bpf.OpenedShm:
				p.open[ev.ConnID] = provShm
			case bpf.OpenedVerbs:
				p.open[ev.ConnID] = provVerbs
			default: // a binary whose marker does not say
				p.open[ev.ConnID] = cmp.Or(p.lastReg, provRDMA)
			}
			if w := whyText(ev.ToSize); w != "" {
				if p.why == nil {
					p.why = map[uint64]string{}
				}
				p.why[ev.ConnID] = w
			}
		case bpf.OutcomeOpenedTCP:
			p.open[ev.ConnID] = provTCP
		case bpf.OutcomeClosed:
			delete(p.open, ev.ConnID)
			delete(p.why, ev.ConnID)
		}
	case bpf.KindShrink:
		p.Shrinks++
		if p.sendPhase == nil {
			p.sendPhase, p.recvPhase = map[uint64]bool{}, map[uint64]bool{}
		}
		if ev.Outcome == bpf.OutcomeShrunk {
			p.sendPhase[ev.ConnID] = false
		} else {
			p.recvPhase[ev.ConnID] = false
		}
		s.enl = append(s.enl, ev)
		if len(s.enl) > maxEnlargements {
			s.enl = slices.Delete(s.enl, 0, len(s.enl)-maxEnlargements)
		}
	case bpf.KindPark:
		p.Parks++
		s.enl = append(s.enl, ev)
		if len(s.enl) > maxEnlargements {
			s.enl = slices.Delete(s.enl, 0, len(s.enl)-maxEnlargements)
		}
	case bpf.KindEnlargement:
		p.Enlargements++
		if p.sendPhase == nil {
			p.sendPhase, p.recvPhase = map[uint64]bool{}, map[uint64]bool{}
		}
		switch ev.Outcome {
		case 1: // enlarged
			p.sendPhase[ev.ConnID] = true
		case 2, 3, 4: // refused by the peer, ack timed out, local registration failed
			p.sendPhase[ev.ConnID] = false
		case 5: // served
			p.recvPhase[ev.ConnID] = true
		case 6: // refused
			p.recvPhase[ev.ConnID] = false
		}
		s.enl = append(s.enl, ev)
		if len(s.enl) > maxEnlargements {
			s.enl = slices.Delete(s.enl, 0, len(s.enl)-maxEnlargements)
		}
	}
}

// tick updates per-second rates.
func (s *stats) tick(now time.Time) {
	dt := now.Sub(s.lastTick).Seconds()
	if dt <= 0 {
		return
	}
	for _, p := range s.procs {
		p.Rate = float64(p.Regs+p.RegFails-p.lastRegs) / dt
		p.lastRegs = p.Regs + p.RegFails
	}
	s.lastTick = now
}

// sortKey orders the process table.
type sortKey int

const (
	byRate sortKey = iota
	byRegs
	byRegistered
	byLive
	byP99
	byPID
	numSortKeys
)

func (k sortKey) String() string {
	return [...]string{"reg/s", "regs", "registered", "live", "p99", "pid"}[k]
}

// markExited marks the processes alive says are gone.
func (s *stats) markExited(alive func(pid uint32) bool) {
	for _, p := range s.procs {
		if !p.Exited && !alive(p.PID) {
			p.Exited = true
		}
	}
}

// rows returns the processes matching filter (a substring of the command
// name or pid), sorted by key, largest first unless asc; without the
// exited ones if hideExited.
func (s *stats) rows(key sortKey, asc bool, filter string, hideExited bool) []*proc {
	var out []*proc
	for _, p := range s.procs {
		if filter != "" && !strings.Contains(p.Comm, filter) && !strings.Contains(strconv.Itoa(int(p.PID)), filter) {
			continue
		}
		if hideExited && p.Exited {
			continue
		}
		out = append(out, p)
	}
	val := func(p *proc) float64 {
		switch key {
		case byRate:
			return p.Rate
		case byRegs:
			return float64(p.Regs)
		case byRegistered:
			return float64(p.Registered)
		case byLive:
			return float64(p.Live())
		case byP99:
			return float64(p.Percentile(0.99))
		}
		return float64(p.PID)
	}
	slices.SortStableFunc(out, func(a, b *proc) int {
		c := cmp.Compare(val(a), val(b))
		if !asc {
			c = -c
		}
		if c == 0 {
			c = cmp.Compare(a.PID, b.PID) // ties: by pid, ascending
		}
		return c
	})
	return out
}

func humanBytes(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%dB", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f%ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// shortBytes is humanBytes in at most 5 columns: "1023B", "4.0K",
// "512K", "1023M".
func shortBytes(n uint64) string {
	if n < 1024 {
		return fmt.Sprintf("%dB", n)
	}
	return shortScaled(float64(n), 1024, "KMGTPE", 9.95, 1023.5)
}

// shortCount is n in at most 5 columns: "9999", "12.3k", "999k", "1.2M".
func shortCount(n uint64) string {
	if n < 100000 {
		return strconv.FormatUint(n, 10)
	}
	return shortScaled(float64(n), 1000, "kMGTPE", 99.95, 999.5)
}

// shortScaled divides v by base until it fits, and prints it with the
// unit letter reached: one decimal below oneDecimal, none below whole.
func shortScaled(v, base float64, units string, oneDecimal, whole float64) string {
	for _, u := range units {
		v /= base
		if v < oneDecimal {
			return fmt.Sprintf("%.1f%c", v, u)
		}
		if v < whole {
			return fmt.Sprintf("%.0f%c", v, u)
		}
	}
	return "huge"
}

// shortRate is a per-second rate in at most 6 columns.
func shortRate(r float64) string {
	if r < 9999.95 {
		return fmt.Sprintf("%.1f", r)
	}
	return shortCount(uint64(r))
}

// shortDuration is humanDuration in at most 6 columns: "850ns", "1.5µs",
// "152µs", "17.1ms", "2.50s", "1234s".
func shortDuration(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	for _, u := range []struct {
		d    time.Duration
		name string
	}{{time.Microsecond, "ns"}, {time.Millisecond, "µs"}, {time.Second, "ms"}} {
		if d < u.d {
			v := float64(d) / float64(u.d/1000)
			if v < 9.95 {
				return fmt.Sprintf("%.1f%s", v, u.name)
			}
			if v < 999.5 {
				return fmt.Sprintf("%.0f%s", v, u.name)
			}
		}
	}
	if s := d.Seconds(); s < 9.995 {
		return fmt.Sprintf("%.2fs", s)
	} else if s < 99999.5 {
		return fmt.Sprintf("%.0fs", s)
	}
	return ">1d"
}

func humanDuration(d time.Duration) string {
	switch {
	case d == 0:
		return "-"
	case d < time.Microsecond:
		return fmt.Sprintf("%dns", d.Nanoseconds())
	case d < time.Millisecond:
		return fmt.Sprintf("%.1fµs", float64(d)/float64(time.Microsecond))
	case d < time.Second:
		return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}

// whyText words an opened marker's reason code; "": not said.
func whyText(code uint32) string {
	switch code {
	case bpf.WhyPinned:
		return "pinned (WithProvider or RDMAGRPC_PROVIDER)"
	case bpf.WhySameHost:
		return "the peer is on this host (same kernel): shared memory"
	case bpf.WhyOtherHost:
		return "the peer is on another host"
	case bpf.WhyDefault:
		return "the process's provider (an RDMA device found, or none)"
	}
	return ""
}
