package shm

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// peer is what a requester knows of the other side of its connection: the
// peer device's MR table, the peer QP's receive ring and state, the peer's
// receive CQ header, and the peer arenas mapped so far. All of it is the
// peer's memory: every value read from it is checked before use.
type peer struct {
	num, pd uint32
	mrt     mrTable
	ring    ring
	cq      cqHeader
	cqCap   int
	// localCQ is the peer's receive CQ when the peer is this very process:
	// its waiter is woken directly rather than through the socket.
	localCQ *cq
	held    []peerMapping // MR table, ring arena, CQ arena
	// maps are the peer's data arenas mapped for this QP (guarded by
	// the QP's sendMu): a list, as a connection maps one or two (at most
	// sweepAt before a sweep).
	maps []arenaMapping
}

// arenaMapping is a peer arena, by its id, and our mapping of it.
type arenaMapping struct {
	id uint64
	peerMapping
}

// add maps the arena of e for this QP with m, a reference of its own.
func (p *peer) add(e *mrEntry, m peerMapping) []byte {
	m.lastKey = e.key
	p.maps = append(p.maps, arenaMapping{e.memfdID, m})
	return m.mem
}

// arenaKey names a peer arena across the QPs of a device: the peer
// process's MR table (children keyed by uid hold several peer processes,
// whose arena ids may collide) and the arena's id in that process.
type arenaKey struct {
	table fileKey
	id    uint64
}

// maxKeptArenas is how many peer arenas a device keeps mapped for its
// next connections. A peer process carves its connections' rings and
// buffers from a few 64 MiB arenas, so a handful covers them; the oldest
// goes first.
const maxKeptArenas = 4

// kept is a peer mapping a device holds a reference on for its next QPs
// to the same peer process, under the name k it is looked up by.
type kept[K comparable] struct {
	key K
	m   peerMapping
}

// keep adds a reference on m, named k, to list unless k is there already,
// and gives back the oldest beyond limit. Held by the device, a mapping
// keeps its file mapped, so its inode (which may wrap) cannot name
// another file while k maps to it. Called with the device's arenaMu.
func keep[K comparable](list []kept[K], k K, m peerMapping, limit int) []kept[K] {
	if slices.ContainsFunc(list, func(a kept[K]) bool { return a.key == k }) {
		return list
	}
	list = append(list, kept[K]{k, m.retain()})
	if len(list) > limit {
		list[0].m.release()
		list = slices.Delete(list, 0, 1)
	}
	return list
}

// releaseKept gives back every mapping of list. Called with arenaMu.
func releaseKept[K comparable](list []kept[K]) {
	for i := range list {
		list[i].m.release()
	}
}

// knownArena is another reference on the mapping of arena k, if the
// device keeps it.
func (d *device) knownArena(k arenaKey) (peerMapping, bool) {
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	for _, a := range d.kept {
		if a.key == k {
			return a.m.retain(), true
		}
	}
	return peerMapping{}, false
}

// keepArena keeps a reference on m, the mapping of arena k, for the next
// connections to the same peer process. It is given back when the device
// goes (releaseArenas) or when newer arenas push it out.
func (d *device) keepArena(k arenaKey, m peerMapping) {
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	d.kept = keep(d.kept, k, m, maxKeptArenas)
}

// maxKeptCtl bounds the control mappings a device keeps: a peer process
// has one MR table and carves its rings and CQ headers from one control
// arena, rarely two.
const maxKeptCtl = 4

// keepCtl keeps a reference on the mappings p was handed at set-up (the
// peer's MR table and control arenas) for the next QPs to the same peer
// process. Without it the last connection's close unmapped them and the
// next set-up mapped them again and faulted their pages in: on each side,
// a connection dialed and closed in a loop spent 40 µs in munmap alone.
func (d *device) keepCtl(p *peer) {
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	for _, m := range p.held {
		d.keptCtl = keep(d.keptCtl, m.key, m, maxKeptCtl)
	}
}

