package verbs

import (
	"fmt"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// memRegistry tracks the anonymous mappings handed out by AllocMemory, so
// that RegMR registers only memory outside the Go heap and FreeMemory
// refuses to unmap memory still registered.
type memRegistry struct {
	mu      sync.Mutex
	regions map[uintptr]*region // by base address
}

type region struct {
	mapping []byte // the whole mapping, page-rounded
	size    int    // what the caller asked for
	mrs     int    // live MRs over it
}

func (m *memRegistry) alloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("verbs: AllocMemory(%d): size must be positive", n)
	}
	page := os.Getpagesize()
	full := (n + page - 1) &^ (page - 1)
	// MmapPtr, not Mmap: Mmap records every mapping in a map of its
	// own, 160 bytes per connection ring that the registry holds anyway.
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(full), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("verbs: mmap %d bytes: %w", full, err)
	}
	b := unsafe.Slice((*byte)(p), full)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.regions == nil {
		m.regions = map[uintptr]*region{}
	}
	m.regions[uintptr(unsafe.Pointer(&b[0]))] = &region{mapping: b, size: n}
	return b[:n:n], nil
}

func (m *memRegistry) free(mem []byte) error {
	if len(mem) == 0 {
		return fmt.Errorf("verbs: FreeMemory of an empty slice")
	}
	base := uintptr(unsafe.Pointer(&mem[0]))
	m.mu.Lock()
	r, ok := m.regions[base]
	if !ok {
		m.mu.Unlock()
		return fmt.Errorf("verbs: FreeMemory(%#x): not the start of memory from AllocMemory", base)
	}
	if r.mrs > 0 {
		m.mu.Unlock()
		return fmt.Errorf("verbs: FreeMemory(%#x): %d memory regions still registered over it", base, r.mrs)
	}
	delete(m.regions, base)
	m.mu.Unlock()
	if err := unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(r.mapping)), uintptr(len(r.mapping))); err != nil {
		return fmt.Errorf("verbs: munmap: %w", err)
	}
	return nil
}

// pin finds the allocation holding mem entirely and counts one more MR
// over it; unpin undoes it.
func (m *memRegistry) pin(mem []byte) (*region, error) {
	if len(mem) == 0 {
		return nil, fmt.Errorf("verbs: RegMR of an empty slice")
	}
	lo := uintptr(unsafe.Pointer(&mem[0]))
	hi := lo + uintptr(len(mem))
	m.mu.Lock()
	defer m.mu.Unlock()
	// Memory is nearly always registered whole, from its base: found at
	// once, where a scan would make set-up quadratic in the connections.
	if r := m.regions[lo]; r != nil && hi <= lo+uintptr(r.size) {
		r.mrs++
		return r, nil
	}
	for base, r := range m.regions {
		if lo >= base && hi <= base+uintptr(r.size) {
			r.mrs++
			return r, nil
		}
	}
	return nil, fmt.Errorf("verbs: RegMR(%#x, %d): memory does not come from this device's AllocMemory "+
		"(Go heap memory must never be registered)", lo, len(mem))
}

func (m *memRegistry) unpin(r *region) {
	m.mu.Lock()
	r.mrs--
	m.mu.Unlock()
}

func (m *memRegistry) live() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.regions)
}
