package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bpf"
	"github.com/rdmagrpc/rdmagrpc/conn"
)

// jsonEvent is one line of --json output.
type jsonEvent struct {
	Type       string    `json:"type"` // "event"
	Time       time.Time `json:"time"`
	Kind       string    `json:"kind"` // reg, dereg, rereg, enlarge
	Func       string    `json:"func"`
	PID        uint32    `json:"pid"`
	TID        uint32    `json:"tid"`
	Comm       string    `json:"comm"`
	OK         bool      `json:"ok"`
	DurationNs int64     `json:"duration_ns"`
	Addr       uint64    `json:"addr,omitempty"`
	Length     uint64    `json:"length,omitempty"`
	PrevLength uint64    `json:"prev_length,omitempty"`
	Access     uint32    `json:"access,omitempty"`
	LKey       uint32    `json:"lkey,omitempty"`
	Result     uint64    `json:"result,omitempty"`

	ConnID            uint64 `json:"conn_id,omitempty"`
	FromSize          uint32 `json:"from_size,omitempty"`
	ToSize            uint32 `json:"to_size,omitempty"`
	EnlargeDurationNs int64  `json:"enlarge_duration_ns,omitempty"`
	Outcome           uint32 `json:"outcome,omitempty"`
	OutcomeName       string `json:"outcome_name,omitempty"`
}

// jsonSummary is printed per process when rdmatrace stops.
type jsonSummary struct {
	Type         string  `json:"type"` // "summary"
	PID          uint32  `json:"pid"`
	Comm         string  `json:"comm"`
	Regs         uint64  `json:"regs"`
	RegFails     uint64  `json:"reg_fails"`
	Deregs       uint64  `json:"deregs"`
	Reregs       uint64  `json:"reregs"`
	Registered   uint64  `json:"registered_bytes"`
	Live         uint64  `json:"live_bytes"`
	P50Ns        int64   `json:"p50_ns"`
	P99Ns        int64   `json:"p99_ns"`
	Enlargements uint64  `json:"enlargements"`
	Shrinks      uint64  `json:"shrinks"`
	Parks        uint64  `json:"parks"`
	RegsPerSec   float64 `json:"regs_per_sec"`
	// Connections by phase, from the enlargement markers.
	LargeSend int `json:"large_send_connections"`
	LargeRecv int `json:"large_receive_connections"`
	SmallDirs int `json:"small_directions"`
	// Open connections by provider, from the connection markers (and
	// the socket scan for those open before rdmatrace started); RDMA
	// connections whose provider could not be told are UnknownRDMA.
	// Partial: the process ran before rdmatrace, the counts may be short.
	ShmConns    int  `json:"shm_connections"`
	VerbsConns  int  `json:"verbs_connections"`
	TCPConns    int  `json:"tcp_connections"`
	UnknownRDMA int  `json:"rdma_unknown_provider_connections,omitempty"`
	Partial     bool `json:"partial,omitempty"`
	Exited      bool `json:"exited"`
}

type jsonTotals struct {
	Type     string `json:"type"` // "totals"
	Events   uint64 `json:"events"`
	Lost     uint64 `json:"lost"`
	NoEntry  uint64 `json:"returns_without_entry"`
	Duration string `json:"duration"`
}

// jsonDoctor is rdmatrace doctor --json: the whole report, one object.
type jsonDoctor struct {
	Type     string        `json:"type"` // "doctor"
	OK       bool          `json:"ok"`   // no problem: the exit status is 0
	Provider jsonChoice    `json:"provider"`
	Settings []jsonSetting `json:"settings"`
	Devices  []jsonDevice  `json:"devices"`
	Problems []string      `json:"problems"`
	Notes    []string      `json:"notes"`
}

// jsonChoice is the provider a service on the host would use and why,
// or the error its Listen and Dial would return.
type jsonChoice struct {
	Name   string `json:"name,omitempty"`
	Reason string `json:"reason,omitempty"`
	Error  string `json:"error,omitempty"`
}

// jsonSetting is one RDMAGRPC_* variable: every library setting, set or
// not, then those set that are tools' or unknown.
type jsonSetting struct {
	Name     string `json:"name"`
	Value    string `json:"value"`
	Set      bool   `json:"set"`
	Kind     string `json:"kind"` // library, tool, unknown
	Meaning  string `json:"meaning,omitempty"`
	Problem  string `json:"problem,omitempty"`
	Severity string `json:"severity,omitempty"` // error (a bad value), warning (an unknown name)
}