// Control files by name. The MR table and control arenas a peer process
// hands over are the same for all its connections to this process (one
// child device each way), and a device keeps them mapped (keepCtl). So
// once both sides hold each other's, a set-up names them by inode
// instead of passing three descriptors each way (ctlNamed): a dup, a
// close, an fstat, a seal check and another close per descriptor, and
// the kernel's work of passing it, on each side. Only a child device of
// one peer process (not the uid-keyed one of peers in another PID
// namespace, which several processes share) resolves names, among the
// files that process handed over itself: a peer can name no memory but
// its own.

// handshakes counts how set-ups handed over control files (tests): sent
// as descriptors, named, named by the peer and found here, asked for.
var handshakes struct {
	fdsSent, named, resolved, asked atomic.Int64
}

// holdsAll reports whether held lists every inode of want.
func holdsAll(held, want []uint64) bool {
	for _, w := range want {
		if !slices.Contains(held, w) {
			return false
		}
	}
	return len(want) > 0
}

// namesCtl reports whether d resolves control files by name: it is the
// child device of one peer process.
func (d *device) namesCtl() bool { return d != nil && d.parent != nil && d.peer.pid != 0 }

// heldCtl lists the inodes of the peer's control files d keeps mapped,
// for the peer to name them (qpInfo.held); none unless d namesCtl.
func (d *device) heldCtl() []uint64 {
	if !d.namesCtl() {
		return nil
	}
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	ks := d.keptCtl[:min(len(d.keptCtl), maxHeld)]
	held := make([]uint64, len(ks))
	for i, k := range ks {
		held[i] = k.key.ino
	}
	return held
}

// pinCtl takes a reference on each control mapping d keeps, so that the
// files a dialer lists as held stay mapped until the answer that may name
// them; unpin gives them back.
func (d *device) pinCtl() []kept[fileKey] {
	if !d.namesCtl() {
		return nil
	}
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	ks := d.keptCtl[:min(len(d.keptCtl), maxHeld)]
	pins := make([]kept[fileKey], len(ks))
	for i, k := range ks {
		pins[i] = kept[fileKey]{k.key, k.m.retain()}
	}
	return pins
}

// findCtl returns a reference on the mapping of each file named by
// inode in inos, from list, or false if one is missing or ambiguous.
func findCtl(list []kept[fileKey], inos []uint64) ([]peerMapping, bool) {
	maps := make([]peerMapping, 0, len(inos))
	for _, ino := range inos {
		found := -1
		for i, k := range list {
			if k.key.ino == ino {
				if found >= 0 {
					return nil, false // two files of that inode: neither
				}
				found = i
			}
		}
		if found < 0 {
			return nil, false
		}
		maps = append(maps, list[found].m)
	}
	for i := range maps {
		maps[i] = maps[i].retain()
	}
	handshakes.resolved.Add(1)
	return maps, true
}

// namedCtl returns references on the peer's control files named by
// inos, from those d keeps, or false.
func (d *device) namedCtl(inos []uint64) ([]peerMapping, bool) {
	if !d.namesCtl() {
		return nil, false
	}
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	return findCtl(d.keptCtl, inos)
}

// notePeerHolds records which of d's control files its peer process said
// it holds mapped (an accept's qpInfo.held), for the next connect.
func (d *device) notePeerHolds(held []uint64) {
	if !d.namesCtl() {
		return
	}
	d.arenaMu.Lock()
	d.peerHolds = slices.Clone(held)
	d.arenaMu.Unlock()
}

// peerHeld is what notePeerHolds recorded.
func (d *device) peerHeld() []uint64 {
	if !d.namesCtl() {
		return nil
	}
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	return d.peerHolds
}

func releaseMaps(maps []peerMapping) {
	for i := range maps {
		maps[i].release()
	}
}

// releaseArenas gives back the peer arenas and control mappings the
// device kept.
func (d *device) releaseArenas() {
	d.arenaMu.Lock()
	defer d.arenaMu.Unlock()
	releaseKept(d.kept)
	releaseKept(d.keptCtl)
	d.kept, d.keptCtl = nil, nil
}

