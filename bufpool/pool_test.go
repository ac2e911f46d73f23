package bufpool

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
)

const rw = transport.AccessLocalWrite | transport.AccessRemoteWrite

// backend is a device and PD to build pools on: the shm provider (real
// memfd memory and MR table) or the fake (countable, failable).
type backend struct {
	name string
	dev  transport.Device
	pd   transport.PD
	fake *fakeDevice // nil for shm
}

func backends(t *testing.T, f func(t *testing.T, b *backend)) {
	t.Run("fake", func(t *testing.T) {
		d := newFakeDevice()
		pd, _ := d.AllocPD()
		f(t, &backend{name: "fake", dev: d, pd: pd, fake: d})
	})
	t.Run("shm", func(t *testing.T) {
		p, err := transport.Get("shm")
		if err != nil {
			t.Fatal(err)
		}
		d, err := p.Open("")
		if err != nil {
			t.Fatal(err)
		}
		pd, err := d.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			// shm refuses to close a PD with registrations left: this
			// is the provider's own check that nothing leaked.
			if err := pd.Close(); err != nil {
				t.Errorf("PD close after the test: %v", err)
			}
			d.Close()
		})
		f(t, &backend{name: "shm", dev: d, pd: pd})
	})
}

func (b *backend) pool(t *testing.T, opts Options) *Pool {
	t.Helper()
	if opts.Budget == nil {
		opts.Budget = NewBudget(0)
	}
	p, err := New(b.dev, b.pd, opts)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// checkEmpty asserts a closed pool holds nothing, and (fake) that the
// device agrees: no registration and no allocation left.
func (b *backend) checkEmpty(t *testing.T, p *Pool) {
	t.Helper()
	s := p.Stats()
	if s.RegisteredBytes != 0 || s.FreeBuffers != 0 || s.FreeBytes != 0 || s.InUseBuffers != 0 || s.InUseBytes != 0 {
		t.Errorf("pool not empty: %+v", s)
	}
	if s.Registrations != s.Deregistrations {
		t.Errorf("%d registrations but %d deregistrations", s.Registrations, s.Deregistrations)
	}
	if u := p.Budget().Used(); u != 0 {
		t.Errorf("budget still charged %d bytes", u)
	}
	if b.fake != nil {
		if n := b.fake.liveRegs(); n != 0 {
			t.Errorf("device has %d registrations left", n)
		}
		if n := b.fake.liveAllocs(); n != 0 {
			t.Errorf("device has %d allocations left", n)
		}
	}
}

func TestClasses(t *testing.T) {
	p, _ := newFakePool(t, Options{MinSize: 4096, MaxSize: 1 << 20})
	for _, c := range []struct{ size, class int }{
		{1, 4096}, {4096, 4096}, {4097, 8192}, {100000, 131072}, {1 << 20, 1 << 20},
	} {
		got, err := p.ClassSize(c.size)
		if err != nil || got != c.class {
			t.Errorf("ClassSize(%d) = %d, %v; want %d", c.size, got, err, c.class)
		}
	}
	for _, bad := range []int{0, -1, 1<<20 + 1} {
		if _, err := p.Get(1, bad, rw); !errors.Is(err, ErrSize) {
			t.Errorf("Get(%d) = %v, want ErrSize", bad, err)
		}
	}
	if got := len(p.Classes()); got != 9 {
		t.Errorf("%d classes from 4 KiB to 1 MiB, want 9", got)
	}
	for _, o := range []Options{{MinSize: 3000}, {MinSize: 8192, MaxSize: 4096}, {MaxSize: 1 << 31}} {
		if _, err := New(newFakeDevice(), &fakePD{}, o); err == nil {
			t.Errorf("New(%+v) accepted bad options", o)
		}
	}
}

func TestBufferIsRegistered(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{})
		b, err := p.Get(7, 5000, rw)
		if err != nil {
			t.Fatal(err)
		}
		if b.Len() != 8192 || len(b.Bytes()) != 8192 || b.Owner() != 7 || b.Access() != rw {
			t.Fatalf("buffer len %d/%d owner %d access %v", b.Len(), len(b.Bytes()), b.Owner(), b.Access())
		}
		mr := b.MR()
		if mr.Len() != 8192 || mr.Addr() != b.Addr() || mr.LKey() != b.LKey() || mr.RKey() != b.RKey() || mr.Access() != rw {
			t.Fatalf("MR %d bytes at %#x keys %#x/%#x does not match the buffer", mr.Len(), mr.Addr(), mr.LKey(), mr.RKey())
		}
		// The memory is the registered memory, writable end to end.
		buf := b.Bytes()
		buf[0], buf[len(buf)-1] = 1, 2
		if mb := mr.Bytes(); mb[0] != 1 || mb[len(mb)-1] != 2 {
			t.Fatal("Bytes is not the registered memory")
		}
		b.Release()
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		be.checkEmpty(t, p)
	})
}

