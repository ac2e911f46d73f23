package bufpool

import (
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// BenchmarkGetRelease measures the steady-state path: a free-list hit.
func BenchmarkGetRelease(b *testing.B) {
	p, _ := newFakePool(b, Options{})
	w, _ := p.Get(1, 32<<10, rw)
	w.Release()
	b.ReportAllocs()
	for b.Loop() {
		buf, err := p.Get(1, 32<<10, rw)
		if err != nil {
			b.Fatal(err)
		}
		buf.Release()
	}
	if s := p.Stats(); s.Registrations != 1 {
		b.Fatalf("%d registrations in steady state", s.Registrations)
	}
	p.Close()
}

func BenchmarkGetReleaseParallel(b *testing.B) {
	p, _ := newFakePool(b, Options{})
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			buf, err := p.Get(1, 4096, rw)
			if err != nil {
				b.Error(err)
				return
			}
			buf.Release()
		}
	})
	p.Close()
}

// BenchmarkShmRegister is the cost the free lists avoid: a fresh
// AllocMemory + RegMR + Dereg + FreeMemory on the shm provider, with the
// RegMR share reported from Stats.RegNanos.
func BenchmarkShmRegister(b *testing.B) {
	prov, err := transport.Get("shm")
	if err != nil {
		b.Fatal(err)
	}
	d, err := prov.Open("")
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	pd, err := d.AllocPD()
	if err != nil {
		b.Fatal(err)
	}
	defer pd.Close()
	p, err := New(d, pd, Options{Budget: NewBudget(0), MaxFree: -1})
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		buf, err := p.Get(1, 32<<10, rw)
		if err != nil {
			b.Fatal(err)
		}
		buf.Release() // MaxFree < 0: deregistered and freed at once
	}
	s := p.Stats()
	b.ReportMetric(float64(s.RegNanos)/float64(s.Registrations), "ns/RegMR")
	p.Close()
}
