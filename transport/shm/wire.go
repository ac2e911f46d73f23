package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// Messages on a connection's unix socket (SOCK_SEQPACKET, so each read is
// one message). The data path never uses it. doc/protocol.md (§3.3.3)
// names them without the msg prefix, in lower case (connect, accept,
// reject, ready, memreq, memrep, errnote, disconnect, wake, needfds, fds),
// and qpInfo "QP info" (§3.3.5), with its fields in snake case
// (recv_cap for recvCap, held_count for len(held)).
const (
	msgConnect    = 1 // qpInfo + fds: MR table, arena of the QP ring, arena of the recv CQ header (none with ctlNamed)
	msgAccept     = 2 // same
	msgReject     = 3 // private data
	msgReady      = 4 // the connecting side has mapped everything (RTU); sent only to listeners whose accept lacks acceptNoReady, which wait for it
	msgMemReq     = 5 // req id, memfd id, rkey
	msgMemRep     = 6 // req id, ok; fd when ok
	msgErrNote    = 7 // "I moved your QP (or your CQ) to ERROR", wake up
	msgDisconnect = 8
	msgWake       = 9  // "your armed receive CQ has a completion"
	msgNeedFDs    = 10 // listener: "I no longer hold the files your connect named: send them"
	msgFDs        = 11 // dialer, in answer: the connect's fds

	wireVersion = 3 // 3: 40-byte receive slots (ring.go)
	maxMsg      = 256
	infoFDs     = 3
)

// Flags follow a connect or accept message's private data. A peer may
// send none and may ignore them (decodeInfo reads what it
// knows and no further), so a flag only ever skips a step both sides
// know to skip.
const (
	// acceptNoReady: the listener starts the connection when it sends
	// its accept and does not wait for msgReady, so the dialer need not
	// send it: one message, and one wake-up of the listener's process,
	// less per connection.
	acceptNoReady = 1 << 0
	// ctlNamed: the sender's MR table and control arenas come named by
	// their inode numbers (qpInfo.ctl), not as descriptors, because the
	// receiver said it holds them mapped (qpInfo.held). Set by a
	// listener only when its dialer's connect listed them; by a dialer
	// when the listener's last accept did, and then the listener may
	// answer msgNeedFDs (it dropped them since).
	ctlNamed = 1 << 1
)

// maxHeld bounds the inode numbers a message lists in qpInfo.held.
const maxHeld = 8

var errShortMsg = errors.New("shm: short or malformed control message")

// errRightsCut: the kernel delivered a message without all of its
// descriptors (MSG_CTRUNC) and with fewer than the buffer holds: the
// receiving process is out of descriptors (RLIMIT_NOFILE; each connection
// request waiting to be set up holds its socket and the three memfds that
// came with it, unless it named them: ctlNamed). errTooManyRights: the buffer filled, so the sender
// passed more than a message carries.
var (
	errRightsCut     = errors.New("shm: out of file descriptors (RLIMIT_NOFILE): a control message's descriptors were cut off")
	errTooManyRights = errors.New("shm: the peer passed more descriptors than a control message carries")
)

// qpInfo is what each side tells the other about its QP at set-up.
type qpInfo struct {
	num, pd          uint32
	recvCap, recvSGE uint32
	cqCap            uint32
	ringOff, cqOff   uint64 // places of the ring and the CQ header in their arenas
	cqID, token      uint64 // the CQ and the process, for waking it in-process
	addr             netip.AddrPort
	private          []byte
	flags            byte // after the private data: see acceptNoReady
	// After the flags (a peer may send neither): held
	// lists the inode numbers of the receiver's control files the sender
	// keeps mapped; ctl, with ctlNamed, names the sender's own (MR
	// table, arena of the QP ring, arena of the receive CQ header).
	held []uint64
	ctl  [infoFDs]uint64
}

