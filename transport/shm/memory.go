package shm

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Memory a peer may map is carved out of arenas: memfds mapped shared and
// handed out in page runs. One memfd per allocation would cost a process
// a descriptor and a mapping for every ring of every connection, and ten
// thousand idle connections would run into the descriptor limit and
// vm.max_map_count long before memory; with arenas a connection costs
// only its unix socket. Pages of an arena are allocated by the kernel on
// first touch, and a freed run is punched out (zeroed and given back), so
// a large arena costs address space, not memory, and the next owner of a
// run never sees the previous one's data.
//
// A peer maps a whole arena, so the bounds of what it may touch are
// enforced by the requester's checks against the MR table, as they always
// were in this provider (the requester does the NIC's work); a process
// that bypasses this package can reach every arena it was handed. Use the
// verbs provider where peers are hostile.
const (
	arenaSize   = 64 << 20
	dedicatedAt = arenaSize / 4 // larger allocations get a memfd of their own
)

// arena is one memfd mapping, split into page runs.
type arena struct {
	id   uint64
	name string
	fd   int
	ino  uint64 // the memfd's inode: how a peer that holds it mapped is told of it
	mem  []byte
	base uintptr
	free []span // sorted by offset, coalesced, in bytes
	used int    // bytes handed out
	// touched is the end of the highest run handed out since the pages
	// were last all punched: what an empty arena may still hold resident.
	touched int
	// dedicated arenas hold one large allocation and go when it does.
	dedicated bool
	// owners is the data allocation holding each page, as far as the
	// highest page one held (allocMemory's arenas only).
	owners []*allocation
}

type span struct{ off, n int }

// take returns the offset of a run of n bytes (page-rounded), first fit.
func (a *arena) take(n int) (int, bool) {
	for i, s := range a.free {
		if s.n < n {
			continue
		}
		off := s.off
		if s.n == n {
			a.free = slices.Delete(a.free, i, i+1)
		} else {
			a.free[i] = span{s.off + n, s.n - n}
		}
		a.used += n
		a.touched = max(a.touched, off+n)
		return off, true
	}
	return 0, false
}

// punchMin is the smallest run whose pages go back to the kernel when
// freed. Smaller runs (rings, staging, CQ headers: every connection's) are
// cleared and stay resident for the next connection: punching cost a
// system call per run at each close and page faults at the next set-up,
// for a few pages.
const punchMin = 64 << 10

// punch gives the pages of a run back to the kernel, which zeroes them;
// a run below punchMin is zeroed in place.
func (a *arena) punch(off, n int) {
	if n < punchMin {
		clear(a.mem[off : off+n])
		return
	}
	err := unix.Fallocate(a.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(off), int64(n))
	if err != nil {
		// Without hole punching the run is still zeroed for its next user.
		clear(a.mem[off : off+n])
	}
}

// punchAll gives every page of an empty arena back to the kernel.
func (a *arena) punchAll() {
	// Without hole punching the runs were zeroed when they were freed.
	unix.Fallocate(a.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, int64(len(a.mem)))
	a.touched = 0
}

// keepResident is how much of its pages an empty arena keeps: a
// connection opened and closed in a loop empties it at each close, and
// punching it then would make the next set-up fault in every page of its
// rings and queues again, a cost on every dial. A burst's high-water mark
// above it still goes back.
const keepResident = 256 << 10

// give returns a run, zeroed, to the free list.
func (a *arena) give(off, n int) {
	a.punch(off, n)
	a.used -= n
	i, _ := slices.BinarySearchFunc(a.free, off, func(s span, off int) int { return s.off - off })
	a.free = slices.Insert(a.free, i, span{off, n})
	if i+1 < len(a.free) && a.free[i].off+a.free[i].n == a.free[i+1].off {
		a.free[i].n += a.free[i+1].n
		a.free = slices.Delete(a.free, i+1, i+2)
	}
	if i > 0 && a.free[i-1].off+a.free[i-1].n == a.free[i].off {
		a.free[i-1].n += a.free[i].n
		a.free = slices.Delete(a.free, i, i+1)
	}
}

