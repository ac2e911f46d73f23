package shm

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// The MR table of a device lives in shared memory so that a peer checks an
// rkey exactly as a NIC would, without asking us: valid, same PD as the
// responder QP, access flags, bounds. Each entry is guarded by a seqlock;
// a key is index<<8 | generation, so a deregistered key never validates
// again even when its slot is reused.
const (
	mrEntries   = 1 << 18 // two per idle connection; the table's pages are touched as it fills
	mrEntrySize = 64
	mrTableSize = mrEntries * mrEntrySize

	mrSeq      = 0  // u32, odd while being written
	mrKey      = 4  // u32, 0 when the slot is free
	mrPD       = 8  // u32
	mrAccess   = 12 // u32
	mrAddr     = 16 // u64, virtual address in the owner
	mrLen      = 24 // u64
	mrMemfdID  = 32 // u64, arena id in the owner process
	mrMemfdOff = 40 // u64, offset of addr inside that arena's memfd
	mrPins     = 48 // u32, requesters copying through the entry right now
)

// pinWait bounds how long Dereg waits for requesters still copying
// through an entry it invalidated. A requester that outlives it (a peer
// stopped or killed mid-copy) leaves the entry and its memory quarantined
// rather than reused, so a late copy can never land in the next owner's
// buffer.
const pinWait = 2 * time.Second

// mrEntry is one decoded table entry.
type mrEntry struct {
	key, pd  uint32
	access   transport.Access
	addr     uint64
	length   uint64
	memfdID  uint64
	memfdOff uint64
}

// covers reports whether [addr, addr+n) lies inside the region.
func (e *mrEntry) covers(addr, n uint64) bool {
	return addr >= e.addr && addr-e.addr <= e.length && n <= e.length-(addr-e.addr)
}

// mrTable is a view of a device's table, ours or a peer's.
type mrTable []byte

// lookup reads the entry for key. The table may belong to another process,
// so a writer that never finishes must not hang us: the retry is bounded.
func (t mrTable) lookup(key uint32) (mrEntry, bool) {
	idx := int(key >> 8)
	if idx >= mrEntries || key == 0 || len(t) < mrTableSize {
		return mrEntry{}, false
	}
	off := idx * mrEntrySize
	for range 1000 {
		s1 := atomic.LoadUint32(word32(t, off+mrSeq))
		if s1&1 != 0 {
			continue
		}
		e := mrEntry{
			key:      atomic.LoadUint32(word32(t, off+mrKey)),
			pd:       atomic.LoadUint32(word32(t, off+mrPD)),
			access:   transport.Access(atomic.LoadUint32(word32(t, off+mrAccess))),
			addr:     atomic.LoadUint64(word64(t, off+mrAddr)),
			length:   atomic.LoadUint64(word64(t, off+mrLen)),
			memfdID:  atomic.LoadUint64(word64(t, off+mrMemfdID)),
			memfdOff: atomic.LoadUint64(word64(t, off+mrMemfdOff)),
		}
		if atomic.LoadUint32(word32(t, off+mrSeq)) != s1 {
			continue
		}
		return e, e.key == key
	}
	return mrEntry{}, false
}

// pin marks a requester copying through entry key, and fails if the key
// was invalidated meanwhile. With sequentially consistent atomics either
// the owner's Dereg sees the pin and waits for unpin, or the requester
// sees the invalidated key.
func (t mrTable) pin(key uint32) bool {
	off := int(key>>8) * mrEntrySize
	atomic.AddUint32(word32(t, off+mrPins), 1)
	if atomic.LoadUint32(word32(t, off+mrKey)) != key {
		t.unpin(key)
		return false
	}
	return true
}

func (t mrTable) unpin(key uint32) {
	atomic.AddUint32(word32(t, int(key>>8)*mrEntrySize+mrPins), ^uint32(0))
}

// awaitUnpinned waits until no requester copies through entry idx.
func (t mrTable) awaitUnpinned(idx uint32) bool {
	w := word32(t, int(idx)*mrEntrySize+mrPins)
	var deadline time.Time
	for d := time.Microsecond; atomic.LoadUint32(w) != 0; d = min(2*d, time.Millisecond) {
		if deadline.IsZero() {
			deadline = time.Now().Add(pinWait)
		} else if time.Now().After(deadline) {
			return false
		}
		time.Sleep(d)
	}
	return true
}