// TestSteadyStateNoRegistrations is the point of the package: once warm,
// connections coming and going across owners and classes cost no RegMR.
func TestSteadyStateNoRegistrations(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{})
		sizes := []int{1000, 4096, 20000, 64 << 10}
		const owners, window = 8, 16
		var held []*Buffer
		step := func(i int) {
			b, err := p.Get(Owner(1+i%owners), sizes[(i/owners)%len(sizes)], rw)
			if err != nil {
				t.Fatal(err)
			}
			b.Bytes()[0] = byte(i)
			held = append(held, b)
			if len(held) > window {
				held[0].Release()
				held = held[1:]
			}
		}
		const warm, steady = 1000, 10000
		for i := range warm {
			step(i)
		}
		before := p.Stats()
		for i := warm; i < warm+steady; i++ {
			step(i)
		}
		after := p.Stats()
		if after.Registrations != before.Registrations {
			t.Errorf("steady state made %d new registrations (before %+v, after %+v)", after.Registrations-before.Registrations, before, after)
		}
		if got := after.Reuses - before.Reuses; got != steady {
			t.Errorf("%d of %d steady-state Gets served from free lists", got, steady)
		}
		if after.Deregistrations != before.Deregistrations {
			t.Errorf("steady state deregistered %d buffers", after.Deregistrations-before.Deregistrations)
		}
		t.Logf("%s: %d registrations in total for %d Gets, %v per RegMR", be.name, after.Registrations, warm+steady,
			float64(after.RegNanos)/float64(max(after.Registrations, 1)))
		for _, b := range held {
			b.Release()
		}
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		be.checkEmpty(t, p)
	})
}

// TestSteadyStateConcurrent: G goroutines each holding at most one buffer
// per class never need more than the G per class registered at warm-up.
func TestSteadyStateConcurrent(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{})
		sizes := []int{4096, 16384, 65536}
		const G, iters = 4, 2500
		var warm sync.WaitGroup
		start := make(chan struct{})
		for g := range G {
			warm.Go(func() {
				var bs []*Buffer
				for _, s := range sizes {
					b, err := p.Get(Owner(g), s, rw)
					if err != nil {
						t.Error(err)
						return
					}
					bs = append(bs, b)
				}
				<-start // all G hold one of each class at once
				for _, b := range bs {
					b.Release()
				}
			})
		}
		for p.Stats().InUseBuffers < G*len(sizes) && !t.Failed() {
			runtime.Gosched() // until every goroutine holds its set
		}
		close(start)
		warm.Wait()
		before := p.Stats()
		var wg sync.WaitGroup
		for g := range G {
			wg.Go(func() {
				for i := range iters {
					b, err := p.Get(Owner(100+g), sizes[(i+g)%len(sizes)], rw)
					if err != nil {
						t.Error(err)
						return
					}
					b.Release()
				}
			})
		}
		wg.Wait()
		after := p.Stats()
		if after.Registrations != before.Registrations {
			t.Errorf("%d new registrations in steady state", after.Registrations-before.Registrations)
		}
		if after.Reuses-before.Reuses != G*iters {
			t.Errorf("%d reuses, want %d", after.Reuses-before.Reuses, G*iters)
		}
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		be.checkEmpty(t, p)
	})
}