func (a *arena) close() error { return errors.Join(unix.Munmap(a.mem), unix.Close(a.fd)) }

// pool is a set of arenas for one kind of memory. Data buffers and the
// provider's own control structures (QP rings, CQ headers) never share an
// arena, so that a peer handed a control arena at connect time does not
// thereby map data it holds no key for.
type pool struct {
	name   string
	arenas []*arena
}

var arenaIDs atomic.Uint64

// alloc carves n bytes (a multiple of the page size) out of the pool.
// Called with allocs locked.
func (p *pool) alloc(n int) (*arena, int, error) {
	dedicated := n >= dedicatedAt
	if !dedicated {
		for _, a := range p.arenas {
			if a.dedicated {
				continue
			}
			if off, ok := a.take(n); ok {
				return a, off, nil
			}
		}
	}
	size := arenaSize
	if dedicated {
		size = n
	}
	fd, ino, mem, err := newMemfd(p.name, size)
	if err != nil {
		return nil, 0, err
	}
	a := &arena{id: arenaIDs.Add(1), name: p.name, fd: fd, ino: ino, mem: mem, base: addrOf(mem), free: []span{{0, size}}, dedicated: dedicated}
	arenas.byID[a.id] = a
	p.arenas = append(p.arenas, a)
	off, _ := a.take(n)
	return a, off, nil
}

// release gives a run back and drops the arena once it is empty, unless it
// is the pool's last shared one (kept so that a connection opened and
// closed in a loop does not create a memfd each time). Called with allocs
// locked.
func (p *pool) release(a *arena, off, n int) error {
	a.give(off, n)
	if a.used > 0 {
		return nil
	}
	shared := 0
	for _, b := range p.arenas {
		if !b.dedicated {
			shared++
		}
	}
	if !a.dedicated && shared == 1 {
		// Kept for the next connection, but its pages go back beyond
		// keepResident: runs cleared in place (punchMin) would otherwise
		// keep a burst's high-water mark resident after every connection
		// closed.
		if a.touched > keepResident {
			a.punchAll()
		}
		return nil
	}
	p.arenas = slices.DeleteFunc(p.arenas, func(b *arena) bool { return b == a })
	forgetArena(a)
	return a.close()
}

// empty reports whether nothing is carved out of the pool. Called with
// allocs locked.
func (p *pool) empty() bool {
	for _, a := range p.arenas {
		if a.used > 0 {
			return false
		}
	}
	return true
}

// drop closes the arenas of an empty pool. Called with allocs locked.
func (p *pool) drop() error {
	var errs []error
	for _, a := range p.arenas {
		forgetArena(a)
		errs = append(errs, a.close())
	}
	p.arenas = nil
	return errors.Join(errs...)
}

// allocation is one run handed out by AllocMemory or to a segment.
type allocation struct {
	arena *arena
	pool  *pool
	off   int
	mem   []byte // the whole run, page-rounded
	base  uintptr
	mrs   atomic.Int32 // registrations over it; FreeMemory refuses while > 0
	// quarantined: a peer may still be copying into it (see pinWait), so
	// FreeMemory forgets the run instead of handing it out again.
	quarantined atomic.Bool
}

func (a *allocation) contains(p uintptr, n int) bool {
	return p >= a.base && p-a.base <= uintptr(len(a.mem)) && uintptr(n) <= uintptr(len(a.mem))-(p-a.base)
}

var (
	dataPool = &pool{name: "rdmagrpc-shm-mem"}
	ctlPool  = &pool{name: "rdmagrpc-shm-ctl"}
)

// allocs indexes the process's live data allocations so that RegMR can
// find the arena and allocation behind any sub-slice it is given: the
// arenas that hold some by address, and in each the owner of every page.
// A single list sorted by address cost each allocation and free a move of
// the entries after it, and mmap places each new arena below the older
// ones: ten thousand connections set up in a loop spent a tenth of the
// client's CPU moving that list. arenas.byID is under the same lock.
var allocs struct {
	sync.RWMutex
	arenas []*arena // with owners, sorted by base
}