// newPeer maps the fds received with a connect or accept message (MR
// table, the arena of the QP ring, the arena of the receive CQ header) and
// takes ownership of them. sameProcess says the socket's other end is
// this process (SO_PEERCRED).
func newPeer(info qpInfo, fds []int, sameProcess bool) (*peer, error) {
	if len(fds) != infoFDs {
		closeFDs(fds)
		return nil, fmt.Errorf("shm: peer sent %d fds, want %d", len(fds), infoFDs)
	}
	maps := make([]peerMapping, 0, infoFDs)
	for i, fd := range fds {
		m, err := mapPeer(fd, 1)
		if err != nil {
			closeFDs(fds[i+1:])
			releaseMaps(maps)
			return nil, fmt.Errorf("shm: map peer memory %d of %d: %w", i+1, len(fds), err)
		}
		maps = append(maps, m)
	}
	return newPeerOf(info, maps, sameProcess)
}

// newPeerOf is newPeer with the files already mapped: maps, whose
// references it takes over, in the order of qpInfo.ctl.
func newPeerOf(info qpInfo, maps []peerMapping, sameProcess bool) (*peer, error) {
	if len(maps) != infoFDs {
		releaseMaps(maps)
		return nil, fmt.Errorf("shm: %d peer control files, want %d", len(maps), infoFDs)
	}
	p := &peer{num: info.num, pd: info.pd, cqCap: int(info.cqCap), held: maps}
	mrt, err := p.held[0].window(0, mrTableSize)
	if err != nil {
		p.unmap()
		return nil, fmt.Errorf("shm: peer MR table: %w", err)
	}
	p.mrt = mrTable(mrt)
	if info.ringOff%8 != 0 {
		p.unmap()
		return nil, fmt.Errorf("shm: peer QP ring: offset %d is not a multiple of 8", info.ringOff)
	}
	rq, err := p.held[1].window(info.ringOff, uint64(qpSegSize(int(info.recvCap), int(info.recvSGE))))
	if err != nil {
		p.unmap()
		return nil, fmt.Errorf("shm: peer QP ring: %w", err)
	}
	p.ring = newRing(rq, int(info.recvCap), int(info.recvSGE))
	if info.cqOff%8 != 0 {
		p.unmap()
		return nil, fmt.Errorf("shm: peer CQ header: offset %d is not a multiple of 8", info.cqOff)
	}
	cqm, err := p.held[2].window(info.cqOff, cqHdrSize)
	if err != nil {
		p.unmap()
		return nil, fmt.Errorf("shm: peer CQ header: %w", err)
	}
	p.cq = cqHeader(cqm)
	if sameProcess && info.token == procToken {
		p.localCQ = lookupCQ(info.cqID)
	}
	return p, nil
}

func (p *peer) unmap() {
	for i := range p.held {
		p.held[i].release()
	}
	for _, m := range p.maps {
		m.release()
	}
	p.held, p.maps = nil, nil
	p.mrt, p.ring.mem, p.cq = nil, nil, nil
}

// sweepAt is the number of cached peer mappings above which a request
// first drops the mappings no valid peer MR refers to any more (memory the
// peer deregistered and probably freed), so that a long connection whose
// peer keeps reallocating large buffers does not pin all of them.
const sweepAt = 32

// sweep drops the cached mappings whose last used key is no longer valid.
// A mapping dropped while another MR still names its arena is fetched
// again on next use. Reading the whole table instead would fault in all of
// its pages. Called with the QP's sendMu held, before a request pins
// anything.
func (p *peer) sweep() {
	p.maps = slices.DeleteFunc(p.maps, func(m arenaMapping) bool {
		if _, ok := p.mrt.lookup(m.lastKey); ok {
			return false
		}
		m.release()
		return true
	})
}

// readies counts the msgReady dialers sent (tests: a dialer sends none
// to a listener whose accept carries acceptNoReady).
var readies atomic.Uint64

// serveMsg serves one message from the peer's socket (on the socket
// poller's goroutine: it must not block) and reports whether more may
// follow.
func (q *qp) serveMsg(b []byte, fds []int) bool {
	switch b[0] {
	case msgMemReq:
		closeFDs(fds)
		q.serveMemReq(b)
	case msgMemRep:
		q.deliverMemRep(b, fds)
	case msgWake:
		closeFDs(fds)
		q.rcq.signal()
	case msgErrNote:
		closeFDs(fds)
		// The peer already moved our QP (or our CQ) to ERROR in
		// shared memory; flush and wake whoever waits.
		q.kick()
		q.rcq.checkOverflow()
		q.rcq.wake()
	case msgDisconnect:
		closeFDs(fds)
		q.hangup()
		return false
	case msgReady:
		closeFDs(fds)
		readies.Add(1)
	default:
		closeFDs(fds)
	}
	return true
}

