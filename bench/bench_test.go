package bench

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	testgrpc "google.golang.org/grpc/interop/grpc_testing"
)

func TestMain(m *testing.M) {
	ServeIdleIfChild()
	os.Exit(m.Run())
}

// The harness end to end with tiny sizes and times: every row of every
// table is there and holds a measured figure.
func TestSmoke(t *testing.T) {
	cfg := Config{
		BenchTime:   2 * time.Millisecond,
		Rounds:      2,
		Sizes:       []int{64, 4 << 10},
		Concurrency: []int{1, 4},
		QPSSize:     64,
		StreamSize:  64 << 10,
		StreamSizes: []int{64 << 10},
		RawSizes:    []int{256 << 10},
		Idle:        []int{3},
		Fleet:       4,
		FleetShrink: 50 * time.Millisecond,
		Enlarge:     2,
		OneProcess:  true,
	}
	rep, err := Run(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	rep.Markdown(&out)
	md := out.String()
	t.Log("\n" + md)

	rows := map[string]int{ // row of the first (two-process) table: measured cells
		"unary 64 B p50": 3, "unary 64 B p99": 3, "unary 4 KiB p50": 3, "unary 4 KiB p99": 3,
		"QPS c=1": 4, "QPS c=4": 4, "CPU/RPC c=1": 4, "CPU/RPC c=4": 4, "stream 64 KiB": 4,
		"CPU/RPC c=1, server": 3, "client stream 64 KiB": 4, "duplex echo 64 KiB": 4,
		"256 KiB":                         5,
		"enlargement, first 32 KiB write": 1, "registrations in steady state": 1,
	}
	for row, cells := range rows {
		line := find(md, "| "+row)
		if line == "" {
			t.Errorf("no row %q", row)
			continue
		}
		f := strings.Split(line, "|")
		for i := 2; i < 2+cells; i++ {
			if v := strings.TrimSpace(f[i]); v == "" || v == "—" || strings.HasPrefix(v, "0 ") || v == "0.0 µs" {
				t.Errorf("row %q: cell %d is %q", row, i-1, v)
			}
		}
	}
	if rep.Steady.Err != nil || rep.Steady.Registrations != 0 {
		t.Errorf("steady state: %+v", rep.Steady)
	}
	if len(rep.Idle) != 4 {
		t.Errorf("%d idle results, want raw and gRPC for TCP and rdmagrpc", len(rep.Idle))
	}
	for _, i := range rep.Idle {
		if i.Err != nil || i.Held != 3 {
			t.Errorf("idle %s: %d held: %v", i.Transport, i.Held, i.Err)
		}
		if want := map[bool]int{false: cfg.Rounds - 1, true: 0}[i.GRPC]; len(i.SetupMore) != want {
			t.Errorf("idle %s (gRPC %v): %d more set-up loops, want %d", i.Transport, i.GRPC, len(i.SetupMore), want)
		}
		kind := "raw"
		if i.GRPC {
			kind = "gRPC"
		}
		if line := find(md, "| 3 | "+kind+" | "+strings.Replace(i.Transport, RDMA, "rdmagrpc (", 1)); line == "" {
			t.Errorf("no idle row for %s %s", kind, i.Transport)
		} else if !strings.Contains(line, " / ") {
			t.Errorf("idle row without goroutines per connection: %s", line)
		}
	}
	// The fleet: with idle shrink, back to the small phase on both
	// sides; without, still large.
	if len(rep.Fleet) != 2 {
		t.Fatalf("%d fleet runs, want 2", len(rep.Fleet))
	}
	const small = 2 * 1024 * 4
	on, off := rep.Fleet[0], rep.Fleet[1]
	// (Its peak may fall between samples: four connections, each large
	// for about the idle shrink, sampled every 100 ms.)
	if on.Err != nil || on.BackToSmall == 0 || on.EndClient != small || on.EndServer != small {
		t.Errorf("fleet with idle shrink: %+v", on)
	}
	// The receiving side holds the large ring (the sender's staging is
	// nothing where the provider sends inline, shm).
	if off.Err != nil || off.EndServer <= small {
		t.Errorf("fleet without idle shrink: end %v / %v, %v", off.EndClient, off.EndServer, off.Err)
	}
	if find(md, "| idle shrink 50ms |") == "" || find(md, "| idle shrink off |") == "" {
		t.Errorf("no fleet rows")
	}
	for _, g := range []string{"unary 64 B p50 ≤ 0.8× TCP", "CPU per RPC, client + server, ≤ TCP", "0 registrations in steady state", "3 idle connections held"} {
		if find(md, "| "+g) == "" {
			t.Errorf("no goal %q", g)
		}
	}
}

func find(md, prefix string) string {
	for line := range strings.Lines(md) {
		if strings.HasPrefix(line, prefix) {
			return line
		}
	}
	return ""
}

// Unary calls one at a time, for profiles:
//
//	go test -run '^$' -bench 'Unary/rdmagrpc/64B' -cpuprofile cpu.out ./bench/
func BenchmarkUnary(b *testing.B) {
	ctx := context.Background()
	for _, t := range transports(b.TempDir()) {
		for _, size := range []int{64, 64 << 10} {
			b.Run(t.name+"/"+strings.ReplaceAll(sizeName(size), " ", ""), func(b *testing.B) {
				r, err := newRig(ctx, t)
				if err != nil {
					b.Fatal(err)
				}
				defer r.close()
				if err := r.unary(ctx, size); err != nil {
					b.Fatal(err)
				}
				b.SetBytes(int64(2 * size))
				for b.Loop() {
					if err := r.unary(ctx, size); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// Server streaming of 1 MiB messages, one message per iteration:
//
//	go test -run '^$' -bench 'Stream/rdmagrpc' -cpuprofile cpu.out ./bench/
func BenchmarkStream(b *testing.B) {
	const size = 1 << 20
	for _, t := range transports(b.TempDir()) {
		b.Run(t.name, func(b *testing.B) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			r, err := newRig(ctx, t)
			if err != nil {
				b.Fatal(err)
			}
			defer r.close()
			s, err := r.tc.StreamingFromServer(ctx, &testgrpc.SimpleRequest{ResponseSize: size})
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(size)
			for b.Loop() {
				if _, err := s.Recv(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func TestSetupMedian(t *testing.T) {
	for _, tc := range []struct {
		first time.Duration
		more  []time.Duration
		want  time.Duration
	}{
		{5, nil, 5},
		{5, []time.Duration{1, 9}, 5},
		{9, []time.Duration{1, 2}, 2},
		{1, []time.Duration{7, 8, 9, 2}, 7},
	} {
		r := IdleResult{Setup: tc.first, SetupMore: tc.more}
		if got := r.SetupMedian(); got != tc.want {
			t.Errorf("median of %v and %v: %v, want %v", tc.first, tc.more, got, tc.want)
		}
	}
}