var arenas = struct{ byID map[uint64]*arena }{byID: map[uint64]*arena{}}

// forgetArena drops a closing arena from the indexes. Called with allocs
// locked.
func forgetArena(a *arena) {
	delete(arenas.byID, a.id)
	if a.owners != nil {
		allocs.arenas = slices.DeleteFunc(allocs.arenas, func(b *arena) bool { return b == a })
	}
}

// arenaAt returns the indexed arena whose mapping holds p (or ends at it),
// or nil. Called with allocs locked.
func arenaAt(p uintptr) *arena {
	i, found := slices.BinarySearchFunc(allocs.arenas, p, byBase)
	if !found {
		i--
	}
	if i < 0 {
		return nil
	}
	if a := allocs.arenas[i]; p-a.base <= uintptr(len(a.mem)) {
		return a
	}
	return nil
}

func byBase(a *arena, p uintptr) int { return cmp.Compare(a.base, p) }

// own records a as the owner of its pages. Called with allocs locked.
func (ar *arena) own(a *allocation) {
	if ar.owners == nil {
		i, _ := slices.BinarySearchFunc(allocs.arenas, ar.base, byBase)
		allocs.arenas = slices.Insert(allocs.arenas, i, ar)
	}
	first, end := a.off/pageSize, (a.off+len(a.mem))/pageSize
	if end > len(ar.owners) {
		ar.owners = slices.Grow(ar.owners, end-len(ar.owners))[:end]
	}
	for i := first; i < end; i++ {
		ar.owners[i] = a
	}
}

// disown forgets a as the owner of its pages. Called with allocs locked.
func (ar *arena) disown(a *allocation) {
	clear(ar.owners[a.off/pageSize : (a.off+len(a.mem))/pageSize])
}

// ownerAt returns the allocation holding the page of p, or nil. Called
// with allocs locked.
func (ar *arena) ownerAt(p uintptr) *allocation {
	if pg := int((p - ar.base) / uintptr(pageSize)); pg < len(ar.owners) {
		return ar.owners[pg]
	}
	return nil
}

var pageSize = unix.Getpagesize()

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// carve takes a page-rounded run of at least size bytes from p.
// Called with allocs locked.
func carve(p *pool, size int) (*allocation, error) {
	return carveIn(p, size, pageSize)
}

// carveIn takes a run of at least size bytes from p, rounded up to unit
// (a power of two), so that it starts at a multiple of unit.
func carveIn(p *pool, size, unit int) (*allocation, error) {
	n := (size + unit - 1) &^ (unit - 1)
	ar, off, err := p.alloc(n)
	if err != nil {
		return nil, err
	}
	mem := ar.mem[off : off+n : off+n]
	return &allocation{arena: ar, pool: p, off: off, mem: mem, base: addrOf(mem)}, nil
}

func allocMemory(pl *pool, size int) ([]byte, error) {
	if size <= 0 {
		return nil, fmt.Errorf("shm: alloc memory of %d bytes: size must be positive", size)
	}
	allocs.Lock()
	defer allocs.Unlock()
	a, err := carve(pl, size)
	if err != nil {
		return nil, fmt.Errorf("shm: alloc memory of %d bytes: %w", size, err)
	}
	a.arena.own(a)
	return a.mem[:size:size], nil
}

func freeMemory(mem []byte) error {
	if len(mem) == 0 {
		return errors.New("shm: free memory: empty slice")
	}
	base := addrOf(mem)
	allocs.Lock()
	defer allocs.Unlock()
	var a *allocation
	if ar := arenaAt(base); ar != nil {
		a = ar.ownerAt(base)
	}
	if a == nil || a.base != base {
		return fmt.Errorf("shm: free memory at %#x: not a slice returned by AllocMemory", base)
	}
	if n := a.mrs.Load(); n > 0 {
		return fmt.Errorf("shm: free memory at %#x: %d memory regions still registered over it: %w", base, n, unix.EBUSY)
	}
	a.arena.disown(a)
	if a.quarantined.Load() {
		a.arena.punch(a.off, len(a.mem)) // its pages, never its run
		return nil
	}
	if err := a.pool.release(a.arena, a.off, len(a.mem)); err != nil {
		return fmt.Errorf("shm: free memory at %#x: %w", base, err)
	}
	return nil
}

// acquireAlloc returns the allocation holding [p, p+n) with one more
// registration counted on it, so that FreeMemory cannot race it.
func acquireAlloc(p uintptr, n int) *allocation {
	allocs.RLock()
	defer allocs.RUnlock()
	ar := arenaAt(p)
	if ar == nil {
		return nil
	}
	if a := ar.ownerAt(p); a != nil && a.contains(p, n) {
		a.mrs.Add(1)
		return a
	}
	return nil
}

// dupArenaFD returns a dup of the memfd of arena id, for handing to a peer.
func dupArenaFD(id uint64) (int, error) {
	allocs.RLock()
	defer allocs.RUnlock()
	a := arenas.byID[id]
	if a == nil {
		return -1, fmt.Errorf("arena %d is freed", id)
	}
	return dupFD(a.fd)
}

// newMemfd creates a memfd of size bytes and maps it shared; ino is its
// inode number.
func newMemfd(name string, size int) (fd int, ino uint64, mem []byte, err error) {
	fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, 0, nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return -1, 0, nil, fmt.Errorf("ftruncate memfd to %d: %w", size, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, 0, nil, fmt.Errorf("fstat memfd: %w", err)
	}
	// Sealed against shrinking, so that a peer's mapping can never fault
	// (SIGBUS) past a shortened end; peers check for the seal.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return -1, 0, nil, fmt.Errorf("seal memfd: %w", err)
	}
	mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return -1, 0, nil, fmt.Errorf("mmap memfd of %d bytes: %w", size, err)
	}
	return fd, st.Ino, mem, nil
}

// segment is a small shared-memory area of this process (QP ring, CQ
// header) carved from a control arena; a peer is handed the arena's fd and
// the segment's offset at connect time.
type segment struct {
	a   *allocation
	mem []byte
}

// segmentUnit is what segments are rounded to: a cache line, so that two
// connections' shared words never share one, and segments of many
// connections share pages. Rounded to pages, a CQ header (64 B) and a QP
// ring (under 3 KiB) took a page each, and each end of an idle connection
// kept four control pages resident (its own two and its view of its
// peer's): most of what it cost beyond its rings. Peers map whole arenas
// (a segment's offset need not be page-aligned), every control arena
// belongs to one peer process (peers.go), and a freed or quarantined run
// below punchMin is cleared in place, never punched, so a page shared
// with other segments is never taken from under them.
const segmentUnit = 64

func newSegment(pl *pool, size int) (*segment, error) {
	allocs.Lock()
	defer allocs.Unlock()
	a, err := carveIn(pl, size, segmentUnit)
	if err != nil {
		return nil, err
	}
	return &segment{a: a, mem: a.mem[:size:size]}, nil
}

func (s *segment) close() error {
	allocs.Lock()
	defer allocs.Unlock()
	return s.a.pool.release(s.a.arena, s.a.off, len(s.a.mem))
}

// quarantine gives the segment's pages back to the kernel but never the
// run to the pool: a peer may still write there (see qp.Close).
func (s *segment) quarantine() {
	allocs.Lock()
	defer allocs.Unlock()
	s.a.arena.punch(s.a.off, len(s.a.mem))
}

// share returns a dup of the segment's arena fd and the segment's place in it.
func (s *segment) share() (fd int, off uint64, err error) {
	allocs.RLock()
	defer allocs.RUnlock()
	fd, err = dupFD(s.a.arena.fd)
	return fd, uint64(s.a.off), err
}

// place returns the inode of the segment's arena and the segment's place in it.
func (s *segment) place() (ino, off uint64) {
	allocs.RLock()
	defer allocs.RUnlock()
	return s.a.arena.ino, uint64(s.a.off)
}

// Shared words are accessed only through these, with atomics, because the
// other side may be another process; offsets are always 8-byte aligned.
func word32(b []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&b[off])) }
func word64(b []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&b[off])) }
