package bench

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// enlargements opens k fresh rdmagrpc connections and, on each, writes
// one 32 KiB buffer (grpc-go's write size, above the small slots), and
// returns the sorted Stats().LastEnlargeDuration of each: from the first
// large write to usable large buffers.
func enlargements(ctx context.Context, t network, k int) ([]time.Duration, error) {
	msg := make([]byte, 32<<10)
	var out []time.Duration
	for range k {
		w, r, err := pipe(ctx, t)
		if err != nil {
			return nil, fmt.Errorf("enlargement: %w", err)
		}
		done := make(chan error, 1)
		go func() { _, err := io.CopyN(io.Discard, r, int64(len(msg))); done <- err }()
		_, werr := w.Write(msg)
		rerr := <-done
		s := w.(*conn.Conn).Stats()
		w.Close()
		r.Close()
		switch {
		case werr != nil:
			return nil, fmt.Errorf("enlargement: write: %w", werr)
		case rerr != nil:
			return nil, fmt.Errorf("enlargement: read: %w", rerr)
		case s.Enlargements != 1:
			return nil, fmt.Errorf("enlargement: not enlarged: outcome %q", s.LastEnlargeOutcome)
		}
		out = append(out, s.LastEnlargeDuration)
	}
	slices.Sort(out)
	return out, nil
}

// counters holds, for each inner provider wrapped to count registrations
// (by inner name), the sizes of the registrations counted, in order.
var counters struct {
	sync.Mutex
	sizes map[string][]int
}

// regCount is how many registrations of inner were counted so far.
func regCount(inner string) int {
	counters.Lock()
	defer counters.Unlock()
	return len(counters.sizes[inner])
}

// regSizes returns the sizes of inner's counted registrations from the
// from-th on.
func regSizes(inner string, from int) []int {
	counters.Lock()
	defer counters.Unlock()
	l := counters.sizes[inner]
	return slices.Clone(l[min(from, len(l)):])
}

// counting returns an rdmagrpc transport whose provider is inner wrapped
// by transport/fault with one rule that only counts PD.RegMR calls.
func counting(inner string, opts ...conn.Option) (network, error) {
	counters.Lock()
	defer counters.Unlock()
	name := "bench-count-" + inner
	if _, ok := counters.sizes[inner]; !ok {
		p, err := transport.Get(inner)
		if err != nil {
			return network{}, err
		}
		inj := fault.Wrap(p, name)
		if _, err = inj.Add(fault.Rule{Name: "registrations", Op: fault.OpRegMR, Action: fault.ActCount,
			Match: func(ev *fault.Event) bool {
				counters.Lock()
				counters.sizes[inner] = append(counters.sizes[inner], ev.Len)
				counters.Unlock()
				return true
			}}); err != nil {
			return network{}, err
		}
		transport.Register(inj)
		if counters.sizes == nil {
			counters.sizes = map[string][]int{}
		}
		counters.sizes[inner] = []int{}
	}
	return rdma(append(slices.Clip(opts), conn.WithProvider(name))...), nil
}

// SteadyResult: registrations made while traffic of every kind measured
// here repeats over connections that have already carried it once.
type SteadyResult struct {
	Registrations uint64 // during the steady phase: the goal is 0
	Sizes         []int  // of those registrations, in order
	Warmup        uint64 // during set-up and the first pass
	RPCs, Streams int
	RawBytes      int64
	Err           error
}

// steady runs, over one grpc-go connection and one raw connection with
// rendezvous, a first pass of unary calls of every size, a 1 MiB stream
// and 1 MiB and 16 MiB raw writes, then the same again d at a time, and
// counts registrations in the second phase.
func steady(ctx context.Context, inner string, cfg *Config, d time.Duration) SteadyResult {
	var res SteadyResult
	t, err := counting(inner, cfg.ConnOptions...)
	if err != nil {
		res.Err = err
		return res
	}
	before := regCount(inner)
	r, err := newRig(ctx, t)
	if err != nil {
		res.Err = err
		return res
	}
	defer r.close()
	w, rd, err := pipe(ctx, t)
	if err != nil {
		res.Err = err
		return res
	}
	defer w.Close()
	defer rd.Close()
	go io.Copy(io.Discard, rd)
	// The first pass runs everything three times: pipelined rendezvous
	// transfers hold up to two sources at once, and the pool settles at
	// what the traffic needs.
	pass := func(d time.Duration, times int) error {
		for i, start := 0, time.Now(); ; i++ {
			for _, size := range cfg.Sizes {
				if err := r.unary(ctx, size); err != nil {
					return err
				}
				res.RPCs++
			}
			if _, err := r.stream(ctx, cfg.StreamSize, 0); err != nil {
				return err
			}
			res.Streams++
			for _, size := range cfg.RawSizes {
				if _, err := w.Write(body(size)); err != nil {
					return fmt.Errorf("raw write: %w", err)
				}
				res.RawBytes += int64(size)
			}
			if i+1 >= times && time.Since(start) >= d {
				return nil
			}
		}
	}
	if err := pass(0, 3); err != nil {
		res.Err = err
		return res
	}
	warm := regCount(inner)
	res.Warmup = uint64(warm - before)
	res.RPCs, res.Streams, res.RawBytes = 0, 0, 0
	if err := pass(d, 1); err != nil {
		res.Err = err
		return res
	}
	res.Sizes = regSizes(inner, warm)
	res.Registrations = uint64(len(res.Sizes))
	return res
}
