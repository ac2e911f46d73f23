package conn

import (
	"io"
	"testing"
	"time"
)

// Registered memory an idle connection holds, per side (M1). The goal is
// ≤ 8 KiB; the patent reports 16 KB, rsockets registers 256 KiB.
func BenchmarkIdleConnRegistered(b *testing.B) {
	var bytes int64
	for b.Loop() {
		a, p, stop, err := pipe(b)
		if err != nil {
			b.Fatal(err)
		}
		bytes = a.(*Conn).Stats().RegisteredBytes + p.(*Conn).Stats().RegisteredBytes
		stop()
	}
	b.ReportMetric(float64(bytes)/2, "regbytes/side")
}

// From the first write above the threshold to usable large buffers:
// request, provisioning and registration at the peer, ack, our staging.
func BenchmarkEnlargement(b *testing.B) {
	var total time.Duration
	msg := make([]byte, 40<<10)
	for b.Loop() {
		a, p, stop, err := pipe(b)
		if err != nil {
			b.Fatal(err)
		}
		go io.CopyN(io.Discard, p, int64(len(msg)))
		if _, err := a.Write(msg); err != nil {
			b.Fatal(err)
		}
		s := a.(*Conn).Stats()
		if s.Enlargements != 1 {
			b.Fatalf("not enlarged: %+v", s)
		}
		total += s.LastEnlargeDuration
		stop()
	}
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "ns/enlargement")
}

// A 64-byte ping-pong over the small buffers.
func BenchmarkSmallRoundTrip(b *testing.B) {
	a, p, stop, err := pipe(b)
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	go func() {
		buf := make([]byte, 64)
		for {
			if _, err := io.ReadFull(p, buf); err != nil {
				return
			}
			if _, err := p.Write(buf); err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 64)
	for b.Loop() {
		if _, err := a.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(a, buf); err != nil {
			b.Fatal(err)
		}
	}
}
