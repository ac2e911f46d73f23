package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The RDMA device's own counters, per port, from sysfs:
// class/infiniband/DEV/ports/N/counters/* (the IB port counters:
// link_downed, symbol_error, port_rcv_errors, ...) and
// .../hw_counters/* (the driver's: rnr_nak_retry_err,
// local_ack_timeout_err, out_of_sequence, ...). They count what the NIC
// saw, whichever process caused it, and need no root.

// portCounters is one port's counters: name → value.
type portCounters struct {
	Dev    string
	Port   int
	Values map[string]uint64
}

func (p portCounters) name() string { return fmt.Sprintf("%s/%d", p.Dev, p.Port) }

// readHWCounters reads every port's counters under sysfs (a sysfs root:
// "/sys", or a fake tree in tests). No device gives no ports, no error.
func readHWCounters(sysfs string) ([]portCounters, error) {
	base := filepath.Join(sysfs, "class", "infiniband")
	devs, err := os.ReadDir(base)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []portCounters
	for _, d := range devs {
		ports, _ := os.ReadDir(filepath.Join(base, d.Name(), "ports"))
		for _, p := range ports {
			n, err := strconv.Atoi(p.Name())
			if err != nil {
				continue
			}
			pc := portCounters{Dev: d.Name(), Port: n, Values: map[string]uint64{}}
			for _, sub := range []string{"counters", "hw_counters"} {
				dir := filepath.Join(base, d.Name(), "ports", p.Name(), sub)
				files, _ := os.ReadDir(dir)
				for _, f := range files {
					if f.IsDir() || f.Name() == "lifespan" { // lifespan: the driver's refresh period, not a count
						continue
					}
					b, err := os.ReadFile(filepath.Join(dir, f.Name()))
					if err != nil {
						continue // some counters are not readable on some devices
					}
					v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
					if err == nil {
						pc.Values[f.Name()] = v
					}
				}
			}
			out = append(out, pc)
		}
	}
	slices.SortFunc(out, func(a, b portCounters) int { return strings.Compare(a.name(), b.name()) })
	return out, nil
}

// errorCounters are the counters that mean trouble when they move, with
// what they mean. Names are the kernel's (IB port counters) and the
// drivers' (mlx5, irdma, bnxt_re, rxe share most of them).
var errorCounters = []struct{ name, meaning string }{
	{"rnr_nak_retry_err", "the peer had no receive posted, retries exhausted"},
	{"local_ack_timeout_err", "no ACK from the peer in time, retries exhausted (lossy or congested path)"},
	{"retry_exceeded_err", "transport retries exhausted"},
	{"out_of_sequence", "packets out of sequence (loss: look at PFC/ECN on RoCE)"},
	{"packet_seq_err", "NAKs for sequence errors received"},
	{"implied_nak_seq_err", "ACKs implying lost packets"},
	{"duplicate_request", "requests received twice (the peer retransmitted)"},
	{"req_cqe_error", "work requests completed in error"},
	{"resp_cqe_error", "responses completed in error"},
	{"link_downed", "the link went down"},
	{"link_error_recovery", "link error recoveries"},
	{"symbol_error", "physical symbol errors (cable, transceiver)"},
	{"port_rcv_errors", "received packets with errors"},
	{"port_xmit_discards", "packets dropped on send (port down or congested)"},
	{"local_link_integrity_errors", "local link integrity errors"},
	{"excessive_buffer_overrun_errors", "receive buffer overruns"},
	{"rx_icrc_encapsulated", "RoCE packets with a bad ICRC"},
}

// hwRates samples the ports' counters on each tick of the live view and
// shows the error counters' rates over the last interval.
type hwRates struct {
	sysfs string
	prev  map[string]portCounters
	rates map[string]map[string]float64 // port → counter → per second
	at    time.Time
	ports []portCounters
	err   error
}

func newHWRates(sysfs string, now time.Time) *hwRates {
	h := &hwRates{sysfs: sysfs}
	h.sample(now)
	return h
}

// sample reads the counters; the rates are from the previous sample.
func (h *hwRates) sample(now time.Time) {
	if h == nil {
		return
	}
	ports, err := readHWCounters(h.sysfs)
	h.err = err
	cur := map[string]portCounters{}
	h.rates = map[string]map[string]float64{}
	dt := now.Sub(h.at).Seconds()
	for _, p := range ports {
		cur[p.name()] = p
		old, ok := h.prev[p.name()]
		if !ok || dt <= 0 {
			continue
		}
		r := map[string]float64{}
		for k, v := range p.Values {
			if o, ok := old.Values[k]; ok && v >= o {
				r[k] = float64(v-o) / dt
			}
		}
		h.rates[p.name()] = r
	}
	h.prev, h.at, h.ports = cur, now, ports
}

// lines is the view's rows: one per port, the error counters that are
// not zero with their rate ("name total +rate/s"), or a note.
func (h *hwRates) lines() []string {
	switch {
	case h.err != nil:
		return []string{"RDMA ports: " + h.err.Error()}
	case len(h.ports) == 0:
		return []string{fmt.Sprintf("RDMA ports: no RDMA device on this host (%s)", filepath.Join(h.sysfs, "class", "infiniband"))}
	}
	var out []string
	for _, p := range h.ports {
		var parts []string
		for _, c := range errorCounters {
			v, ok := p.Values[c.name]
			if !ok || v == 0 {
				continue
			}
			parts = append(parts, fmt.Sprintf("%s %s +%.1f/s", c.name, shortCount(v), h.rates[p.name()][c.name]))
		}
		if len(parts) == 0 {
			parts = append(parts, fmt.Sprintf("no errors (%d counters)", len(p.Values)))
		}
		out = append(out, p.name()+": "+strings.Join(parts, ", "))
	}
	return out
}
