package shm

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// allocation is one memfd-backed mapping handed out by AllocMemory. A peer
// that needs it receives a dup of fd and maps it itself, so freeing here
// never pulls memory out from under a peer that is still copying.
type allocation struct {
	id   uint64
	fd   int
	mem  []byte // the whole mapping, page-rounded
	base uintptr
	mrs  atomic.Int32 // registrations over it; FreeMemory refuses while > 0
}

func (a *allocation) contains(p uintptr, n int) bool {
	return p >= a.base && p-a.base <= uintptr(len(a.mem)) && uintptr(n) <= uintptr(len(a.mem))-(p-a.base)
}

// allocs is the process-wide set of live allocations, sorted by address so
// that RegMR can find the memfd behind any sub-slice it is given.
var allocs struct {
	sync.RWMutex
	sorted []*allocation
	byID   map[uint64]*allocation
}

var allocIDs atomic.Uint64

var pageSize = unix.Getpagesize()

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func allocMemory(size int) ([]byte, error) {
	if size <= 0 {
		return nil, fmt.Errorf("shm: alloc memory of %d bytes: size must be positive", size)
	}
	n := (size + pageSize - 1) &^ (pageSize - 1)
	fd, mem, err := newMemfd("rdmagrpc-shm-mem", n)
	if err != nil {
		return nil, fmt.Errorf("shm: alloc memory of %d bytes: %w", size, err)
	}
	a := &allocation{id: allocIDs.Add(1), fd: fd, mem: mem, base: addrOf(mem)}
	allocs.Lock()
	if allocs.byID == nil {
		allocs.byID = make(map[uint64]*allocation)
	}
	i, _ := slices.BinarySearchFunc(allocs.sorted, a.base, cmpBase)
	allocs.sorted = slices.Insert(allocs.sorted, i, a)
	allocs.byID[a.id] = a
	allocs.Unlock()
	return mem[:size:size], nil
}

func cmpBase(a *allocation, base uintptr) int {
	switch {
	case a.base < base:
		return -1
	case a.base > base:
		return 1
	}
	return 0
}

func freeMemory(mem []byte) error {
	if len(mem) == 0 {
		return errors.New("shm: free memory: empty slice")
	}
	base := addrOf(mem)
	allocs.Lock()
	i, found := slices.BinarySearchFunc(allocs.sorted, base, cmpBase)
	if !found {
		allocs.Unlock()
		return fmt.Errorf("shm: free memory at %#x: not a slice returned by AllocMemory", base)
	}
	a := allocs.sorted[i]
	if n := a.mrs.Load(); n > 0 {
		allocs.Unlock()
		return fmt.Errorf("shm: free memory at %#x: %d memory regions still registered over it: %w", base, n, unix.EBUSY)
	}
	allocs.sorted = slices.Delete(allocs.sorted, i, i+1)
	delete(allocs.byID, a.id)
	allocs.Unlock()
	err := errors.Join(unix.Munmap(a.mem), unix.Close(a.fd))
	if err != nil {
		return fmt.Errorf("shm: free memory at %#x: %w", base, err)
	}
	return nil
}

// acquireAlloc returns the allocation holding [p, p+n) with one more
// registration counted on it, so that FreeMemory cannot race it.
func acquireAlloc(p uintptr, n int) *allocation {
	allocs.RLock()
	defer allocs.RUnlock()
	i, found := slices.BinarySearchFunc(allocs.sorted, p, cmpBase)
	if !found {
		i--
	}
	if i < 0 || i >= len(allocs.sorted) {
		return nil
	}
	if a := allocs.sorted[i]; a.contains(p, n) {
		a.mrs.Add(1)
		return a
	}
	return nil
}

// dupAllocFD returns a dup of the memfd of allocation id, for handing to a peer.
func dupAllocFD(id uint64) (int, error) {
	allocs.RLock()
	defer allocs.RUnlock()
	a := allocs.byID[id]
	if a == nil {
		return -1, fmt.Errorf("memfd %d is freed", id)
	}
	return unix.FcntlInt(uintptr(a.fd), unix.F_DUPFD_CLOEXEC, 0)
}

// newMemfd creates a memfd of size bytes and maps it shared.
func newMemfd(name string, size int) (int, []byte, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return -1, nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("ftruncate memfd to %d: %w", size, err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("mmap memfd of %d bytes: %w", size, err)
	}
	return fd, mem, nil
}

// mapFD maps the whole of a memfd received from a peer. minSize guards
// against a peer handing over something smaller than it announced.
func mapFD(fd int, minSize int) ([]byte, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat peer memfd: %w", err)
	}
	if st.Size < int64(minSize) || st.Size <= 0 || st.Size > int64(deviceAttr.MaxMRSize) {
		return nil, fmt.Errorf("peer memfd has %d bytes, want at least %d", st.Size, minSize)
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap peer memfd of %d bytes: %w", st.Size, err)
	}
	return mem, nil
}

// segment is a small shared-memory area of this process (MR table, QP
// ring, CQ header) whose fd is handed to peers at connect time.
type segment struct {
	fd  int
	mem []byte
}

func newSegment(name string, size int) (*segment, error) {
	size = (size + pageSize - 1) &^ (pageSize - 1)
	fd, mem, err := newMemfd(name, size)
	if err != nil {
		return nil, err
	}
	return &segment{fd: fd, mem: mem}, nil
}

func (s *segment) close() error {
	return errors.Join(unix.Munmap(s.mem), unix.Close(s.fd))
}

func (s *segment) dupFD() (int, error) {
	return unix.FcntlInt(uintptr(s.fd), unix.F_DUPFD_CLOEXEC, 0)
}

// Shared words are accessed only through these, with atomics, because the
// other side may be another process; offsets are always 8-byte aligned.
func word32(b []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&b[off])) }
func word64(b []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&b[off])) }