// serveMemReq hands the peer the memfd behind one of our MRs, but only for
// an MR that is valid for this connection (same PD as our QP): a peer must
// never reach memory it was not granted.
func (q *qp) serveMemReq(b []byte) {
	req, id, key, ok := decodeMemReq(b)
	if !ok {
		return
	}
	m := q.dev.mrs.lookupLocal(key)
	if m == nil || m.pd != q.pd || m.alloc.arena.id != id {
		q.sock.send(encodeMemRep(req, false))
		return
	}
	fd, err := dupArenaFD(id)
	if err != nil {
		q.sock.send(encodeMemRep(req, false))
		return
	}
	q.sock.send(encodeMemRep(req, true), fd)
	unix.Close(fd)
}

func (q *qp) deliverMemRep(b []byte, fds []int) {
	req, granted, ok := decodeMemRep(b)
	if !ok {
		closeFDs(fds)
		return
	}
	r := memReply{req: req, fd: -1}
	if granted && len(fds) == 1 {
		r.fd = fds[0]
	} else {
		closeFDs(fds)
	}
	w := q.memW.Load()
	if w == nil { // nothing was asked
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
		return
	}
	select {
	case w.rep <- r:
	default: // nobody waits for it any more
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
	}
}

var errMemfd = errors.New("shm: peer memory unavailable")

// memfdRequests counts the memfds this process asked its peers for.
var memfdRequests atomic.Uint64

// peerMem returns our mapping of the arena behind a peer MR, fetching it
// over the socket on the connection's first use of it. Called with sendMu
// held.
func (q *qp) peerMem(e *mrEntry) ([]byte, error) {
	for i := range q.peer.maps {
		if m := &q.peer.maps[i]; m.id == e.memfdID {
			m.lastKey = e.key
			return m.mem, nil
		}
	}
	// Another connection to the same peer process may have it: the
	// arena is the same, and every access through it is checked against
	// the peer's MR table (key, PD, bounds, access) as a fetched one is.
	k := arenaKey{q.peer.held[0].key, e.memfdID}
	if m, ok := q.dev.knownArena(k); ok {
		return q.peer.add(e, m), nil
	}
	w := q.memW.Load()
	if w == nil {
		w = &memWait{rep: make(chan memReply, 1), hup: make(chan struct{})}
		q.memW.Store(w) // only here, with sendMu held
	}
	// hangup closes hup if it finds w, after it marked the peer gone; if
	// it came before w was made, hup stays open and only the mark tells
	// this request, or a later one of the same execute, not to wait.
	if q.peerGone.Load() {
		return nil, fmt.Errorf("%w: peer gone", errMemfd)
	}
	q.memReqID++
	req := q.memReqID
	// Drop a stale reply left by an earlier timed-out request.
	select {
	case r := <-w.rep:
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
	default:
	}
	memfdRequests.Add(1)
	if err := q.sock.send(encodeMemReq(req, e.memfdID, e.key)); err != nil {
		return nil, fmt.Errorf("%w: request memfd: %v", errMemfd, err)
	}
	t := time.NewTimer(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case r := <-w.rep:
			if r.req != req {
				if r.fd >= 0 {
					unix.Close(r.fd)
				}
				continue
			}
			if r.fd < 0 {
				return nil, fmt.Errorf("%w: peer refused memfd %d", errMemfd, e.memfdID)
			}
			m, err := mapPeer(r.fd, 1)
			if err != nil {
				return nil, fmt.Errorf("%w: %v", errMemfd, err)
			}
			q.dev.keepArena(k, m)
			return q.peer.add(e, m), nil
		case <-w.hup:
			return nil, fmt.Errorf("%w: peer gone", errMemfd)
		case <-t.C:
			return nil, fmt.Errorf("%w: peer did not answer a memfd request", errMemfd)
		}
	}
}

func le64(b []byte) uint64 {
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
		uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}

func dupFD(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }
