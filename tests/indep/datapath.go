package indep

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"runtime"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Imm is the 32-bit immediate of section 4.1.
type Imm struct {
	Kind    uint8  // bits 31-29
	Ring    uint8  // bit 28
	Credits uint8  // bits 27-20
	Length  uint32 // bits 19-0
}

// Message kinds (section 4.1).
const (
	kindSmall   = 0
	kindLarge   = 1
	kindCredit  = 2
	kindEOF     = 3
	kindControl = 4
	kindReadEnd = 5
	kindClose   = 6
	kindRecordL = 7
)

// Encode packs the immediate.
func (i Imm) Encode() uint32 {
	return uint32(i.Kind&7)<<29 | uint32(i.Ring&1)<<28 | uint32(i.Credits)<<20 | i.Length&0xfffff
}

// DecodeImm unpacks an immediate.
func DecodeImm(v uint32) Imm {
	return Imm{Kind: uint8(v >> 29), Ring: uint8(v>>28) & 1, Credits: uint8(v >> 20), Length: v & 0xfffff}
}

// errQPError is returned when the responder's QP is in the ERROR state.
var errQPError = errors.New("shm: responder QP in ERROR state")

// keyCheck finds the bytes [a, a+n) of the listener's memory region rkey
// for a remote write (section 3.3.7) and returns the arena mapping, the
// offset in it and the pin counter to release.
func (c *ShmConn) keyCheck(ctx context.Context, k uint32, a uint64, n uint64) (*mapping, uint64, *uint32, error) {
	index := uint64(k >> 8)
	if k == 0 || index >= mrEntries {
		return nil, 0, nil, fmt.Errorf("key check: rkey %#x out of range", k)
	}
	e := index * mrEntrySize
	type entry struct {
		key, pd, access          uint32
		addr, length, id, offset uint64
	}
	read := func() (entry, error) {
		for try := 0; try < 10000; try++ {
			s1 := atomic.LoadUint32(c.peerMR.u32(e))
			if s1&1 != 0 {
				runtime.Gosched()
				continue
			}
			v := entry{
				key:    atomic.LoadUint32(c.peerMR.u32(e + 4)),
				pd:     atomic.LoadUint32(c.peerMR.u32(e + 8)),
				access: atomic.LoadUint32(c.peerMR.u32(e + 12)),
				addr:   atomic.LoadUint64(c.peerMR.u64(e + 16)),
				length: atomic.LoadUint64(c.peerMR.u64(e + 24)),
				id:     atomic.LoadUint64(c.peerMR.u64(e + 32)),
				offset: atomic.LoadUint64(c.peerMR.u64(e + 40)),
			}
			if atomic.LoadUint32(c.peerMR.u32(e)) == s1 {
				return v, nil
			}
		}
		return entry{}, errors.New("key check: MR entry never stable")
	}
	v, err := read()
	if err != nil {
		return nil, 0, nil, err
	}
	if v.key != k || v.pd != c.Peer.PD || v.access&2 == 0 || a < v.addr || a+n > v.addr+v.length {
		return nil, 0, nil, fmt.Errorf("key check: entry %+v does not allow rkey %#x pd %d [%#x,+%d) remote write", v, k, c.Peer.PD, a, n)
	}
	arena, err := c.arena(ctx, v.id, k)
	if err != nil {
		return nil, 0, nil, err
	}
	off := v.offset + (a - v.addr)
	if off+n > uint64(arena.size) {
		return nil, 0, nil, fmt.Errorf("key check: [%d,+%d) beyond arena of %d bytes", off, n, arena.size)
	}
	pins := c.peerMR.u32(e + 48)
	atomic.AddUint32(pins, 1)
	v2, err := read()
	if err != nil || v2 != v {
		atomic.AddUint32(pins, ^uint32(0))
		return nil, 0, nil, fmt.Errorf("key check: entry changed while pinning")
	}
	return arena, off, pins, nil
}

// arena returns the listener's arena memfd_id, asking with memreq.
func (c *ShmConn) arena(ctx context.Context, id uint64, rkey uint32) (*mapping, error) {
	c.mu.Lock()
	m := c.arenas[id]
	c.reqNum++
	req := c.reqNum
	c.mu.Unlock()
	if m != nil {
		return m, nil
	}
	msg := []byte{msgMemreq}
	msg = binary.LittleEndian.AppendUint64(msg, req)
	msg = binary.LittleEndian.AppendUint64(msg, id)
	msg = binary.LittleEndian.AppendUint32(msg, rkey)
	if _, _, err := c.sock.WriteMsgUnix(msg, nil, nil); err != nil {
		return nil, fmt.Errorf("memreq: %w", err)
	}
	timeout := time.NewTimer(5 * time.Second)
	defer timeout.Stop()
	for {
		select {
		case r := <-c.memreps:
			if r.req != req {
				if r.fd >= 0 {
					unix.Close(r.fd)
				}
				continue
			}
			if !r.ok || r.fd < 0 {
				return nil, fmt.Errorf("memrep: arena %d refused (ok %v)", id, r.ok)
			}
			m, err := mapReceived(r.fd, 1)
			if err != nil {
				return nil, fmt.Errorf("memrep arena %d: %w", id, err)
			}
			c.mu.Lock()
			c.arenas[id] = m
			c.mu.Unlock()
			return m, nil
		case <-timeout.C:
			return nil, fmt.Errorf("memreq %d for arena %d: no memrep within 5 s", req, id)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-c.closed:
			return nil, errors.New("memreq: socket closed")
		}
	}
}

// writeImm performs an RDMA WRITE WITH IMMEDIATE into the listener
// (section 3.3.9).
func (c *ShmConn) writeImm(ctx context.Context, a uint64, k uint32, p []byte, imm uint32) error {
	q := c.Peer
	ro, co := q.RingOff, q.CQOff
	// 1. The responder's state.
	if atomic.LoadUint32(c.peerRing.u32(ro)) == qpStateErr {
		return errQPError
	}
	// 2. Claim a receive.
	var slot uint64
	for {
		cl := atomic.LoadUint64(c.peerRing.u64(ro + 16))
		po := atomic.LoadUint64(c.peerRing.u64(ro + 8))
		if cl >= po {
			select {
			case <-ctx.Done():
				return fmt.Errorf("receiver not ready (claimed %d, posted %d): %w", cl, po, ctx.Err())
			case <-time.After(time.Millisecond):
			}
			continue
		}
		if po-cl > uint64(q.RecvCap) {
			return fmt.Errorf("responder ring corrupt: posted %d claimed %d cap %d", po, cl, q.RecvCap)
		}
		if atomic.CompareAndSwapUint64(c.peerRing.u64(ro+16), cl, cl+1) {
			slot = cl
			break
		}
	}
	// 3. Key check and copy.
	if len(p) > 0 {
		arena, off, pins, err := c.keyCheck(ctx, k, a, uint64(len(p)))
		if err != nil {
			// 5. Complete the claimed slot with REM_ACCESS_ERR and fail.
			c.complete(slot, 10|3<<8, 0, 0)
			atomic.StoreUint32(c.peerRing.u32(ro), qpStateErr)
			c.sock.WriteMsgUnix([]byte{msgErrnote}, nil, nil)
			return err
		}
		copy(arena.mem[off:off+uint64(len(p))], p)
		atomic.AddUint32(pins, ^uint32(0))
	}
	// 4. Deliver.
	if cnt := atomic.AddUint64(c.peerCQ.u64(co+8), 1); cnt > uint64(q.CQCap) {
		atomic.StoreUint32(c.peerCQ.u32(co+4), 1)
		atomic.StoreUint32(c.peerRing.u32(ro), qpStateErr)
		c.sock.WriteMsgUnix([]byte{msgErrnote}, nil, nil)
		return fmt.Errorf("responder CQ overflow (%d > %d)", cnt, q.CQCap)
	}
	c.complete(slot, 0|4<<8|1<<16, uint32(len(p)), imm)
	if atomic.CompareAndSwapUint32(c.peerCQ.u32(co), 1, 0) {
		if _, _, err := c.sock.WriteMsgUnix([]byte{msgWake}, nil, nil); err != nil {
			return fmt.Errorf("wake: %w", err)
		}
	}
	return nil
}

func (c *ShmConn) complete(n uint64, kind, byteLen, imm uint32) {
	q := c.Peer
	s := q.RingOff + ringHdr + (n%uint64(q.RecvCap))*recvSlotSize(q.RecvSGE)
	atomic.StoreUint32(c.peerRing.u32(s+12), kind)
	atomic.StoreUint32(c.peerRing.u32(s+16), byteLen)
	atomic.StoreUint32(c.peerRing.u32(s+20), imm)
	atomic.StoreUint64(c.peerRing.u64(s), n+1)
}

// Send writes p as one small data message (kind 0) into the listener's
// small ring (sections 4.1, 4.4), returning owed credits in its immediate.
func (c *ShmConn) Send(ctx context.Context, p []byte) error {
	h := c.PeerHello
	if len(p) == 0 || len(p) > int(h.SlotSize) {
		return fmt.Errorf("data message of %d bytes, slot size %d", len(p), h.SlotSize)
	}
	if c.credits < 2 {
		return fmt.Errorf("credit stall: %d credits (reserve rule)", c.credits)
	}
	a := h.RingAddr + (c.sentSmall%uint64(h.SlotCount))*uint64(h.SlotSize)
	imm := Imm{Kind: kindSmall, Credits: c.takeOwed(), Length: uint32(len(p))}
	if err := c.writeImm(ctx, a, h.RingRkey, p, imm.Encode()); err != nil {
		return err
	}
	c.sentSmall++
	c.credits--
	return nil
}

func (c *ShmConn) takeOwed() uint8 {
	n := min(c.owed, 255)
	c.owed -= n
	return uint8(n)
}

// SendZero sends a zero-length message (credit, EOF, close).
func (c *ShmConn) SendZero(ctx context.Context, kind uint8, length uint32) error {
	imm := Imm{Kind: kind, Credits: c.takeOwed(), Length: length}
	return c.writeImm(ctx, c.PeerHello.RingAddr, c.PeerHello.RingRkey, nil, imm.Encode())
}

// Received is one message taken from our receive queue.
type Received struct {
	Imm     Imm
	Status  uint32
	Opcode  uint32
	ByteLen uint32
	Payload []byte
}

// Recv waits for the next completion in our QP ring and, for a small data
// message, reads its payload from our small ring.
func (c *ShmConn) Recv(ctx context.Context) (*Received, error) {
	capN := uint64(c.qp.RecvCap)
	for {
		s := c.ringOff + ringHdr + (c.polled%capN)*recvSlotSize(1)
		if atomic.LoadUint64(c.qpRing.u64(s)) == c.polled+1 {
			kind := atomic.LoadUint32(c.qpRing.u32(s + 12))
			r := &Received{
				Status: kind & 0xff, Opcode: (kind >> 8) & 0xff,
				Imm:     DecodeImm(atomic.LoadUint32(c.qpRing.u32(s + 20))),
				ByteLen: atomic.LoadUint32(c.qpRing.u32(s + 16)),
			}
			c.polled++
			atomic.StoreUint64(c.qpRing.u64(c.ringOff+24), c.polled)
			atomic.AddUint64(c.cq.u64(c.cqOff+8), ^uint64(0))
			// Re-post the receive (nsge 0).
			*c.qpRing.u32(s + 8) = 0
			atomic.AddUint64(c.qpRing.u64(c.ringOff+8), 1)
			if r.Status != 0 {
				return r, fmt.Errorf("completion status %d", r.Status)
			}
			if kind>>16&1 == 0 {
				return r, fmt.Errorf("completion without immediate (kind %#x)", kind)
			}
			if r.Imm.Ring == 0 {
				c.credits += int(r.Imm.Credits)
			} else {
				c.largeCredits += int(r.Imm.Credits)
			}
			if r.Imm.Kind == kindSmall || r.Imm.Kind == kindControl {
				h := c.hello
				if r.Imm.Length == 0 || r.Imm.Length > h.SlotSize {
					return r, fmt.Errorf("data message length %d", r.Imm.Length)
				}
				off := (c.recvSmall % uint64(h.SlotCount)) * uint64(h.SlotSize)
				r.Payload = append([]byte(nil), c.ring.mem[off:off+uint64(r.Imm.Length)]...)
				c.recvSmall++
				c.owed++
			}
			return r, nil
		}
		if atomic.LoadUint32(c.qpRing.u32(c.ringOff)) == qpStateErr {
			return nil, errQPError
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Microsecond):
		}
	}
}

// Record is a 49-byte control record (section 4.3).
type Record struct {
	Type  uint8
	Seq   uint32
	Addr  uint64
	Rkey  uint32
	Size  uint32
	Count uint32
	Addr2 uint64
	Rkey2 uint32
}

// Record types.
const (
	recRequest   = 1
	recAck       = 2
	recRefuse    = 3
	recAdvert    = 4
	recRead      = 5
	recShrink    = 6
	recShrinkAsk = 7
	recordLen    = 49
	recordHead   = 0x454e4c47
	recordTail   = 0x21444e45
)

// Encode frames the record.
func (r Record) Encode() []byte {
	be := binary.BigEndian
	b := be.AppendUint32(nil, recordHead)
	b = append(b, r.Type)
	b = be.AppendUint32(b, r.Seq)
	b = be.AppendUint64(b, r.Addr)
	b = be.AppendUint32(b, r.Rkey)
	b = be.AppendUint32(b, r.Size)
	b = be.AppendUint32(b, r.Count)
	b = be.AppendUint64(b, r.Addr2)
	b = be.AppendUint32(b, r.Rkey2)
	b = be.AppendUint32(b, crc32.ChecksumIEEE(b))
	return be.AppendUint32(b, recordTail)
}

// DecodeRecord checks the framing (head, tail, crc) and unpacks.
func DecodeRecord(b []byte) (Record, error) {
	be := binary.BigEndian
	if len(b) != recordLen {
		return Record{}, fmt.Errorf("record of %d bytes", len(b))
	}
	if be.Uint32(b) != recordHead || be.Uint32(b[45:]) != recordTail || be.Uint32(b[41:]) != crc32.ChecksumIEEE(b[:41]) {
		return Record{}, fmt.Errorf("torn record %x", b)
	}
	return Record{
		Type: b[4], Seq: be.Uint32(b[5:]), Addr: be.Uint64(b[9:]), Rkey: be.Uint32(b[17:]),
		Size: be.Uint32(b[21:]), Count: be.Uint32(b[25:]), Addr2: be.Uint64(b[29:]), Rkey2: be.Uint32(b[37:]),
	}, nil
}

// SendRaw writes one message with a payload into the listener's small ring
// (large false) or large ring (large true), without the reserve rule:
// tests use it to break the protocol on purpose.
func (c *ShmConn) SendRaw(ctx context.Context, kind uint8, payload []byte, large bool) error {
	var a uint64
	var k uint32
	if large {
		if c.largeCount == 0 {
			return errors.New("no large ring")
		}
		a = c.largeAddr + (c.sentLarge%uint64(c.largeCount))*uint64(c.largeSize)
		k = c.largeRkey
	} else {
		h := c.PeerHello
		a = h.RingAddr + (c.sentSmall%uint64(h.SlotCount))*uint64(h.SlotSize)
		k = h.RingRkey
	}
	imm := Imm{Kind: kind, Credits: c.takeOwed(), Length: uint32(len(payload))}
	if err := c.writeImm(ctx, a, k, payload, imm.Encode()); err != nil {
		return err
	}
	if large {
		c.sentLarge++
		c.largeCredits--
	} else {
		c.sentSmall++
		c.credits--
	}
	return nil
}

// SendRecord sends a record into the small ring (kind 4) or the large ring
// (kind 7), keeping two credits in reserve as 4.4 says.
func (c *ShmConn) SendRecord(ctx context.Context, r Record, large bool) error {
	cr, kind := c.credits, uint8(kindControl)
	if large {
		cr, kind = c.largeCredits, kindRecordL
	}
	if cr < 2 {
		return fmt.Errorf("record: %d credits, the reserve rule wants 2", cr)
	}
	return c.SendRaw(ctx, kind, r.Encode(), large)
}

// UseLargeRing records an acknowledgement's large ring (4.4, 4.6.1).
func (c *ShmConn) UseLargeRing(ack Record) {
	c.largeAddr, c.largeRkey, c.largeSize, c.largeCount = ack.Addr, ack.Rkey, ack.Size, ack.Count
	c.sentLarge, c.largeCredits = 0, int(ack.Count)
}

// SendLarge writes p as one large data message (kind 1).
func (c *ShmConn) SendLarge(ctx context.Context, p []byte) error {
	if len(p) == 0 || len(p) > int(c.largeSize) {
		return fmt.Errorf("large data message of %d bytes, slot size %d", len(p), c.largeSize)
	}
	if c.largeCredits < 2 {
		return fmt.Errorf("credit stall in the large ring: %d credits", c.largeCredits)
	}
	return c.SendRaw(ctx, kindLarge, p, true)
}

// Credits returns the credits held for the small and the large ring.
func (c *ShmConn) Credits() (small, large int) { return c.credits, c.largeCredits }