// TestOwnerAccountingConcurrent checks the per-owner figures are exact
// while many owners allocate and release at once.
func TestOwnerAccountingConcurrent(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{MaxSize: 1 << 18})
		const G, iters = 6, 400
		var wg sync.WaitGroup
		var mu sync.Mutex
		final := map[Owner]OwnerStats{}
		var kept []*Buffer
		for g := range G {
			wg.Go(func() {
				owner := Owner(g + 1)
				rng := rand.New(rand.NewPCG(uint64(g), 1))
				var held []*Buffer
				var want OwnerStats
				for range iters {
					if len(held) > 0 && rng.IntN(3) == 0 {
						i := rng.IntN(len(held))
						want.Buffers--
						want.Bytes -= int64(held[i].Len())
						if rng.IntN(4) == 0 {
							if err := held[i].Discard(); err != nil {
								t.Error(err)
							}
						} else {
							held[i].Release()
						}
						held = append(held[:i], held[i+1:]...)
					} else {
						b, err := p.Get(owner, 1+rng.IntN(1<<18), rw)
						if err != nil {
							t.Error(err)
							return
						}
						held = append(held, b)
						want.Buffers++
						want.Bytes += int64(b.Len())
					}
					// Only this goroutine touches owner: exact at every step.
					if got := p.OwnerStats(owner); got != want {
						t.Errorf("owner %d: %+v, want %+v", owner, got, want)
						return
					}
				}
				// Half the owners keep their buffers across Close.
				if g%2 == 0 {
					for _, b := range held {
						b.Release()
					}
					want, held = OwnerStats{}, nil
				}
				mu.Lock()
				final[owner] = want
				kept = append(kept, held...)
				mu.Unlock()
			})
		}
		wg.Wait()
		var bufs int
		var bytes int64
		for o, w := range final {
			if got := p.OwnerStats(o); got != w {
				t.Errorf("owner %d at the end: %+v, want %+v", o, got, w)
			}
			bufs += w.Buffers
			bytes += w.Bytes
		}
		s := p.Stats()
		if s.InUseBuffers != bufs || s.InUseBytes != bytes {
			t.Errorf("in use %d buffers / %d bytes, owners hold %d / %d", s.InUseBuffers, s.InUseBytes, bufs, bytes)
		}
		if s.RegisteredBytes != s.InUseBytes+s.FreeBytes || s.RegisteredBytes != p.Budget().Used() {
			t.Errorf("registered %d != in use %d + free %d (budget %d)", s.RegisteredBytes, s.InUseBytes, s.FreeBytes, p.Budget().Used())
		}
		err := p.Close()
		if bufs > 0 && (err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d buffers (%d bytes) still held", bufs, bytes))) {
			t.Errorf("Close with %d buffers out: %v", bufs, err)
		}
		for _, b := range kept {
			b.Release()
		}
		be.checkEmpty(t, p)
	})
}

func TestBudgetExceeded(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		budget := NewBudget(64 << 10)
		p := be.pool(t, Options{Budget: budget})
		a, err := p.Get(1, 32<<10, rw)
		if err != nil {
			t.Fatal(err)
		}
		b, err := p.Get(2, 20000, rw)
		if err != nil {
			t.Fatal(err)
		}
		before := p.Stats()
		_, err = p.Get(3, 100, rw)
		if !errors.Is(err, ErrBudget) {
			t.Fatalf("Get over budget: %v, want ErrBudget", err)
		}
		if !strings.Contains(err.Error(), "need 4096, used 65536 of 65536") {
			t.Errorf("budget error lacks the figures: %v", err)
		}
		after := p.Stats()
		if after != before || budget.Used() != 64<<10 || p.OwnerStats(3) != (OwnerStats{}) {
			t.Errorf("a refused Get changed state: before %+v after %+v budget %d", before, after, budget.Used())
		}
		if be.fake != nil && (be.fake.liveAllocs() != 2 || be.fake.liveRegs() != 2) {
			t.Errorf("refused Get leaked: %d allocations, %d registrations", be.fake.liveAllocs(), be.fake.liveRegs())
		}
		// Free buffers are charged too; a Get that does not fit trims them.
		a.Release()
		c, err := p.Get(3, 100, rw)
		if err != nil {
			t.Fatalf("Get after releasing 32 KiB: %v", err)
		}
		if s := p.Stats(); s.BudgetTrims != 1 || s.FreeBuffers != 0 || s.RegisteredBytes != 32<<10+4096 || budget.Used() != s.RegisteredBytes {
			t.Errorf("after trim: %+v, budget %d", s, budget.Used())
		}
		b.Release()
		c.Release()
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		be.checkEmpty(t, p)
	})
}

// TestBudgetSharedByPools: two pools on one budget see each other's bytes.
func TestBudgetSharedByPools(t *testing.T) {
	budget := NewBudget(16 << 10)
	p1, _ := newFakePool(t, Options{Budget: budget})
	p2, _ := newFakePool(t, Options{Budget: budget})
	b1, err := p1.Get(1, 8192, rw)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := p2.Get(1, 8192, rw)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p2.Get(1, 1, rw); !errors.Is(err, ErrBudget) {
		t.Fatalf("third Get on a full shared budget: %v", err)
	}
	b1.Release()
	b2.Release()
	if err := errors.Join(p1.Close(), p2.Close()); err != nil {
		t.Fatal(err)
	}
	if budget.Used() != 0 {
		t.Fatalf("budget used %d after both pools closed", budget.Used())
	}
}