type jsonDevice struct {
	Name     string     `json:"name"`
	NodeType string     `json:"node_type"`
	FW       string     `json:"firmware"`
	Ports    []jsonPort `json:"ports"`
}

type jsonPort struct {
	Num       int            `json:"port"`
	State     string         `json:"state"`
	PhysState string         `json:"phys_state"`
	LinkLayer string         `json:"link_layer"`
	Rate      string         `json:"rate"`
	GIDs      []jsonGID      `json:"gids"`
	NetdevMTU map[string]int `json:"netdev_mtu,omitempty"`
}

type jsonGID struct {
	Index  int    `json:"index"`
	Addr   string `json:"addr"`
	Type   string `json:"type"`
	Netdev string `json:"netdev"`
}

func runJSON(ctx context.Context, tr *bpf.Tracer, cfg config) error {
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	enc := json.NewEncoder(out)
	start := time.Now()
	st := newStats(start)
	st.ranBefore = startedBefore
	disc := newDiscovery(cfg.pid)
	if cfg.duration > 0 {
		tr.SetDeadline(start.Add(cfg.duration))
	}
	stopped := context.AfterFunc(ctx, func() { tr.Close() })
	defer stopped()
	lastFlush := start
	for {
		if cfg.duration > 0 && time.Since(start) >= cfg.duration {
			break // a steady stream never lets Read reach its deadline
		}
		ev, err := tr.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, bpf.ErrClosed) {
			break
		}
		if err != nil {
			return err
		}
		st.add(ev)
		if err := enc.Encode(toJSON(ev)); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		// Scripts reading a pipe see events within a fifth of a second.
		if now := time.Now(); out.Buffered() > 32<<10 || now.Sub(lastFlush) > 200*time.Millisecond {
			out.Flush()
			lastFlush = now
		}
	}
	elapsed := time.Since(start)
	st.setFound(disc.found(), commOf)
	st.markExited(processAlive)
	procs := st.rows(byPID, true, "", false)
	for _, p := range procs {
		sl, rl, sm := p.phases()
		n := p.providers()
		enc.Encode(jsonSummary{
			LargeSend: sl, LargeRecv: rl, SmallDirs: sm, Exited: p.Exited,
			ShmConns: n[provShm] + p.Found[provShm], VerbsConns: n[provVerbs] + p.Found[provVerbs],
			TCPConns: n[provTCP] + p.Found[provTCP], UnknownRDMA: n[provRDMA], Partial: p.Partial,
			Type: "summary", PID: p.PID, Comm: p.Comm,
			Regs: p.Regs, RegFails: p.RegFails, Deregs: p.Deregs, Reregs: p.Reregs,
			Registered: p.Registered, Live: p.Live(),
			P50Ns: int64(p.Percentile(0.5)), P99Ns: int64(p.Percentile(0.99)),
			Enlargements: p.Enlargements, Shrinks: p.Shrinks, Parks: p.Parks,
			RegsPerSec: float64(p.Regs+p.RegFails) / elapsed.Seconds(),
		})
	}
	tot := jsonTotals{Type: "totals", Events: st.events, Duration: elapsed.Round(time.Millisecond).String()}
	if s, err := tr.Stats(); err == nil {
		tot.Lost, tot.NoEntry = s.Lost, s.NoEntry
	}
	return enc.Encode(tot)
}

func toJSON(ev bpf.Event) jsonEvent {
	j := jsonEvent{
		Type: "event", Time: ev.Time, Kind: ev.Kind.String(), Func: ev.Func,
		PID: ev.PID, TID: ev.TID, Comm: ev.Comm, OK: ev.OK, DurationNs: int64(ev.Duration),
		Addr: ev.Addr, Length: ev.Length, PrevLength: ev.PrevLength, Access: ev.Access,
		LKey: ev.LKey, Result: ev.Result,
		ConnID: ev.ConnID, FromSize: ev.FromSize, ToSize: ev.ToSize,
		EnlargeDurationNs: int64(ev.EnlargeDuration), Outcome: ev.Outcome,
	}
	if ev.Kind == bpf.KindEnlargement || ev.Kind == bpf.KindConnection || ev.Kind == bpf.KindShrink || ev.Kind == bpf.KindPark {
		j.OutcomeName = conn.EnlargeOutcome(ev.Outcome)
	}
	return j
}
