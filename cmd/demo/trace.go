package main

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bpf"
	"github.com/rdmagrpc/rdmagrpc/conn"
)

// ebpfView watches the demo's own process with the bpf package, the way
// rdmatrace watches any process: uprobes on the registration functions
// (shm's, and libibverbs' when it is mapped) and on conn's enlargement
// marker. It shows, from outside the Go code, what the connections'
// Stats show from inside.
type ebpfView struct {
	tr       *bpf.Tracer
	attached []string
	stop     chan struct{}
	done     chan struct{}

	mu     sync.Mutex
	events []bpf.Event
	err    error
}

// startEBPF attaches the probes; when it cannot, it returns nil and says
// why, and the demo runs without the view.
func startEBPF() (*ebpfView, string) {
	if os.Geteuid() != 0 {
		return nil, "needs root (uprobes); run `sudo make demo`, or `sudo go run ./cmd/rdmatrace --pid <demo pid>` beside it"
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Sprintf("cannot find the demo's binary: %v", err)
	}
	tr, err := bpf.Open(bpf.Options{PID: os.Getpid()})
	if err != nil {
		if bpf.IsNotSupported(err) {
			return nil, fmt.Sprintf("this kernel lacks a BPF feature the probes need: %v", err)
		}
		return nil, err.Error()
	}
	found, err := tr.AttachGoFuncs(exe, bpf.KnownGoFuncs)
	if err != nil {
		tr.Close()
		return nil, fmt.Sprintf("%v (a binary built by plain `go run` has no symbol table: `make demo` builds with -ldflags=-s=false)", err)
	}
	if lib, err := bpf.FindLibibverbs(os.Getpid()); err == nil {
		// Missing entry points are not fatal: the others are attached.
		_ = tr.AttachLibibverbs(lib)
	}
	v := &ebpfView{tr: tr, stop: make(chan struct{}), done: make(chan struct{})}
	for _, f := range found {
		v.attached = append(v.attached, strings.TrimPrefix(f, bpf.Module+"/"))
	}
	for _, a := range tr.Attached() {
		if strings.Contains(a, "libibverbs") {
			v.attached = append(v.attached, a[strings.LastIndex(a, ":")+1:])
		}
	}
	go v.read()
	return v, ""
}

// read collects events until stop, then one more window so that what the
// probes submitted before stop is not lost.
func (v *ebpfView) read() {
	defer close(v.done)
	stopping := false
	for {
		v.tr.SetDeadline(time.Now().Add(50 * time.Millisecond))
		ev, err := v.tr.Read()
		switch {
		case err == nil:
			v.mu.Lock()
			v.events = append(v.events, ev)
			v.mu.Unlock()
		case errors.Is(err, os.ErrDeadlineExceeded):
			if stopping {
				return
			}
			select {
			case <-v.stop:
				stopping = true
			default:
			}
		default:
			v.mu.Lock()
			v.err = err
			v.mu.Unlock()
			return
		}
	}
}

// report stops the view and prints what the probes saw.
func (v *ebpfView) report() {
	close(v.stop)
	<-v.done
	stats, serr := v.tr.Stats()
	v.tr.Close()
	fmt.Printf("\neBPF view of this process (uprobes on %s):\n", strings.Join(v.attached, ", "))
	if v.err != nil {
		fmt.Printf("  reading events failed: %v\n", v.err)
	}
	var regs, deregs, fails int
	var bytes uint64
	var lat []time.Duration
	var enl []bpf.Event
	for _, ev := range v.events {
		switch ev.Kind {
		case bpf.KindRegister:
			if !ev.OK {
				fails++
				continue
			}
			regs++
			bytes += ev.Length
			lat = append(lat, ev.Duration)
		case bpf.KindDeregister:
			deregs++
		case bpf.KindEnlargement:
			enl = append(enl, ev)
		}
	}
	fmt.Printf("  registrations %d (%d bytes, %d failed), deregistrations %d", regs, bytes, fails, deregs)
	if len(lat) > 0 {
		slices.Sort(lat)
		fmt.Printf(", registration latency p50 %v p99 %v", lat[len(lat)/2].Round(100*time.Nanosecond), lat[len(lat)*99/100].Round(100*time.Nanosecond))
	}
	fmt.Println()
	for _, ev := range enl {
		fmt.Printf("  enlargement  %s  %d → %d bytes  took %v  %s\n", conn.ConnName(ev.ConnID), ev.FromSize, ev.ToSize,
			ev.EnlargeDuration.Round(time.Microsecond), conn.EnlargeOutcome(ev.Outcome))
	}
	if serr == nil && (stats.Lost > 0 || stats.EntryDropped > 0) {
		fmt.Printf("  (%d events lost, %d entries dropped: the counts above are short by that much)\n", stats.Lost, stats.EntryDropped)
	}
	fmt.Println("  The same, live, for every process on the machine: sudo go run ./cmd/rdmatrace")
}
