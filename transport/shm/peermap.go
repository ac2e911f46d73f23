package shm

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// A peer's arenas are mapped once per process however many connections
// reach them: every connection to the same server process would otherwise
// add mappings of the same memfds, and vm.max_map_count (65,530 by
// default) would end ten thousand connections before the descriptor
// limit does. A memfd is known by its inode, whichever descriptor of it
// arrives.
// The size is part of the key: inode numbers of old kernels' memfds are
// 32-bit and may wrap.
type fileKey struct{ dev, ino, size uint64 }

type sharedMap struct {
	mem  []byte
	refs int
}

var peerMaps = struct {
	sync.Mutex
	m map[fileKey]*sharedMap
}{m: map[fileKey]*sharedMap{}}

// peerMapping is one reference to a shared mapping.
type peerMapping struct {
	mem     []byte
	key     fileKey
	lastKey uint32 // the MR key last resolved through it (see sweep)
}

// mapPeer maps the whole of a memfd received from a peer, or takes one
// more reference on the existing mapping of it, and closes fd. minSize
// guards against a peer handing over something smaller than it
// announced; the shrink seal against one that shortens it later.
func mapPeer(fd int, minSize int) (peerMapping, error) {
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return peerMapping{}, fmt.Errorf("fstat peer memfd: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return peerMapping{}, fmt.Errorf("peer sent a descriptor that is not a memfd (mode %#o)", st.Mode)
	}
	if st.Size < int64(minSize) || st.Size <= 0 || st.Size > int64(deviceAttr.MaxMRSize) {
		return peerMapping{}, fmt.Errorf("peer memfd has %d bytes, want at least %d", st.Size, minSize)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return peerMapping{}, fmt.Errorf("peer memfd is not sealed against shrinking (seals %#x, %v)", seals, err)
	}
	k := fileKey{dev: st.Dev, ino: st.Ino, size: uint64(st.Size)}
	peerMaps.Lock()
	defer peerMaps.Unlock()
	if sm, ok := peerMaps.m[k]; ok {
		sm.refs++
		return peerMapping{mem: sm.mem, key: k}, nil
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return peerMapping{}, fmt.Errorf("mmap peer memfd of %d bytes: %w", st.Size, err)
	}
	peerMaps.m[k] = &sharedMap{mem: mem, refs: 1}
	return peerMapping{mem: mem, key: k}, nil
}

// retain takes one more reference on the mapping p holds one on.
func (p peerMapping) retain() peerMapping {
	peerMaps.Lock()
	defer peerMaps.Unlock()
	peerMaps.m[p.key].refs++
	return peerMapping{mem: p.mem, key: p.key}
}

// release drops the reference and unmaps the memfd with the last one.
func (p *peerMapping) release() {
	if p.mem == nil {
		return
	}
	peerMaps.Lock()
	defer peerMaps.Unlock()
	if sm, ok := peerMaps.m[p.key]; ok {
		if sm.refs--; sm.refs == 0 {
			unix.Munmap(sm.mem)
			delete(peerMaps.m, p.key)
		}
	}
	p.mem = nil
}

// window returns [off, off+n) of the mapping, checked.
func (p peerMapping) window(off, n uint64) ([]byte, error) {
	if off > uint64(len(p.mem)) || n > uint64(len(p.mem))-off {
		return nil, fmt.Errorf("peer placed %d bytes at %d in a memfd of %d", n, off, len(p.mem))
	}
	return p.mem[off : off+n : off+n], nil
}