func (m *qpInfo) encode(typ byte) []byte {
	b := append(make([]byte, 0, maxMsg), typ, wireVersion)
	b = binary.LittleEndian.AppendUint32(b, m.num)
	b = binary.LittleEndian.AppendUint32(b, m.pd)
	b = binary.LittleEndian.AppendUint32(b, m.recvCap)
	b = binary.LittleEndian.AppendUint32(b, m.recvSGE)
	b = binary.LittleEndian.AppendUint32(b, m.cqCap)
	for _, v := range []uint64{m.ringOff, m.cqOff, m.cqID, m.token} {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	ip := m.addr.Addr().As16()
	b = append(b, ip[:]...)
	b = binary.LittleEndian.AppendUint16(b, m.addr.Port())
	b = append(b, byte(len(m.private)))
	b = append(b, m.private...)
	b = append(b, m.flags, byte(len(m.held)))
	for _, v := range m.held {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	if m.flags&ctlNamed != 0 {
		for _, v := range m.ctl {
			b = binary.LittleEndian.AppendUint64(b, v)
		}
	}
	return b
}

func decodeInfo(b []byte) (qpInfo, error) {
	const fixed = 2 + 5*4 + 4*8 + 16 + 2 + 1
	if len(b) < fixed || b[1] != wireVersion {
		return qpInfo{}, errShortMsg
	}
	le := binary.LittleEndian
	m := qpInfo{
		num:     le.Uint32(b[2:]),
		pd:      le.Uint32(b[6:]),
		recvCap: le.Uint32(b[10:]),
		recvSGE: le.Uint32(b[14:]),
		cqCap:   le.Uint32(b[18:]),
		ringOff: le.Uint64(b[22:]),
		cqOff:   le.Uint64(b[30:]),
		cqID:    le.Uint64(b[38:]),
		token:   le.Uint64(b[46:]),
	}
	ip := netip.AddrFrom16([16]byte(b[54:70])).Unmap()
	m.addr = netip.AddrPortFrom(ip, le.Uint16(b[70:]))
	n := int(b[72])
	if len(b) < fixed+n || n > maxPrivate {
		return qpInfo{}, errShortMsg
	}
	m.private = append([]byte(nil), b[fixed:fixed+n]...)
	rest := b[fixed+n:]
	if len(rest) > 0 {
		m.flags, rest = rest[0], rest[1:]
	}
	if len(rest) > 0 {
		k := int(rest[0])
		if k > maxHeld || len(rest) < 1+8*k {
			return qpInfo{}, errShortMsg
		}
		m.held = make([]uint64, k)
		for i := range m.held {
			m.held[i] = le.Uint64(rest[1+8*i:])
		}
		rest = rest[1+8*k:]
	}
	if m.flags&ctlNamed != 0 {
		if len(rest) < 8*infoFDs {
			return qpInfo{}, errShortMsg
		}
		for i := range m.ctl {
			m.ctl[i] = le.Uint64(rest[8*i:])
		}
	}
	if m.recvCap > uint32(deviceAttr.MaxQPWR) || m.recvSGE > uint32(deviceAttr.MaxSGE) || m.cqCap == 0 || m.cqCap > uint32(deviceAttr.MaxCQE) {
		return qpInfo{}, fmt.Errorf("shm: peer announced impossible QP limits (recv %d×%d SGE, CQ %d)", m.recvCap, m.recvSGE, m.cqCap)
	}
	return m, nil
}

// readMsg reads one message and the fds that came with it.
func readMsg(c *net.UnixConn, buf, oob []byte) ([]byte, []int, error) {
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	return takeMsg(buf, oob, n, oobn, flags, err)
}

// takeMsg is the message a read of n bytes and oobn of control data left
// in buf and oob, with its descriptors, or the read's error (msgErr), the
// descriptors then closed.
func takeMsg(buf, oob []byte, n, oobn, flags int, err error) ([]byte, []int, error) {
	var fds []int
	if oobn > 0 {
		fds = parseRights(oob[:oobn])
	}
	if err = msgErr(n, fds, flags, len(oob), err); err != nil {
		closeFDs(fds)
		return nil, nil, err
	}
	return buf[:n], fds, nil
}

// msgErr is the error of a message's read: the end of the file when it
// is empty, errRightsCut when descriptors were cut off (readMsg's).
func msgErr(n int, fds []int, flags, oobLen int, err error) error {
	switch {
	case err != nil:
		return err
	case n == 0:
		return io.EOF
	case flags&unix.MSG_CTRUNC != 0:
		if len(fds) >= (oobLen-unix.CmsgSpace(0))/4 {
			return errTooManyRights
		}
		return errRightsCut
	}
	return nil
}

// parseRights returns the descriptors passed in a message's control data.
func parseRights(oob []byte) []int {
	var fds []int
	if cmsgs, err := unix.ParseSocketControlMessage(oob); err == nil {
		for _, cm := range cmsgs {
			if f, err := unix.ParseUnixRights(&cm); err == nil {
				fds = append(fds, f...)
			}
		}
	}
	return fds
}

func writeMsg(c *net.UnixConn, b []byte, fds ...int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := c.WriteMsgUnix(b, oob, nil)
	return err
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

func encodeMemReq(req, id uint64, key uint32) []byte {
	b := []byte{msgMemReq}
	b = binary.LittleEndian.AppendUint64(b, req)
	b = binary.LittleEndian.AppendUint64(b, id)
	return binary.LittleEndian.AppendUint32(b, key)
}

func encodeMemRep(req uint64, ok bool) []byte {
	b := []byte{msgMemRep}
	b = binary.LittleEndian.AppendUint64(b, req)
	if ok {
		return append(b, 1)
	}
	return append(b, 0)
}

// decodeMemReq reads a memfd request (serveMemReq); ok is false when it is
// too short.
func decodeMemReq(b []byte) (req, id uint64, key uint32, ok bool) {
	if len(b) < 21 {
		return 0, 0, 0, false
	}
	le := binary.LittleEndian
	return le.Uint64(b[1:]), le.Uint64(b[9:]), le.Uint32(b[17:]), true
}

// decodeMemRep reads a memfd reply (deliverMemRep): granted says a
// descriptor should come with it; ok is false when it is too short.
func decodeMemRep(b []byte) (req uint64, granted, ok bool) {
	if len(b) < 10 {
		return 0, false, false
	}
	return binary.LittleEndian.Uint64(b[1:]), b[9] == 1, true
}

// decodeReject returns a reject message's private data, not padded; a
// length beyond the message reads as none.
func decodeReject(b []byte) []byte {
	if len(b) >= 2 && int(b[1]) <= len(b)-2 {
		return b[2 : 2+int(b[1])]
	}
	return nil
}