func (t mrTable) store(idx int, e mrEntry) {
	off := idx * mrEntrySize
	seq := word32(t, off+mrSeq)
	atomic.AddUint32(seq, 1)
	atomic.StoreUint32(word32(t, off+mrKey), e.key)
	atomic.StoreUint32(word32(t, off+mrPD), e.pd)
	atomic.StoreUint32(word32(t, off+mrAccess), uint32(e.access))
	atomic.StoreUint64(word64(t, off+mrAddr), e.addr)
	atomic.StoreUint64(word64(t, off+mrLen), e.length)
	atomic.StoreUint64(word64(t, off+mrMemfdID), e.memfdID)
	atomic.StoreUint64(word64(t, off+mrMemfdOff), e.memfdOff)
	atomic.AddUint32(seq, 1)
}

// mrTableOwner is a device's own table plus the Go-side state behind it.
type mrTableOwner struct {
	fd  int // a memfd of its own: every peer maps the table
	ino uint64
	mem []byte

	mu       sync.Mutex
	closed   bool
	removing sync.WaitGroup // removes waiting on pins; close waits for them
	free     []uint32
	next     uint32
	// chunks resolve an lkey on the requester's own side without touching
	// shared memory a peer could scribble on. They are made as the table
	// fills, so that a device costs little until it holds many MRs.
	chunks [mrEntries / mrChunk]atomic.Pointer[mrChunkT]
}

const mrChunk = 1024

type mrChunkT struct {
	local [mrChunk]atomic.Pointer[mr]
	gen   [mrChunk]uint8 // under mu
}

// slot returns the local pointer and generation of entry idx, making its
// chunk if create is set (with mu held).
func (t *mrTableOwner) slot(idx uint32, create bool) (*atomic.Pointer[mr], *uint8) {
	c := t.chunks[idx/mrChunk].Load()
	if c == nil {
		if !create {
			return nil, nil
		}
		c = new(mrChunkT)
		t.chunks[idx/mrChunk].Store(c)
	}
	return &c.local[idx%mrChunk], &c.gen[idx%mrChunk]
}

func newMRTable() (*mrTableOwner, error) {
	fd, ino, mem, err := newMemfd("rdmagrpc-shm-mrtable", mrTableSize)
	if err != nil {
		return nil, fmt.Errorf("MR table: %w", err)
	}
	return &mrTableOwner{fd: fd, ino: ino, mem: mem}, nil
}

// close releases the table; peers keep their own mappings of it.
func (t *mrTableOwner) close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	t.mu.Unlock()
	t.removing.Wait() // they read the table
	t.mu.Lock()
	return errors.Join(unix.Munmap(t.mem), unix.Close(t.fd))
}

func (t *mrTableOwner) dupFD() (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return -1, errors.New("shm: device closed")
	}
	fd, err := dupFD(t.fd)
	if err != nil {
		return -1, fmt.Errorf("shm: dup MR table for peer: %w", err)
	}
	return fd, nil
}

func (t *mrTableOwner) table() mrTable { return mrTable(t.mem) }

// lookupLocal returns the live MR for key.
func (t *mrTableOwner) lookupLocal(key uint32) *mr {
	idx := key >> 8
	if idx >= mrEntries {
		return nil
	}
	p, _ := t.slot(idx, false)
	if p == nil {
		return nil
	}
	m := p.Load()
	if m == nil || m.key != key || m.dead.Load() {
		return nil
	}
	return m
}

func (t *mrTableOwner) insert(m *mr) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	var idx uint32
	switch {
	case len(t.free) > 0:
		idx = t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
	case t.next < mrEntries:
		idx = t.next
		t.next++
	default:
		return false
	}
	p, gen := t.slot(idx, true)
	if *gen++; *gen == 0 {
		*gen = 1
	}
	m.key = idx<<8 | uint32(*gen)
	p.Store(m)
	t.table().store(int(idx), mrEntry{
		key: m.key, pd: m.pd.id, access: m.access, addr: m.addr,
		length: uint64(len(m.mem)), memfdID: m.alloc.arena.id, memfdOff: uint64(m.addr - uint64(m.alloc.arena.base)),
	})
	return true
}

// remove invalidates m's entry and waits for requesters still copying
// through it. It reports false if one outlived pinWait: the entry is then
// never reused, and neither must m's memory be.
func (t *mrTableOwner) remove(m *mr) bool {
	idx := m.key >> 8
	t.mu.Lock()
	closed := t.closed
	if !closed {
		t.table().store(int(idx), mrEntry{})
		t.removing.Add(1)
		defer t.removing.Done()
	}
	if p, _ := t.slot(idx, false); p != nil {
		p.Store(nil)
	}
	t.mu.Unlock()
	if !closed && !t.table().awaitUnpinned(idx) {
		return false
	}
	t.mu.Lock()
	t.free = append(t.free, idx)
	t.mu.Unlock()
	return true
}

type pd struct {
	dev    *device
	id     uint32
	mrs    atomic.Int64
	closed atomic.Bool
}

// pdRegistry lets the uprobe-friendly registration functions, which take
// only integers, find their PD.
type pdReg struct {
	sync.RWMutex
	m map[uint32]*pd
}

var pdRegistry = &pdReg{m: map[uint32]*pd{}}

func (r *pdReg) add(p *pd) {
	r.Lock()
	r.m[p.id] = p
	r.Unlock()
}

func lookupPD(id uint32) *pd {
	pdRegistry.RLock()
	defer pdRegistry.RUnlock()
	return pdRegistry.m[id]
}

func (p *pd) Close() error {
	if n := p.mrs.Load(); n > 0 {
		return fmt.Errorf("shm: close PD %d: %d memory regions still registered: %w", p.id, n, unix.EBUSY)
	}
	if p.closed.Swap(true) {
		return nil
	}
	pdRegistry.Lock()
	delete(pdRegistry.m, p.id)
	pdRegistry.Unlock()
	p.dev.pds.Add(-1)
	return nil
}

func (p *pd) RegMR(mem []byte, access transport.Access) (transport.MR, error) {
	if len(mem) == 0 {
		return nil, fmt.Errorf("shm: register MR: empty buffer: %w", unix.EINVAL)
	}
	addr := uint64(addrOf(mem))
	key, errno := regMR(addr, uint64(len(mem)), uint32(access), p.id)
	if errno != 0 {
		err := unix.Errno(errno)
		switch err {
		case unix.EFAULT:
			return nil, fmt.Errorf("shm: register MR at %#x+%d: memory does not come from Device.AllocMemory (the shm provider can only share memfd-backed memory): %w", addr, len(mem), err)
		case unix.ENOMEM:
			return nil, fmt.Errorf("shm: register MR: table of %d regions is full: %w", mrEntries, err)
		case unix.EXDEV:
			return nil, fmt.Errorf("shm: register MR at %#x+%d: memory allocated on another shm device (connections to each peer process have their own; allocate on the PD's device): %w", addr, len(mem), err)
		default:
			return nil, fmt.Errorf("shm: register MR at %#x+%d access %#x: %w", addr, len(mem), access, err)
		}
	}
	m := p.dev.mrs.lookupLocal(key)
	if m == nil {
		return nil, fmt.Errorf("shm: register MR: key %#x vanished (concurrent deregistration)", key)
	}
	return m, nil
}

