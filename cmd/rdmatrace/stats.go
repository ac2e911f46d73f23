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
	PID  uint32
	Comm string

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
	// Open connections by provider, from the connection markers
	// (opened since rdmatrace started, not yet closed): conn id → RDMA.
	open   map[uint64]bool
	Exited bool // the process is gone (its row stays until hidden)
}

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

// providers counts the open connections seen opening: over RDMA, over TCP.
func (p *proc) providers() (rdma, tcp int) {
	for _, r := range p.open {
		if r {
			rdma++
		} else {
			tcp++
		}
	}
	return
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
}

func newStats(now time.Time) *stats {
	return &stats{procs: map[uint32]*proc{}, lastTick: now}
}

func (s *stats) add(ev bpf.Event) {
	s.events++
	p := s.procs[ev.PID]
	if p == nil {
		p = &proc{PID: ev.PID}
		s.procs[ev.PID] = p
	}
	p.Comm = ev.Comm
	switch ev.Kind {
	case bpf.KindRegister:
		p.observe(ev.Duration)
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
			p.open = map[uint64]bool{}
		}
		switch ev.Outcome {
		case bpf.OutcomeOpenedRDMA, bpf.OutcomeOpenedTCP:
			p.open[ev.ConnID] = ev.Outcome == bpf.OutcomeOpenedRDMA
		case bpf.OutcomeClosed:
			delete(p.open, ev.ConnID)
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