// TestBudgetReclaimsIdlePools: free buffers cached by one pool are given
// back when another pool of the budget needs the room; held ones never.
func TestBudgetReclaimsIdlePools(t *testing.T) {
	budget := NewBudget(32 << 10)
	idle, _ := newFakePool(t, Options{Budget: budget})
	busy, _ := newFakePool(t, Options{Budget: budget})
	held, err := idle.Get(1, 8192, rw)
	if err != nil {
		t.Fatal(err)
	}
	cached, err := idle.Get(1, 16384, rw)
	if err != nil {
		t.Fatal(err)
	}
	cached.Release() // 16 KiB registered, free, in idle's cache
	b, err := busy.Get(2, 16384, rw)
	if err != nil {
		t.Fatalf("Get while another pool caches the room: %v", err)
	}
	if s := idle.Stats(); s.FreeBuffers != 0 || s.BudgetTrims != 1 || s.InUseBytes != 8192 {
		t.Errorf("idle pool after the reclaim: %+v", s)
	}
	if s := busy.Stats(); s.Reclaims != 1 {
		t.Errorf("busy pool: %d reclaims, want 1", s.Reclaims)
	}
	// Nothing free is left anywhere: a held buffer is never taken.
	if _, err := busy.Get(2, 16384, rw); !errors.Is(err, ErrBudget) {
		t.Fatalf("Get with only held buffers in the budget: %v, want ErrBudget", err)
	}
	if !bytesAre(held, 0) {
		t.Error("the held buffer changed")
	}
	held.Release()
	b.Release()
	if err := errors.Join(idle.Close(), busy.Close()); err != nil {
		t.Fatal(err)
	}
	if budget.Used() != 0 {
		t.Fatalf("budget used %d after both pools closed", budget.Used())
	}
}

func bytesAre(b *Buffer, v byte) bool {
	for _, x := range b.Bytes() {
		if x != v {
			return false
		}
	}
	return true
}

func TestRegistrationFailureLeaksNothing(t *testing.T) {
	p, d := newFakePool(t, Options{Budget: NewBudget(1 << 20)})
	d.failReg = fmt.Errorf("fake: %w", errors.ErrUnsupported)
	if _, err := p.Get(1, 4096, rw); !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("Get with failing RegMR: %v", err)
	}
	if s := p.Stats(); s.Registrations != 0 || s.RegisteredBytes != 0 || p.Budget().Used() != 0 || d.liveAllocs() != 0 {
		t.Fatalf("failed registration leaked: %+v, budget %d, %d allocations", s, p.Budget().Used(), d.liveAllocs())
	}
}

func TestDiscard(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{})
		b, err := p.Get(4, 10000, rw)
		if err != nil {
			t.Fatal(err)
		}
		keep, err := p.Get(4, 100, rw)
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Discard(); err != nil {
			t.Fatal(err)
		}
		s := p.Stats()
		if s.Deregistrations != 1 || s.RegisteredBytes != 4096 || s.FreeBuffers != 0 || p.Budget().Used() != 4096 {
			t.Errorf("after Discard: %+v, budget %d", s, p.Budget().Used())
		}
		if got := p.OwnerStats(4); got != (OwnerStats{Buffers: 1, Bytes: 4096}) {
			t.Errorf("owner after Discard: %+v", got)
		}
		if be.fake != nil && be.fake.liveAllocs() != 1 {
			t.Errorf("Discard did not free the memory: %d allocations live", be.fake.liveAllocs())
		}
		// The discarded class is registered anew: nothing was kept.
		again, err := p.Get(5, 10000, rw)
		if err != nil {
			t.Fatal(err)
		}
		if s := p.Stats(); s.Reuses != 0 || s.Registrations != 3 {
			t.Errorf("Get after Discard: %+v", s)
		}
		if err := b.Discard(); err == nil {
			t.Error("second Discard returned nil")
		}
		b.Release()
		if got := p.Stats().DoubleReleases; got != 2 {
			t.Errorf("DoubleReleases = %d, want 2", got)
		}
		again.Release()
		keep.Release()
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		be.checkEmpty(t, p)
	})
}

