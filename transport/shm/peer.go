package shm

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// peer is what a requester knows of the other side of its connection: the
// peer device's MR table, the peer QP's receive ring and state, the peer's
// receive CQ header and eventfd, and the peer memfds mapped so far. All of
// it is the peer's memory: every value read from it is checked before use.
type peer struct {
	num, pd uint32
	mrt     mrTable
	ring    ring
	cq      cqHeader
	cqCap   int
	efd     int
	maps    map[uint64][]byte // memfd id → our mapping (guarded by the QP's sendMu)
}

// newPeer maps the fds received with a connect or accept message
// (MR table, QP segment, receive CQ header, eventfd). It takes ownership
// of fds.
func newPeer(info qpInfo, fds []int) (*peer, error) {
	if len(fds) != infoFDs {
		closeFDs(fds)
		return nil, fmt.Errorf("shm: peer sent %d fds, want %d", len(fds), infoFDs)
	}
	defer closeFDs(fds[:3])
	p := &peer{num: info.num, pd: info.pd, cqCap: int(info.cqCap), efd: fds[3], maps: map[uint64][]byte{}}
	mrt, err := mapFD(fds[0], mrTableSize)
	if err != nil {
		unix.Close(p.efd)
		return nil, fmt.Errorf("shm: map peer MR table: %w", err)
	}
	p.mrt = mrTable(mrt)
	rq, err := mapFD(fds[1], qpSegSize(int(info.recvCap), int(info.recvSGE)))
	if err != nil {
		p.unmap()
		return nil, fmt.Errorf("shm: map peer QP: %w", err)
	}
	p.ring = newRing(rq, int(info.recvCap), int(info.recvSGE))
	cqm, err := mapFD(fds[2], cqHdrSize)
	if err != nil {
		p.unmap()
		return nil, fmt.Errorf("shm: map peer CQ: %w", err)
	}
	p.cq = cqHeader(cqm)
	return p, nil
}

func (p *peer) unmap() {
	for _, m := range [][]byte{p.mrt, p.ring.mem, p.cq} {
		if m != nil {
			unix.Munmap(m)
		}
	}
	for _, m := range p.maps {
		unix.Munmap(m)
	}
	p.mrt, p.ring.mem, p.cq, p.maps = nil, nil, nil, nil
	if p.efd >= 0 {
		unix.Close(p.efd)
		p.efd = -1
	}
}

// sweepAt is the number of cached peer mappings above which a new fetch
// first drops the mappings no valid peer MR refers to any more (memory the
// peer deregistered and probably freed), so that a long connection whose
// peer keeps reallocating buffers does not pin all of them.
const sweepAt = 32

// sweep unmaps cached memfds that no valid entry of the peer's MR table
// names. Called with the QP's sendMu held: nothing is copying meanwhile.
func (p *peer) sweep() {
	live := make(map[uint64]bool, len(p.maps))
	for idx := range mrEntries {
		off := idx * mrEntrySize
		if atomic.LoadUint32(word32(p.mrt, off+mrKey)) != 0 {
			live[atomic.LoadUint64(word64(p.mrt, off+mrMemfdID))] = true
		}
	}
	for id, m := range p.maps {
		if !live[id] {
			unix.Munmap(m)
			delete(p.maps, id)
		}
	}
}

// reader serves the connection's unix socket until the peer goes away.
func (q *qp) reader() {
	defer q.wg.Done()
	buf := make([]byte, maxMsg)
	oob := make([]byte, unix.CmsgSpace(4*infoFDs))
	for {
		b, fds, err := readMsg(q.conn, buf, oob)
		if err != nil {
			q.hangup()
			return
		}
		switch b[0] {
		case msgMemReq:
			closeFDs(fds)
			q.serveMemReq(b)
		case msgMemRep:
			q.deliverMemRep(b, fds)
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
			return
		default:
			closeFDs(fds)
		}
	}
}

// serveMemReq hands the peer the memfd behind one of our MRs, but only for
// an MR that is valid for this connection (same PD as our QP): a peer must
// never reach memory it was not granted.
func (q *qp) serveMemReq(b []byte) {
	if len(b) < 21 {
		return
	}
	req := le64(b[1:])
	id := le64(b[9:])
	key := le32(b[17:])
	m := q.dev.mrs.lookupLocal(key)
	if m == nil || m.pd != q.pd || m.alloc.id != id {
		writeMsg(q.conn, encodeMemRep(req, false))
		return
	}
	fd, err := dupAllocFD(id)
	if err != nil {
		writeMsg(q.conn, encodeMemRep(req, false))
		return
	}
	writeMsg(q.conn, encodeMemRep(req, true), fd)
	unix.Close(fd)
}

func (q *qp) deliverMemRep(b []byte, fds []int) {
	if len(b) < 10 {
		closeFDs(fds)
		return
	}
	r := memReply{req: le64(b[1:]), fd: -1}
	if b[9] == 1 && len(fds) == 1 {
		r.fd = fds[0]
	} else {
		closeFDs(fds)
	}
	select {
	case q.memRep <- r:
	default: // nobody waits for it any more
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
	}
}

var errMemfd = errors.New("shm: peer memory unavailable")

// peerMem returns our mapping of the memfd behind a peer MR, fetching it
// over the socket on first use. Called with sendMu held.
func (q *qp) peerMem(e *mrEntry) ([]byte, error) {
	if m, ok := q.peer.maps[e.memfdID]; ok {
		return m, nil
	}
	q.memReqID++
	req := q.memReqID
	// Drop a stale reply left by an earlier timed-out request.
	select {
	case r := <-q.memRep:
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
	default:
	}
	if err := writeMsg(q.conn, encodeMemReq(req, e.memfdID, e.key)); err != nil {
		return nil, fmt.Errorf("%w: request memfd: %v", errMemfd, err)
	}
	t := time.NewTimer(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case r := <-q.memRep:
			if r.req != req {
				if r.fd >= 0 {
					unix.Close(r.fd)
				}
				continue
			}
			if r.fd < 0 {
				return nil, fmt.Errorf("%w: peer refused memfd %d", errMemfd, e.memfdID)
			}
			mem, err := mapFD(r.fd, 1)
			unix.Close(r.fd)
			if err != nil {
				return nil, fmt.Errorf("%w: %v", errMemfd, err)
			}
			if len(q.peer.maps) >= sweepAt {
				q.peer.sweep()
			}
			q.peer.maps[e.memfdID] = mem
			return mem, nil
		case <-q.hup:
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

func le32(b []byte) uint32 {
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

func dupFD(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }
