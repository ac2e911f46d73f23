package conn

import (
	"fmt"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Selective signalling. A data message into a large ring from staging
// (verbs) asks for a completion once every signalShare-th of the staging
// slots, and when it fills the staging; the others are posted unsignalled,
// and the next signalled completion confirms them, since a send queue
// completes in order. perftest signals every Nth write the same way. On a
// device each completion is a CQE written and polled, and, while the
// queue is armed (the writer's loop asleep between writes), an event and
// a wake-up: in the rxe guest, a 32 KiB stream made one such wake-up per
// message. Small rings, whose writes are few and latency-bound, and
// inline sends (shm: complete at the post) signal every message.
//
// The writer waits for staging (write) only after a post that filled it,
// which was signalled, so a completion always comes to free a slot. What
// waits for every write to complete (Close, a climb, the idle shrink)
// calls confirmLocked, which posts a signalled zero-length RDMA write
// behind messages left unsignalled.

// unsignaledPosts counts the data messages posted unsignalled (tests).
var unsignaledPosts atomic.Uint64

// signalShare: a large direction asks for one completion per quarter of
// its staging slots.
const signalShare = 4

// mustSignal says whether data message seq, posted now, asks for a
// completion.
func (t *txRing) mustSignal(seq uint64) bool {
	every := uint64(max(1, t.stageSlots/signalShare))
	return seq%every == every-1 || seq+1-t.done >= uint64(t.stageSlots)
}

// confirmLocked makes the large data messages posted unsignalled, with
// no signalled one after them, complete: it posts a zero-length RDMA
// write into the peer's ring, signalled, whose completion confirms them
// (the peer sees nothing of it: no immediate, no byte). c.mu and c.wmu
// are held: no write is being posted.
func (c *rdmaConn) confirmLocked() {
	t := &c.tx[large]
	if t.signaled >= t.seq || t.done >= t.seq || c.err != nil || c.posting {
		return
	}
	wr := transport.SendWR{ID: uint64(large)<<idRing | (t.seq - 1), Opcode: transport.OpWrite, Signaled: true,
		RemoteAddr: t.addr, RKey: t.rkey}
	if _, err := c.qp.PostSend(wr); err != nil {
		c.failLocked(fmt.Errorf("conn: post the write that confirms unsignalled ones: %w", err))
		return
	}
	t.signaled = t.seq
}