// regMR registers [addr, addr+length) in PD pdID and returns its key, or an
// errno. It is the one place every registration goes through and takes and
// returns plain integers so that an eBPF uprobe on its entry and RET
// instructions can measure registration cost (cmd/rdmatrace). Keep it
// non-inlined and keep the signature.
//
//go:noinline
func regMR(addr, length uint64, access uint32, pdID uint32) (key uint32, errno int32) {
	p := lookupPD(pdID)
	if p == nil || p.closed.Load() {
		return 0, int32(unix.EINVAL)
	}
	acc := transport.Access(access)
	if acc&^(transport.AccessLocalWrite|transport.AccessRemoteWrite|transport.AccessRemoteRead) != 0 {
		return 0, int32(unix.EINVAL)
	}
	// As in verbs: remote write needs local write.
	if acc&transport.AccessRemoteWrite != 0 && acc&transport.AccessLocalWrite == 0 {
		return 0, int32(unix.EINVAL)
	}
	if length == 0 || length > deviceAttr.MaxMRSize {
		return 0, int32(unix.EINVAL)
	}
	a := acquireAlloc(uintptr(addr), int(length))
	if a == nil {
		return 0, int32(unix.EFAULT)
	}
	if a.pool != p.dev.data {
		// Memory of another device's arenas: its peer would be handed
		// an arena holding another peer process's data.
		a.mrs.Add(-1)
		return 0, int32(unix.EXDEV)
	}
	off := uintptr(addr) - a.base
	m := &mr{pd: p, access: acc, addr: addr, mem: a.mem[off : off+uintptr(length) : off+uintptr(length)], alloc: a}
	if !p.dev.mrs.insert(m) {
		a.mrs.Add(-1)
		return 0, int32(unix.ENOMEM)
	}
	p.mrs.Add(1)
	return m.key, 0
}

// deregMR invalidates key at once (later remote accesses fail with a
// remote access error). Same uprobe contract as regMR.
//
//go:noinline
func deregMR(addr, length uint64, key uint32, pdID uint32) (errno int32) {
	p := lookupPD(pdID)
	if p == nil {
		return int32(unix.EINVAL)
	}
	m := p.dev.mrs.lookupLocal(key)
	if m == nil || m.pd != p || m.addr != addr || uint64(len(m.mem)) != length {
		return int32(unix.EINVAL)
	}
	if m.dead.Swap(true) {
		return int32(unix.EINVAL)
	}
	if !p.dev.mrs.remove(m) {
		m.alloc.quarantined.Store(true)
	}
	p.mrs.Add(-1)
	m.alloc.mrs.Add(-1)
	return 0
}

type mr struct {
	pd     *pd
	key    uint32
	access transport.Access
	addr   uint64
	mem    []byte
	alloc  *allocation
	dead   atomic.Bool
}

func (m *mr) Addr() uint64             { return m.addr }
func (m *mr) Len() int                 { return len(m.mem) }
func (m *mr) LKey() uint32             { return m.key }
func (m *mr) RKey() uint32             { return m.key }
func (m *mr) Access() transport.Access { return m.access }
func (m *mr) Bytes() []byte            { return m.mem }

func (m *mr) Dereg() error {
	if m.dead.Load() {
		return errors.New("shm: dereg MR: already deregistered")
	}
	if errno := deregMR(m.addr, uint64(len(m.mem)), m.key, m.pd.id); errno != 0 {
		return fmt.Errorf("shm: dereg MR key %#x: %w", m.key, unix.Errno(errno))
	}
	return nil
}

// ReleasePages punches the region's pages out of its memfd (MADV_REMOVE):
// they leave this process and every peer that maps the arena, and read
// as zeros until written again. The region is page-aligned and a
// multiple of the page size (AllocMemory), so no neighbour is touched.
func (m *mr) ReleasePages() error {
	if m.dead.Load() {
		return errors.New("shm: release pages: MR deregistered")
	}
	// MADV_REMOVE rounds the length up to a page: a region that does not
	// own whole pages would punch its neighbour's bytes too.
	if ps := unix.Getpagesize(); m.addr%uint64(ps) != 0 || len(m.mem)%ps != 0 {
		return fmt.Errorf("shm: release pages of MR key %#x: %d bytes at %#x are not whole pages", m.key, len(m.mem), m.addr)
	}
	if err := unix.Madvise(m.mem, unix.MADV_REMOVE); err != nil {
		return fmt.Errorf("shm: release pages of MR key %#x: %w", m.key, err)
	}
	return nil
}

// slice returns the bytes [addr, addr+n) of a local MR if they are inside it.
func (m *mr) slice(addr uint64, n uint32) ([]byte, bool) {
	if addr < m.addr || addr-m.addr > uint64(len(m.mem)) || uint64(n) > uint64(len(m.mem))-(addr-m.addr) {
		return nil, false
	}
	off := addr - m.addr
	return m.mem[off : off+uint64(n)], true
}