func TestDoubleReleaseDoesNotTouchNextOwner(t *testing.T) {
	p, _ := newFakePool(t, Options{})
	a, _ := p.Get(1, 4096, rw)
	a.Release()
	b, _ := p.Get(2, 4096, rw) // reuses a's memory
	if b.Addr() != a.Addr() {
		t.Fatal("expected reuse of the same region")
	}
	a.Release() // stale handle: must not give b's memory back
	if s := p.Stats(); s.DoubleReleases != 1 || s.InUseBuffers != 1 || p.OwnerStats(2).Buffers != 1 {
		t.Fatalf("stale Release affected the next owner: %+v", s)
	}
	b.Release()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestMaxFree(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{MaxFree: 2})
		var bs []*Buffer
		for range 5 {
			b, err := p.Get(1, 4096, rw)
			if err != nil {
				t.Fatal(err)
			}
			bs = append(bs, b)
		}
		for _, b := range bs {
			b.Release()
		}
		if s := p.Stats(); s.FreeBuffers != 2 || s.Deregistrations != 3 || s.RegisteredBytes != 2*4096 {
			t.Errorf("MaxFree 2 after releasing 5: %+v", s)
		}
		// Access is part of the free list: a remote-read buffer is not
		// handed to a Get asking for remote write.
		r, err := p.Get(1, 4096, transport.AccessLocalWrite|transport.AccessRemoteRead)
		if err != nil {
			t.Fatal(err)
		}
		if s := p.Stats(); s.Reuses != 0 || r.Access() != transport.AccessLocalWrite|transport.AccessRemoteRead {
			t.Errorf("Get with other access reused a buffer: %+v", s)
		}
		r.Release()
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		be.checkEmpty(t, p)
	})
}

func TestCloseWithBuffersOut(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{})
		a, _ := p.Get(1, 4096, rw)
		b, _ := p.Get(2, 8192, rw)
		c, _ := p.Get(2, 4096, rw)
		free, _ := p.Get(3, 4096, rw)
		free.Release()
		err := p.Close()
		if err == nil || !strings.Contains(err.Error(), "3 buffers (16384 bytes) still held by owners [1 2]") {
			t.Fatalf("Close with buffers out: %v", err)
		}
		// Registrations are revoked at once, the memory stays mapped for
		// the holders until they release it.
		s := p.Stats()
		if s.RegisteredBytes != 0 || p.Budget().Used() != 0 || s.InUseBuffers != 3 || s.FreeBuffers != 0 {
			t.Errorf("after Close with buffers out: %+v, budget %d", s, p.Budget().Used())
		}
		b.Bytes()[100] = 1 // still mapped
		if be.fake != nil && be.fake.liveRegs() != 0 {
			t.Errorf("%d registrations survive Close", be.fake.liveRegs())
		}
		if _, err := p.Get(1, 1, rw); !errors.Is(err, ErrClosed) || !errors.Is(err, net.ErrClosed) {
			t.Errorf("Get after Close: %v", err)
		}
		a.Release()
		if err := b.Discard(); err != nil {
			t.Error(err)
		}
		c.Release()
		if err := p.Close(); err != nil {
			t.Errorf("second Close after everything came back: %v", err)
		}
		be.checkEmpty(t, p)
	})
}

func TestCloseReleasesEverything(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{})
		var bs []*Buffer
		for i := range 40 {
			b, err := p.Get(Owner(i%5), 1<<(10+i%8), rw)
			if err != nil {
				t.Fatal(err)
			}
			bs = append(bs, b)
		}
		for _, b := range bs {
			b.Release()
		}
		if s := p.Stats(); s.FreeBuffers != 40 || s.RegisteredBytes == 0 {
			t.Fatalf("before Close: %+v", s)
		}
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		be.checkEmpty(t, p)
	})
}

// TestGetRacesClose: registrations in flight when Close runs are undone,
// never leaked.
func TestGetRacesClose(t *testing.T) {
	backends(t, func(t *testing.T, be *backend) {
		p := be.pool(t, Options{})
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				for i := 0; ; i++ {
					b, err := p.Get(Owner(g), 4096<<(i%3), rw)
					if err != nil {
						if !errors.Is(err, ErrClosed) {
							t.Error(err)
						}
						return
					}
					b.Release()
				}
			})
		}
		for p.Stats().Registrations < 8 {
			runtime.Gosched()
		}
		cerr := p.Close()
		wg.Wait()
		if cerr != nil && !strings.Contains(cerr.Error(), "still held") {
			t.Errorf("Close: %v", cerr)
		}
		be.checkEmpty(t, p)
	})
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{
		"0": 0, "4096": 4096, "64k": 64 << 10, "64K": 64 << 10, "16m": 16 << 20, "2g": 2 << 30,
		"1GiB": 1 << 30, "512MB": 512 << 20, " 8k ": 8 << 10,
	} {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "k", "-1", "1t", "ten", "99999999999g"} {
		if _, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q) accepted", bad)
		}
	}
	if d := Default(); d == nil || d != Default() {
		t.Error("Default is not one process-wide budget")
	}
}
