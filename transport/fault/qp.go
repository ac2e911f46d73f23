package fault

import (
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// recvTag marks the wrapper's id of a receive request: an error
// completion's opcode is undefined, and one CQ may serve both queues.
const recvTag = 1 << 63

// sendEntry is one posted send request as the caller posted it.
type sendEntry struct {
	seq     uint64
	wr      transport.SendWR // the caller's request, SG cloned
	length  uint32
	drop    bool
	status  transport.Status // injected at post (ActStatus), 0 = none
	stage   *stageBuf
	corrupt *rule // READ: corrupt the landed bytes at completion
}

type recvEntry struct {
	seq uint64
	wr  transport.RecvWR // SG cloned
}

type qp struct {
	dev      *device
	inner    transport.QP
	num      uint32
	pd       *pd
	scq, rcq *cq

	sendMu  sync.Mutex
	sendSeq uint64
	sendQ   []*sendEntry // posted, completion not yet polled, in order

	recvMu  sync.Mutex
	recvSeq uint64
	recvQ   []*recvEntry

	// failed is set when an error status was injected at completion time:
	// later successful completions of this QP are reported as flushed,
	// since a NIC would have flushed them.
	failed atomic.Bool
	// postFailed is set when an error status was injected at post time:
	// the QP is in ERROR for the caller from then on; the inner QP is
	// moved there when that completion is polled, so that the requests
	// before it still complete normally.
	postFailed  atomic.Bool
	closed      atomic.Bool
	sendDrained atomic.Bool
	recvDrained atomic.Bool
}

func (q *qp) Num() uint32 { return q.num }
func (q *qp) State() transport.QPState {
	if q.postFailed.Load() {
		return transport.QPSErr
	}
	return q.inner.State()
}
func (q *qp) SetError() error               { return q.inner.SetError() }
func (q *qp) LocalAddr() net.Addr           { return q.inner.LocalAddr() }
func (q *qp) RemoteAddr() net.Addr          { return q.inner.RemoteAddr() }
func (q *qp) PeerPrivate() []byte           { return q.inner.PeerPrivate() }
func (q *qp) Disconnected() <-chan struct{} { return q.inner.Disconnected() }
func (q *qp) Disconnect() error             { return q.inner.Disconnect() }

func (q *qp) Close() error {
	err := q.inner.Close()
	if !q.closed.Swap(true) {
		q.scq.closedQPs.Add(1)
		q.rcq.closedQPs.Add(1)
		q.dev.closed.Add(1)
		q.dev.inj.live.qps.Add(-1)
	}
	// The inner QP is destroyed: no copy is read any more.
	q.sendMu.Lock()
	for _, e := range q.sendQ {
		q.pd.stage.put(e.stage)
		e.stage = nil
	}
	q.sendMu.Unlock()
	return err
}

func sgLen(sg []transport.SGE) int {
	n := 0
	for _, s := range sg {
		n += int(s.Length)
	}
	return n
}

func (q *qp) PostSend(wrs ...transport.SendWR) (int, error) {
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	for i := range wrs {
		if err := q.postSend(&wrs[i]); err != nil {
			return i, err
		}
	}
	return len(wrs), nil
}

func (q *qp) postSend(wr *transport.SendWR) error {
	ev := Event{
		Op: OpPostSend, Device: q.dev.inner.Name(), QPNum: q.num, Len: sgLen(wr.SG) + len(wr.Data), Send: wr,
		corruptible: true,
	}
	if wr.Opcode != transport.OpRead {
		ev.payload = func() []byte { return q.payload(wr) }
	}
	d := q.dev.inj.decide(&ev)
	if d.qpErr != nil {
		if err := q.inner.SetError(); err != nil {
			return fmt.Errorf("fault: rule %q: %w", d.qpErr.Name, err)
		}
	}
	e := &sendEntry{seq: q.sendSeq, wr: *wr, length: uint32(ev.Len)}
	e.wr.SG = slices.Clone(wr.SG)
	e.wr.Data = nil // copied at post: not ours to keep
	post := *wr
	post.ID = e.seq
	// A replacement keeps the queue's order: a zero-length RDMA WRITE
	// needs no remote key and touches no memory on either side.
	substitute := transport.SendWR{ID: e.seq, Opcode: transport.OpWrite, Signaled: wr.Signaled}
	switch {
	case d.status != nil:
		e.status = d.status.Status
		post = substitute
		post.Signaled = true // an error completion is always generated
		q.postFailed.Store(true)
	case q.postFailed.Load():
		// Behind an injected failure nothing executes: the NIC would
		// have flushed it, signaled or not.
		e.status = transport.StatusWRFlushErr
		post = substitute
		post.Signaled = true
	case d.drop != nil:
		e.drop = true
		post = substitute
	case d.corrupt != nil && wr.Opcode == transport.OpRead:
		e.corrupt = d.corrupt
	case d.corrupt != nil:
		b, err := q.stageCorrupt(wr, ev.Len, d.corrupt)
		if err != nil {
			return err
		}
		e.stage = b
		post.SG = []transport.SGE{{Addr: b.mr.Addr(), Length: uint32(ev.Len), LKey: b.mr.LKey()}}
		post.Inline, post.Data = false, nil
	}
	q.sendSeq++
	q.sendQ = append(q.sendQ, e)
	if _, err := q.inner.PostSend(post); err != nil {
		q.sendQ = q.sendQ[:len(q.sendQ)-1]
		q.sendSeq--
		q.pd.stage.put(e.stage)
		return err
	}
	return nil
}

// gather copies out what a send request sends, or returns nil if part of
// it is not in memory registered through this provider.
func (q *qp) gather(sg []transport.SGE) []byte {
	segs, ok := q.pd.segments(sg)
	if !ok {
		return nil
	}
	var out []byte
	for _, s := range segs {
		out = append(out, s...)
	}
	return out
}

// payload is what a send request sends: its inline Data, or a copy of
// its gather list (nil if that is not in memory registered through us).
func (q *qp) payload(wr *transport.SendWR) []byte {
	if wr.Data != nil {
		return slices.Clone(wr.Data)
	}
	return q.gather(wr.SG)
}

// stageCorrupt copies wr's payload into staging memory and flips the bits.
func (q *qp) stageCorrupt(wr *transport.SendWR, n int, r *rule) (*stageBuf, error) {
	data := q.payload(wr)
	if len(data) != n {
		return nil, fmt.Errorf("fault: rule %q: cannot corrupt a copy of work request %d: its memory was not registered through this provider: %w", r.Name, wr.ID, transport.ErrInvalidWR)
	}
	b, err := q.pd.stage.get(q.dev.inner, q.pd.inner, n)
	if err != nil {
		return nil, fmt.Errorf("fault: rule %q: %w", r.Name, err)
	}
	copy(b.mem, data)
	flip(b.mem[:n], r)
	return b, nil
}

// flip applies a corruption rule to the payload p.
func flip(p []byte, r *rule) {
	off, ok := offsetIn(r.Offset, len(p))
	if !ok {
		return
	}
	mask := r.Mask
	if mask == 0 {
		mask = 0xff
	}
	p[off] ^= mask
}

// flipSegs applies a corruption rule to a payload scattered over segs
// (n bytes landed).
func flipSegs(segs [][]byte, n int, r *rule) {
	off, ok := offsetIn(r.Offset, n)
	if !ok {
		return
	}
	mask := r.Mask
	if mask == 0 {
		mask = 0xff
	}
	for _, s := range segs {
		if off < len(s) {
			s[off] ^= mask
			return
		}
		off -= len(s)
	}
}

func (q *qp) PostRecv(wrs ...transport.RecvWR) (int, error) {
	q.recvMu.Lock()
	defer q.recvMu.Unlock()
	for i := range wrs {
		wr := &wrs[i]
		ev := Event{Op: OpPostRecv, Device: q.dev.inner.Name(), QPNum: q.num, Len: sgLen(wr.SG), Recv: wr}
		if d := q.dev.inj.decide(&ev); d.qpErr != nil {
			if err := q.inner.SetError(); err != nil {
				return i, fmt.Errorf("fault: rule %q: %w", d.qpErr.Name, err)
			}
		}
		e := &recvEntry{seq: q.recvSeq, wr: *wr}
		e.wr.SG = slices.Clone(wr.SG)
		post := *wr
		post.ID = e.seq | recvTag
		q.recvSeq++
		q.recvQ = append(q.recvQ, e)
		if _, err := q.inner.PostRecv(post); err != nil {
			q.recvQ = q.recvQ[:len(q.recvQ)-1]
			q.recvSeq--
			return i, err
		}
	}
	return len(wrs), nil
}

// popSend returns the entry a send completion with wrapper id seq is for.
// Entries before it were unsignaled and completed silently (completions
// of one send queue come in order).
func (q *qp) popSend(seq uint64) *sendEntry {
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	for i, e := range q.sendQ {
		if e.seq == seq {
			for _, done := range q.sendQ[:i] {
				q.pd.stage.put(done.stage)
				done.stage = nil
			}
			clear(q.sendQ[:i+1])
			q.sendQ = q.sendQ[i+1:]
			return e
		}
	}
	return nil
}

func (q *qp) popRecv(seq uint64) *recvEntry {
	q.recvMu.Lock()
	defer q.recvMu.Unlock()
	for i, e := range q.recvQ {
		if e.seq == seq {
			clear(q.recvQ[:i+1])
			q.recvQ = q.recvQ[i+1:]
			return e
		}
	}
	return nil
}
