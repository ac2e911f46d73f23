package bufpool

import (
	"errors"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Buffer is one loan of registered memory. The handle is single-use: after
// Release or Discard it must not be used, and using it again is counted as
// a bug (Stats.DoubleReleases) rather than corrupting whoever holds the
// memory next.
type Buffer struct {
	p     *Pool
	r     *region
	owner Owner
	done  atomic.Bool
}

// Bytes returns the whole buffer (len == class size). The memory is outside
// the Go heap and stays valid until Release or Discard.
func (b *Buffer) Bytes() []byte { return b.r.mem }

// Len returns the class size.
func (b *Buffer) Len() int { return b.r.size }

// Addr is the address peers use in RDMA operations (the MR's address).
func (b *Buffer) Addr() uint64 { return b.r.addr }

// LKey is the local key for SGEs.
func (b *Buffer) LKey() uint32 { return b.r.lkey }

// RKey is the remote key a peer needs to write into or read from the buffer.
func (b *Buffer) RKey() uint32 { return b.r.rkey }

// MR returns the registration. Do not deregister it: the pool owns it.
func (b *Buffer) MR() transport.MR { return b.r.mr }

// Access returns the access flags the buffer is registered with.
func (b *Buffer) Access() transport.Access { return b.r.key.access }

// Owner returns who holds the buffer.
func (b *Buffer) Owner() Owner { return b.owner }

// ErrCannotReleasePages: the provider's memory stays resident while it is
// registered (verbs pins it).
var ErrCannotReleasePages = errors.New("bufpool: the provider cannot give a registered buffer's pages back")

// CanReleasePages says whether ReleasePages can work on this buffer.
func (b *Buffer) CanReleasePages() bool {
	_, ok := b.r.mr.(transport.PageReleaser)
	return ok
}

// ReleasePages gives the buffer's pages back to the system and keeps it
// registered: they read as zeros until written again. Nobody, local or
// remote, may write into it meanwhile.
func (b *Buffer) ReleasePages() error {
	pr, ok := b.r.mr.(transport.PageReleaser)
	if !ok {
		return ErrCannotReleasePages
	}
	return pr.ReleasePages()
}

// Release gives the buffer back. It keeps its registration on the free
// list of its class and access unless that list already holds MaxFree
// buffers or the pool is closed, in which case it is deregistered and
// freed. A second Release (or a Release after Discard) does nothing but
// count Stats.DoubleReleases.
func (b *Buffer) Release() {
	p := b.p
	if b.done.Swap(true) {
		p.doubles.Add(1)
		return
	}
	r := b.r
	p.mu.Lock()
	p.takeBackLocked(r)
	if !p.closed && r.registered && len(p.free[r.key]) < p.maxFree {
		if p.free == nil { // made at the first Release: most pools (one per connection) never keep one
			p.free = map[freeKey][]*region{}
		}
		p.free[r.key] = append(p.free[r.key], r)
		p.freeBufs++
		p.freeBytes += int64(r.size)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	if err := p.destroy(r); err != nil {
		p.noteErr(err)
	}
}

// errDiscarded is returned by Discard of a handle already given back.
var errDiscarded = errors.New("bufpool: discard: buffer already released or discarded")

// Discard deregisters and frees the buffer now instead of keeping it for
// reuse: for memory a connection gives back for good (the small buffers
// after an enlargement, with conn.WithFreeSmallOnEnlarge).
func (b *Buffer) Discard() error {
	p := b.p
	if b.done.Swap(true) {
		p.doubles.Add(1)
		return errDiscarded
	}
	p.mu.Lock()
	p.takeBackLocked(b.r)
	p.mu.Unlock()
	return p.destroy(b.r)
}
