package bufpool

import (
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

var (
	// ErrSize is returned (wrapped) for a Get outside the pool's classes.
	ErrSize = errors.New("bufpool: size out of range")
	// ErrClosed is returned by Get after Close; it wraps net.ErrClosed.
	ErrClosed = fmt.Errorf("bufpool: pool closed: %w", net.ErrClosed)
)

// Defaults of Options.
const (
	DefaultMinSize = 4096
	DefaultMaxSize = 64 << 20
	DefaultMaxFree = 64
)

// Options configure a Pool. Zero values select the defaults.
type Options struct {
	// Budget is charged for every registered byte; nil means Default().
	Budget *Budget
	// MinSize is the smallest class (a power of two), default 4096 (a
	// page: registration pins whole pages anyway).
	MinSize int
	// MaxSize is the largest class (a power of two), default 64 MiB.
	MaxSize int
	// MaxFree is how many free buffers one free list (class and access)
	// keeps registered before deregistering the extras; default 64,
	// negative keeps none.
	MaxFree int
	// OnRegister, when set, is called after every registration call
	// (RegMR) with the class size, the time the call took and its error:
	// Stats has only the sums, telemetry wants each one. It runs outside
	// the pool's lock and must not block.
	OnRegister func(size int, d time.Duration, err error)
}

// Owner identifies who holds a buffer, e.g. a connection id; 0 is the pool
// itself or nobody in particular.
type Owner uint64

// OwnerStats are the buffers an owner currently holds, exactly.
type OwnerStats struct {
	Buffers int
	Bytes   int64
}

// Stats are a pool's counters. Bytes are counted at class size, which is
// what RegMR was called with.
type Stats struct {
	Registrations, Deregistrations uint64 // cumulative RegMR / Dereg calls that succeeded
	RegisteredBytes                int64  // currently registered (in use + free lists)
	InUseBytes                     int64
	FreeBytes                      int64
	InUseBuffers, FreeBuffers      int
	Reuses                         uint64 // Gets served from a free list
	RegNanos                       uint64 // cumulative time spent in RegMR
	DoubleReleases                 uint64 // Release/Discard of a buffer already given back: a caller bug
	BudgetTrims                    uint64 // free buffers deregistered to make room under the budget
	Reclaims                       uint64 // Gets served after other pools of the budget gave back free buffers
	Overdrafts                     uint64 // GetOverdraft buffers charged beyond the budget's limit
	ReleaseErrors                  uint64 // deregistration or free failures on Release (see Close's error)
}

// region is one allocation with its registration. It outlives the Buffer
// handles that lend it out, so a stale handle can never reach the next
// owner's buffer.
type region struct {
	mem        []byte
	mr         transport.MR
	addr       uint64
	lkey, rkey uint32
	key        freeKey
	size       int
	registered bool // false once Close revoked it while it was held
	// heldAt is the region's place in its pool's held list, -1 when it is
	// not lent out; owner is who holds it. (Under the pool's mu.)
	heldAt int
	owner  Owner
	// dmu serializes deregistration: Close revoking a held region can
	// race with the holder's Release destroying it, and a second Dereg
	// of the same MR would fail and leak the memory.
	dmu sync.Mutex
}

type freeKey struct {
	class  int
	access transport.Access
}

// Pool hands out registered buffers of one PD. It is safe for concurrent use.
type Pool struct {
	dev      transport.Device
	pd       transport.PD
	budget   *Budget
	minSize  int
	minShift int
	maxSize  int
	maxFree  int
	onReg    atomic.Pointer[func(int, time.Duration, error)]

	regs, deregs, reuses, regNanos, doubles, trims, relErrs, reclaims, overdrafts atomic.Uint64

	// pending counts registrations running outside mu, so that Close can
	// wait for them instead of leaking what they register.
	pending sync.WaitGroup

	mu     sync.Mutex
	closed bool
	free   map[freeKey][]*region
	// held are the regions lent out. A list with each region's place in
	// it, not a map: a connection holds two or three regions, and a map
	// cost each idle connection end a few hundred bytes. A pool's holders
	// are few: OwnerStats counts by walking it.
	held       []*region
	registered int64
	inUseBytes int64
	freeBytes  int64
	freeBufs   int
	stuck      []*region // Dereg failed; Close tries again
	errs       []error   // failures on Release, reported by Close
}

// New returns a pool registering memory of dev in pd.
func New(dev transport.Device, pd transport.PD, opts Options) (*Pool, error) {
	if dev == nil || pd == nil {
		return nil, errors.New("bufpool: new pool: nil device or PD")
	}
	p := &Pool{
		dev:     dev,
		pd:      pd,
		budget:  opts.Budget,
		minSize: opts.MinSize,
		maxSize: opts.MaxSize,
		maxFree: opts.MaxFree,
	}
	p.SetOnRegister(opts.OnRegister)
	if p.budget == nil {
		p.budget = Default()
	}
	if p.minSize == 0 {
		p.minSize = DefaultMinSize
	}
	if p.maxSize == 0 {
		p.maxSize = max(DefaultMaxSize, p.minSize)
	}
	switch {
	case p.maxFree == 0:
		p.maxFree = DefaultMaxFree
	case p.maxFree < 0:
		p.maxFree = 0
	}
	if !isPow2(p.minSize) || !isPow2(p.maxSize) || p.minSize > p.maxSize {
		return nil, fmt.Errorf("bufpool: new pool: MinSize %d and MaxSize %d must be powers of two with MinSize <= MaxSize", p.minSize, p.maxSize)
	}
	if lim := dev.Attr().MaxMRSize; lim > 0 && uint64(p.maxSize) > lim {
		return nil, fmt.Errorf("bufpool: new pool: MaxSize %d exceeds the device's largest registration %d", p.maxSize, lim)
	}
	for 1<<p.minShift < p.minSize {
		p.minShift++
	}
	p.budget.join(p)
	return p, nil
}

// SetOnRegister replaces Options.OnRegister: for a pool that passes to
// another holder (conn hands a closed connection's pool to the next).
func (p *Pool) SetOnRegister(f func(size int, d time.Duration, err error)) {
	if f == nil {
		p.onReg.Store(nil)
		return
	}
	p.onReg.Store(&f)
}

// Device returns the device the pool allocates memory of.
func (p *Pool) Device() transport.Device { return p.dev }

// Budget returns the budget the pool charges.
func (p *Pool) Budget() *Budget { return p.budget }

// Get returns a buffer of at least size bytes (its class size) registered
// with access, held by owner until Release or Discard. A free buffer of the
// same class and access is reused when there is one; otherwise new memory
// is allocated and registered, charged to the budget first.
func (p *Pool) Get(owner Owner, size int, access transport.Access) (*Buffer, error) {
	return p.get(owner, size, access, false)
}

// GetOverdraft is Get for a buffer of at most the smallest class that,
// when the budget has no room even after trimming and reclaiming, is
// charged beyond the limit instead of refused. It is for the one buffer
// without which a holder of memory cannot progress (conn: the reader of
// a rendezvous transfer, whose peer releases its source only once it is
// read), so that a full budget slows a stream rather than deadlocks it.
// What it lets through is bounded by its callers: one smallest-class
// buffer each. Stats().Overdrafts counts them.
func (p *Pool) GetOverdraft(owner Owner, size int, access transport.Access) (*Buffer, error) {
	if size > p.minSize {
		return nil, fmt.Errorf("bufpool: overdraft of %d bytes: at most the smallest class, %d", size, p.minSize)
	}
	return p.get(owner, size, access, true)
}

func (p *Pool) get(owner Owner, size int, access transport.Access, overdraft bool) (*Buffer, error) {
	class, csize, err := p.classOf(size)
	if err != nil {
		return nil, err
	}
	key := freeKey{class: class, access: access}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	if l := p.free[key]; len(l) > 0 {
		r := l[len(l)-1]
		l[len(l)-1] = nil
		p.free[key] = l[:len(l)-1]
		p.freeBufs--
		p.freeBytes -= int64(r.size)
		p.reuses.Add(1)
		b := p.lendLocked(r, owner)
		p.mu.Unlock()
		return b, nil
	}
	p.pending.Add(1)
	p.mu.Unlock()
	defer p.pending.Done()

	r, err := p.register(key, csize)
	if errors.Is(err, ErrBudget) && p.trimFor(int64(csize)) {
		r, err = p.register(key, csize)
	}
	if errors.Is(err, ErrBudget) && p.budget.reclaim(int64(csize), p) {
		p.reclaims.Add(1)
		r, err = p.register(key, csize)
	}
	if errors.Is(err, ErrBudget) && overdraft {
		p.budget.force(int64(csize))
		if r, err = p.registerCharged(key, csize); err == nil {
			p.overdrafts.Add(1)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("bufpool: get %d bytes (class %d) for owner %d: %w", size, csize, owner, err)
	}
	p.mu.Lock()
	p.registered += int64(r.size)
	if p.closed {
		p.mu.Unlock()
		return nil, errors.Join(ErrClosed, p.destroy(r))
	}
	b := p.lendLocked(r, owner)
	p.mu.Unlock()
	return b, nil
}

// register charges the budget, allocates and registers one region.
func (p *Pool) register(key freeKey, size int) (*region, error) {
	if err := p.budget.reserve(int64(size)); err != nil {
		return nil, err
	}
	return p.registerCharged(key, size)
}

// registerCharged allocates and registers a region already charged to
// the budget; on failure it gives the charge back.
func (p *Pool) registerCharged(key freeKey, size int) (*region, error) {
	mem, err := p.dev.AllocMemory(size)
	if err != nil {
		p.budget.release(int64(size))
		return nil, fmt.Errorf("allocate: %w", err)
	}
	start := time.Now()
	mr, err := p.pd.RegMR(mem, key.access)
	d := time.Since(start)
	p.regNanos.Add(uint64(d))
	if f := p.onReg.Load(); f != nil {
		(*f)(size, d, err)
	}
	if err != nil {
		p.budget.release(int64(size))
		if ferr := p.dev.FreeMemory(mem); ferr != nil {
			err = errors.Join(err, fmt.Errorf("free after failed registration: %w", ferr))
		}
		return nil, fmt.Errorf("register: %w", err)
	}
	p.regs.Add(1)
	return &region{
		mem: mem[:size:size], mr: mr, addr: mr.Addr(), lkey: mr.LKey(), rkey: mr.RKey(),
		key: key, size: size, registered: true, heldAt: -1,
	}, nil
}

// Trim deregisters every free buffer of this pool, giving its memory back
// to the system and the budget: for an owner going idle, whose next
// transfers may be far off. It reports whether any was freed.
func (p *Pool) Trim() bool { return p.trimFor(math.MaxInt64) }

// trimFor deregisters free buffers of this pool, largest first, until need
// more bytes fit in the budget or none is left; it reports whether any was
// freed. Free buffers are charged to the shared budget, so without this a
// pool could refuse a Get while sitting on idle registered memory.
func (p *Pool) trimFor(need int64) bool {
	p.mu.Lock()
	keys := make([]freeKey, 0, len(p.free))
	for k, l := range p.free {
		if len(l) > 0 {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b freeKey) int { return b.class - a.class })
	var victims []*region
	room := p.budget.limit - p.budget.Used()
	for _, k := range keys {
		l := p.free[k]
		for len(l) > 0 && room < need {
			r := l[len(l)-1]
			l[len(l)-1] = nil
			l = l[:len(l)-1]
			p.freeBufs--
			p.freeBytes -= int64(r.size)
			room += int64(r.size)
			victims = append(victims, r)
		}
		p.free[k] = l
	}
	p.mu.Unlock()
	for _, r := range victims {
		p.trims.Add(1)
		if err := p.destroy(r); err != nil {
			p.noteErr(err)
		}
	}
	return len(victims) > 0
}

// lendLocked records r as held by owner and wraps it in a fresh handle.
func (p *Pool) lendLocked(r *region, owner Owner) *Buffer {
	r.heldAt, r.owner = len(p.held), owner
	p.held = append(p.held, r)
	p.inUseBytes += int64(r.size)
	return &Buffer{p: p, r: r, owner: owner}
}

// takeBackLocked ends the loan of r.
func (p *Pool) takeBackLocked(r *region) {
	last := p.held[len(p.held)-1]
	p.held[r.heldAt], last.heldAt = last, r.heldAt
	p.held[len(p.held)-1] = nil
	p.held = p.held[:len(p.held)-1]
	r.heldAt = -1
	p.inUseBytes -= int64(r.size)
}

// destroy deregisters r (if still registered) and frees its memory. It
// must not be called with mu held.
func (p *Pool) destroy(r *region) error {
	if err := p.deregister(r); err != nil {
		return err
	}
	if err := p.dev.FreeMemory(r.mem); err != nil {
		return fmt.Errorf("bufpool: free %d bytes at %#x (memory leaked): %w", r.size, r.addr, err)
	}
	return nil
}

// deregister revokes r's registration and gives its bytes back to the
// budget. A failed Dereg keeps r counted and parks it for Close to retry:
// the memory is still pinned, and saying otherwise would be a lie.
func (p *Pool) deregister(r *region) error {
	r.dmu.Lock()
	defer r.dmu.Unlock()
	p.mu.Lock()
	registered := r.registered
	p.mu.Unlock()
	if !registered {
		return nil
	}
	if err := r.mr.Dereg(); err != nil {
		p.mu.Lock()
		p.stuck = append(p.stuck, r)
		p.mu.Unlock()
		return fmt.Errorf("bufpool: deregister %d bytes at %#x: %w", r.size, r.addr, err)
	}
	p.deregs.Add(1)
	p.budget.release(int64(r.size))
	p.mu.Lock()
	r.registered = false
	p.registered -= int64(r.size)
	p.mu.Unlock()
	return nil
}

func (p *Pool) noteErr(err error) {
	p.relErrs.Add(1)
	p.mu.Lock()
	if len(p.errs) < 16 {
		p.errs = append(p.errs, err)
	}
	p.mu.Unlock()
}

// Stats returns a snapshot of the pool's counters.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	s := Stats{
		RegisteredBytes: p.registered,
		InUseBytes:      p.inUseBytes,
		FreeBytes:       p.freeBytes,
		InUseBuffers:    len(p.held),
		FreeBuffers:     p.freeBufs,
	}
	p.mu.Unlock()
	s.Registrations = p.regs.Load()
	s.Deregistrations = p.deregs.Load()
	s.Reuses = p.reuses.Load()
	s.RegNanos = p.regNanos.Load()
	s.DoubleReleases = p.doubles.Load()
	s.BudgetTrims = p.trims.Load()
	s.Reclaims = p.reclaims.Load()
	s.Overdrafts = p.overdrafts.Load()
	s.ReleaseErrors = p.relErrs.Load()
	return s
}

// OwnerStats returns what owner currently holds.
func (p *Pool) OwnerStats(owner Owner) OwnerStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	var os OwnerStats
	for _, r := range p.held {
		if r.owner == owner {
			os.Buffers++
			os.Bytes += int64(r.size)
		}
	}
	return os
}
