package indep

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Section 3.1: the hello.
const (
	helloMagic   = 0x52444d47
	helloVersion = 3
	helloLen     = 26
	helloParks   = 1
)

// Hello is the connection parameters of section 3.1.
type Hello struct {
	RingAddr  uint64
	RingRkey  uint32
	SlotSize  uint32
	SlotCount uint32
	Flags     uint8
}

// Encode returns the 26 bytes of the hello.
func (h Hello) Encode() []byte {
	b := binary.BigEndian.AppendUint32(nil, helloMagic)
	b = append(b, helloVersion)
	b = binary.BigEndian.AppendUint64(b, h.RingAddr)
	b = binary.BigEndian.AppendUint32(b, h.RingRkey)
	b = binary.BigEndian.AppendUint32(b, h.SlotSize)
	b = binary.BigEndian.AppendUint32(b, h.SlotCount)
	return append(b, h.Flags)
}

// DecodeHello parses a hello, ignoring bytes after offset 26 and reading a
// 25-byte hello as flags 0 (section 3.1, 5).
func DecodeHello(b []byte) (Hello, error) {
	if len(b) < 25 {
		return Hello{}, fmt.Errorf("hello: %d bytes", len(b))
	}
	if m := binary.BigEndian.Uint32(b); m != helloMagic {
		return Hello{}, fmt.Errorf("hello: magic %#x", m)
	}
	if b[4] != helloVersion {
		return Hello{}, fmt.Errorf("hello: version %d", b[4])
	}
	h := Hello{
		RingAddr:  binary.BigEndian.Uint64(b[5:]),
		RingRkey:  binary.BigEndian.Uint32(b[13:]),
		SlotSize:  binary.BigEndian.Uint32(b[17:]),
		SlotCount: binary.BigEndian.Uint32(b[21:]),
	}
	if len(b) > 25 {
		h.Flags = b[25]
	}
	if h.SlotSize < 64 || h.SlotSize > 1048575 || h.SlotCount < 2 || h.SlotCount > 255 {
		return Hello{}, fmt.Errorf("hello: geometry %d x %d out of range", h.SlotSize, h.SlotCount)
	}
	return h, nil
}

// Section 3.3.3: socket message types.
const (
	msgConnect    = 1
	msgAccept     = 2
	msgReject     = 3
	msgReady      = 4
	msgMemreq     = 5
	msgMemrep     = 6
	msgErrnote    = 7
	msgDisconnect = 8
	msgWake       = 9
	msgNeedfds    = 10
	msgFds        = 11

	wireVersion   = 3
	acceptNoReady = 1
	ctlNamed      = 2
	maxPrivate    = 56
	maxHeld       = 8
)

// QPInfo is the body of connect and accept (section 3.3.5).
type QPInfo struct {
	Type     uint8
	Version  uint8
	Num      uint32
	PD       uint32
	RecvCap  uint32
	RecvSGE  uint32
	CQCap    uint32
	RingOff  uint64
	CQOff    uint64
	CQID     uint64
	Token    uint64
	IP       [16]byte
	Port     uint16
	Private  []byte
	Flags    uint8
	Held     []uint64
	Ctl      [3]uint64
	HasFlags bool
}

// Encode returns the socket message.
func (q *QPInfo) Encode() []byte {
	le := binary.LittleEndian
	b := []byte{q.Type, q.Version}
	b = le.AppendUint32(b, q.Num)
	b = le.AppendUint32(b, q.PD)
	b = le.AppendUint32(b, q.RecvCap)
	b = le.AppendUint32(b, q.RecvSGE)
	b = le.AppendUint32(b, q.CQCap)
	b = le.AppendUint64(b, q.RingOff)
	b = le.AppendUint64(b, q.CQOff)
	b = le.AppendUint64(b, q.CQID)
	b = le.AppendUint64(b, q.Token)
	b = append(b, q.IP[:]...)
	b = le.AppendUint16(b, q.Port)
	b = append(b, uint8(len(q.Private)))
	b = append(b, q.Private...)
	b = append(b, q.Flags, uint8(len(q.Held)))
	for _, h := range q.Held {
		b = le.AppendUint64(b, h)
	}
	if q.Flags&ctlNamed != 0 {
		for _, c := range q.Ctl {
			b = le.AppendUint64(b, c)
		}
	}
	return b
}

// DecodeQPInfo parses and validates a QP info (section 3.3.5).
func DecodeQPInfo(b []byte) (*QPInfo, error) {
	le := binary.LittleEndian
	if len(b) < 73 {
		return nil, fmt.Errorf("qp info: %d bytes < 73", len(b))
	}
	q := &QPInfo{
		Type: b[0], Version: b[1],
		Num: le.Uint32(b[2:]), PD: le.Uint32(b[6:]), RecvCap: le.Uint32(b[10:]),
		RecvSGE: le.Uint32(b[14:]), CQCap: le.Uint32(b[18:]),
		RingOff: le.Uint64(b[22:]), CQOff: le.Uint64(b[30:]), CQID: le.Uint64(b[38:]),
		Token: le.Uint64(b[46:]), Port: le.Uint16(b[70:]),
	}
	copy(q.IP[:], b[54:70])
	if q.Version != wireVersion {
		return nil, fmt.Errorf("qp info: version %d", q.Version)
	}
	n := int(b[72])
	if n > maxPrivate {
		return nil, fmt.Errorf("qp info: private_len %d > 56", n)
	}
	if len(b) < 73+n {
		return nil, fmt.Errorf("qp info: %d bytes < 73+%d", len(b), n)
	}
	q.Private = append([]byte(nil), b[73:73+n]...)
	rest := b[73+n:]
	if len(rest) >= 1 {
		q.HasFlags = true
		q.Flags = rest[0]
		// The document does not say whether a message may carry the
		// flags byte without held_count; read a missing count as 0.
		k := 0
		if len(rest) >= 2 {
			k = int(rest[1])
		}
		if k > maxHeld {
			return nil, fmt.Errorf("qp info: held_count %d > 8", k)
		}
		need := 2 + 8*k
		if q.Flags&ctlNamed != 0 {
			need += 24
		}
		if len(rest) < need {
			return nil, fmt.Errorf("qp info: %d bytes after the private data, flags %#x and k %d need %d", len(rest), q.Flags, k, need)
		}
		for i := 0; i < k; i++ {
			q.Held = append(q.Held, le.Uint64(rest[2+8*i:]))
		}
		if q.Flags&ctlNamed != 0 {
			for i := 0; i < 3; i++ {
				q.Ctl[i] = le.Uint64(rest[2+8*k+8*i:])
			}
		}
	}
	if q.RecvCap > 16384 || q.RecvSGE > 32 || q.CQCap < 1 || q.CQCap > 1048576 {
		return nil, fmt.Errorf("qp info: recv_cap %d, recv_sge %d, cq_cap %d out of range", q.RecvCap, q.RecvSGE, q.CQCap)
	}
	if q.RingOff%8 != 0 || q.CQOff%8 != 0 {
		return nil, fmt.Errorf("qp info: ring_off %#x or cq_off %#x not a multiple of 8", q.RingOff, q.CQOff)
	}
	return q, nil
}

// Addr returns the sender's address from the ip and port fields.
func (q *QPInfo) Addr() netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(q.IP).Unmap(), q.Port)
}

// ShmNames returns the abstract socket names to try for ip:port, in order
// (section 3.3.1), without the leading NUL.
func ShmNames(addr string) ([]string, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return nil, fmt.Errorf("port %q: %w", portStr, err)
	}
	wild := "rdmagrpc-shm/*:" + strconv.Itoa(int(port))
	if host == "" {
		return []string{wild, "rdmagrpc-shm/127.0.0.1:" + strconv.Itoa(int(port))}, nil
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return nil, fmt.Errorf("host %q is not an IP address: %w", host, err)
	}
	ip = ip.Unmap()
	if ip.IsUnspecified() {
		return []string{wild, "rdmagrpc-shm/127.0.0.1:" + strconv.Itoa(int(port))}, nil
	}
	return []string{"rdmagrpc-shm/" + netip.AddrPortFrom(ip, uint16(port)).String(), wild}, nil
}

// Sizes of the shared structures (sections 3.3.6-3.3.8).
const (
	mrEntries   = 1 << 18
	mrEntrySize = 64
	mrTableSize = mrEntries * mrEntrySize
	ringHdr     = 64
	cqHdrSize   = 64
	qpStride    = 4096      // our QP rings, one per connection, in one file
	qpFileSize  = 16 * 4096 // room for 16 connections sharing the files
	cqFileSize  = 4096
	qpStateRTS  = 3
	qpStateErr  = 6
)

func recvSlotSize(sge uint32) uint64 { return 24 + 16*uint64(sge) }

// mapping is a mapped memfd.
type mapping struct {
	fd   int
	mem  []byte
	ino  uint64
	size int64
}

func (m *mapping) close() {
	if m == nil {
		return
	}
	if m.mem != nil {
		unix.Munmap(m.mem)
	}
	if m.fd >= 0 {
		unix.Close(m.fd)
	}
}

func (m *mapping) u32(off uint64) *uint32 { return (*uint32)(unsafe.Pointer(&m.mem[off])) }
func (m *mapping) u64(off uint64) *uint64 { return (*uint64)(unsafe.Pointer(&m.mem[off])) }

// newMemfd creates a sealed memfd of size bytes, mapped shared read-write.
func newMemfd(name string, size int64) (*mapping, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_ALLOW_SEALING|unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	m := &mapping{fd: fd, size: size}
	if err := unix.Ftruncate(fd, size); err != nil {
		m.close()
		return nil, fmt.Errorf("ftruncate: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		m.close()
		return nil, fmt.Errorf("seal: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		m.close()
		return nil, fmt.Errorf("mmap: %w", err)
	}
	m.mem = mem
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err == nil {
		m.ino = st.Ino
	}
	return m, nil
}

// mapReceived checks and maps a received descriptor (section 3.3.5,
// "Received descriptors"). It takes ownership of fd.
func mapReceived(fd int, minSize int64) (*mapping, error) {
	m := &mapping{fd: fd}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		m.close()
		return nil, fmt.Errorf("fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		m.close()
		return nil, fmt.Errorf("descriptor is not a regular file (mode %#o)", st.Mode)
	}
	if st.Size < 1 || st.Size > 1<<40 || st.Size < minSize {
		m.close()
		return nil, fmt.Errorf("descriptor size %d out of range (min %d)", st.Size, minSize)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		m.close()
		return nil, fmt.Errorf("F_GET_SEALS: %w", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		m.close()
		return nil, fmt.Errorf("descriptor not sealed against shrinking (seals %#x)", seals)
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		m.close()
		return nil, fmt.Errorf("mmap: %w", err)
	}
	m.mem, m.size, m.ino = mem, st.Size, st.Ino
	return m, nil
}

// ShmConfig are the local parameters of a dial.
type ShmConfig struct {
	SlotSize  uint32 // small ring slot size (default 1024)
	SlotCount uint32 // small ring slots (default 4)
	RecvCap   uint32 // receives (default slot_count + 7 + 32)
	CQCap     uint32 // default 2 × RecvCap
	// Mutate, if set, changes the connect message and its descriptors
	// before they are sent (for tests of the listener's checks).
	Mutate func(msg []byte, fds []int) ([]byte, []int)
	// Reuse, if set, is an earlier connection to the same listener whose
	// control files this one shares; the connect lists the listener's files
	// it keeps mapped in held (3.3.5).
	Reuse *ShmConn
	// NameOwnFiles (with Reuse): send ctlNamed and no descriptors if the
	// listener's last accept listed our three files as held.
	NameOwnFiles bool
}

// ShmConn is a connection set up by DialShm.
type ShmConn struct {
	sock *net.UnixConn
	name string

	// Ours.
	pd      uint32
	qp      QPInfo
	hello   Hello
	mr      *mapping // MR table
	qpRing  *mapping // our QP ring (receive queue) at ring_off 0
	cq      *mapping // our CQ header at cq_off 0
	ring    *mapping // our small receive ring, arena memfdID
	memfdID uint64
	rkey    uint32
	mrIndex uint64
	ringOff uint64
	cqOff   uint64
	prev    *ShmConn

	borrowed map[*mapping]bool

	// What the named-files exchange did.
	ConnectNamed bool
	GotNeedfds   bool
	AcceptNamed  bool

	// The listener's.
	Peer      *QPInfo
	PeerHello Hello
	PeerCred  *unix.Ucred
	peerMR    *mapping
	peerRing  *mapping
	peerCQ    *mapping

	mu       sync.Mutex
	arenas   map[uint64]*mapping // the listener's data arenas by memfd_id
	reqNum   uint64
	memreps  chan memrep
	closed   chan struct{}
	readErr  error
	wakes    atomic.Int64
	errnotes atomic.Int64
	peerDisc atomic.Bool
	memreqs  atomic.Int64

	// Data path state.
	sentSmall uint64 // messages put into the peer's small ring
	credits   int
	owed      int

	largeAddr    uint64
	largeRkey    uint32
	largeSize    uint32
	largeCount   uint32
	sentLarge    uint64
	largeCredits int
	polled       uint64 // our completions consumed
	recvSmall    uint64 // messages received into our small ring
	SentReady    bool
	AcceptFlag   uint8
}

type memrep struct {
	req uint64
	ok  bool
	fd  int
}

// ErrClosedWithoutAnswer: the listener closed the socket after the connect.
var ErrClosedWithoutAnswer = errors.New("shm: listener closed the socket without an answer")

// RejectError is a reject message from the listener.
type RejectError struct{ Private []byte }

func (e *RejectError) Error() string { return fmt.Sprintf("shm: rejected: %q", e.Private) }

func randU64() uint64 {
	var b [8]byte
	rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

// DialShm sets up an shm connection to the listener at addr (ip:port) as
// sections 3.3.1-3.3.5 describe.
func DialShm(ctx context.Context, addr string, cfg ShmConfig) (*ShmConn, error) {
	if cfg.SlotSize == 0 {
		cfg.SlotSize = 1024
	}
	if cfg.SlotCount == 0 {
		cfg.SlotCount = 4
	}
	if cfg.RecvCap == 0 {
		cfg.RecvCap = cfg.SlotCount + 7 + 32
	}
	if cfg.CQCap == 0 {
		cfg.CQCap = 2 * cfg.RecvCap
	}
	names, err := ShmNames(addr)
	if err != nil {
		return nil, err
	}
	c := &ShmConn{
		pd:       uint32(randU64()) | 1,
		arenas:   map[uint64]*mapping{},
		borrowed: map[*mapping]bool{},
		memreps:  make(chan memrep, 4),
		closed:   make(chan struct{}),
	}
	if err := c.setupLocal(cfg); err != nil {
		c.release()
		return nil, err
	}
	// 3.3.1/3.3.2: connect by name, check the listener's credentials.
	var lastErr error
	for _, name := range names {
		uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: "@" + name, Net: "unixpacket"})
		if err != nil {
			lastErr = fmt.Errorf("connect %q: %w", name, err)
			if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
				continue
			}
			break
		}
		cred, err := peerCred(uc)
		if err != nil {
			uc.Close()
			lastErr = err
			continue
		}
		if cred.Uid != uint32(os.Geteuid()) && cred.Uid != 0 {
			uc.Close()
			lastErr = fmt.Errorf("listener refused: %q has uid %d", name, cred.Uid)
			continue
		}
		c.sock, c.name, c.PeerCred = uc, name, cred
		break
	}
	if c.sock == nil {
		c.release()
		return nil, lastErr
	}
	if err := c.handshake(ctx, cfg.Mutate); err != nil {
		c.sock.Close()
		c.release()
		return nil, err
	}
	go c.readLoop()
	return c, nil
}

func peerCred(uc *net.UnixConn) (*unix.Ucred, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

// setupLocal creates our MR table, QP ring, CQ header and small ring.
func (c *ShmConn) setupLocal(cfg ShmConfig) error {
	var err error
	if prev := cfg.Reuse; prev != nil {
		// Named control files (3.3.5): the same MR table, QP ring file and
		// CQ file as an earlier connection, another place in them.
		c.prev = prev
		c.mr, c.qpRing, c.cq = prev.mr, prev.qpRing, prev.cq
		c.borrowed[c.mr], c.borrowed[c.qpRing], c.borrowed[c.cq] = true, true, true
		c.mrIndex = prev.mrIndex + 1
	} else {
		c.mrIndex = 1
		if c.mr, err = newMemfd("indep-mr", mrTableSize); err != nil {
			return err
		}
		if c.qpRing, err = newMemfd("indep-qp", qpFileSize); err != nil {
			return err
		}
		if c.cq, err = newMemfd("indep-cq", cqFileSize); err != nil {
			return err
		}
	}
	k := c.mrIndex - 1
	c.ringOff, c.cqOff = k*qpStride, k*cqHdrSize
	if ringHdr+uint64(cfg.RecvCap)*recvSlotSize(1) > qpStride || c.ringOff+qpStride > qpFileSize || c.cqOff+cqHdrSize > cqFileSize {
		return fmt.Errorf("no room for connection %d in the control files", c.mrIndex)
	}
	ringLen := int64(cfg.SlotSize) * int64(cfg.SlotCount)
	if c.ring, err = newMemfd("indep-ring", roundPage(ringLen)); err != nil {
		return err
	}
	c.memfdID = c.ring.ino
	ringAddr := uint64(uintptr(unsafe.Pointer(&c.ring.mem[0])))

	// MR table entry mrIndex, generation 1 (3.3.7), written under the
	// seqlock.
	const gen = 1
	c.rkey = uint32(c.mrIndex<<8 | gen)
	e := c.mrIndex * mrEntrySize
	atomic.AddUint32(c.mr.u32(e), 1)
	*c.mr.u32(e + 8) = c.pd
	*c.mr.u32(e + 12) = 1 | 2 // local write, remote write
	*c.mr.u64(e + 16) = ringAddr
	*c.mr.u64(e + 24) = uint64(ringLen)
	*c.mr.u64(e + 32) = c.memfdID
	*c.mr.u64(e + 40) = 0
	atomic.StoreUint32(c.mr.u32(e+4), c.rkey)
	atomic.AddUint32(c.mr.u32(e), 1)

	// QP ring (3.3.6): RTS, every receive posted with nsge 0.
	atomic.StoreUint32(c.qpRing.u32(c.ringOff), qpStateRTS)
	for i := uint64(0); i < uint64(cfg.RecvCap); i++ {
		s := c.ringOff + ringHdr + i*recvSlotSize(1)
		*c.qpRing.u32(s + 8) = 0
	}
	atomic.StoreUint64(c.qpRing.u64(c.ringOff+8), uint64(cfg.RecvCap))

	c.hello = Hello{RingAddr: ringAddr, RingRkey: c.rkey, SlotSize: cfg.SlotSize, SlotCount: cfg.SlotCount}
	c.qp = QPInfo{
		Type: msgConnect, Version: wireVersion,
		Num: uint32(c.mrIndex), PD: c.pd, RecvCap: cfg.RecvCap, RecvSGE: 1, CQCap: cfg.CQCap,
		RingOff: c.ringOff, CQOff: c.cqOff, CQID: randU64(), Token: randU64(),
		IP:      netip.AddrFrom4([4]byte{127, 0, 0, 1}).As16(),
		Port:    0,
		Private: c.hello.Encode(),
	}
	if prev := cfg.Reuse; prev != nil {
		// List the listener's files we keep mapped; name ours if the
		// listener's last accept listed them as held.
		c.qp.Held = []uint64{prev.peerMR.ino, prev.peerRing.ino, prev.peerCQ.ino}
		if cfg.NameOwnFiles && heldAll(prev.Peer.Held, c.mr.ino, c.qpRing.ino, c.cq.ino) {
			c.qp.Flags |= ctlNamed
			c.qp.Ctl = [3]uint64{c.mr.ino, c.qpRing.ino, c.cq.ino}
		}
	}
	return nil
}

func heldAll(held []uint64, inos ...uint64) bool {
	for _, ino := range inos {
		found := false
		for _, h := range held {
			found = found || h == ino
		}
		if !found {
			return false
		}
	}
	return true
}

func roundPage(n int64) int64 { return (n + 4095) &^ 4095 }

func (c *ShmConn) handshake(ctx context.Context, mutate func([]byte, []int) ([]byte, []int)) error {
	deadline := time.Now().Add(10 * time.Second)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	c.sock.SetDeadline(deadline)
	defer c.sock.SetDeadline(time.Time{})

	msg := c.qp.Encode()
	ownFds := []int{c.mr.fd, c.qpRing.fd, c.cq.fd}
	fds := ownFds
	if c.qp.Flags&ctlNamed != 0 {
		fds = nil
		c.ConnectNamed = true
	}
	if mutate != nil {
		msg, fds = mutate(msg, fds)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.sock.WriteMsgUnix(msg, oob, nil); err != nil {
		return fmt.Errorf("send connect: %w", err)
	}
	buf := make([]byte, 512)
	oobBuf := make([]byte, unix.CmsgSpace(8*4))
	var n int
	for {
		var oobn int
		var err error
		n, oobn, _, _, err = c.sock.ReadMsgUnix(buf, oobBuf)
		if errors.Is(err, io.EOF) || (err == nil && n == 0) {
			return ErrClosedWithoutAnswer
		}
		if err != nil {
			return fmt.Errorf("read answer: %w", err)
		}
		fds, err = parseRights(oobBuf[:oobn])
		if err != nil {
			return err
		}
		if buf[0] != msgNeedfds {
			break
		}
		closeFds(fds)
		if !c.ConnectNamed || c.GotNeedfds {
			return errors.New("needfds after a connect without ctlNamed (or twice)")
		}
		// 3.3.5: the listener no longer has our files: send them.
		c.GotNeedfds = true
		if _, _, err := c.sock.WriteMsgUnix([]byte{msgFds}, unix.UnixRights(ownFds...), nil); err != nil {
			return fmt.Errorf("send fds: %w", err)
		}
	}
	switch buf[0] {
	case msgReject:
		closeFds(fds)
		if n < 2 || n < 2+int(buf[1]) {
			return fmt.Errorf("short reject %x", buf[:n])
		}
		return &RejectError{Private: append([]byte(nil), buf[2:2+int(buf[1])]...)}
	case msgAccept:
	default:
		closeFds(fds)
		return fmt.Errorf("answer type %d (%x)", buf[0], buf[:n])
	}
	q, err := DecodeQPInfo(buf[:n])
	if err != nil {
		closeFds(fds)
		return err
	}
	c.Peer, c.AcceptFlag = q, q.Flags
	if c.PeerHello, err = DecodeHello(q.Private); err != nil {
		closeFds(fds)
		return err
	}
	if q.Flags&ctlNamed != 0 {
		closeFds(fds)
		// A named accept must name files we listed as held, of the
		// process whose files we listed.
		if c.prev == nil || !heldAll(c.qp.Held, q.Ctl[:]...) || c.prev.PeerCred.Pid != c.PeerCred.Pid {
			return fmt.Errorf("named accept %x, but we listed %x", q.Ctl, c.qp.Held)
		}
		if q.Ctl != [3]uint64{c.prev.peerMR.ino, c.prev.peerRing.ino, c.prev.peerCQ.ino} {
			return fmt.Errorf("named accept %x does not name the MR table, ring and CQ files in order (%d %d %d)", q.Ctl, c.prev.peerMR.ino, c.prev.peerRing.ino, c.prev.peerCQ.ino)
		}
		c.peerMR, c.peerRing, c.peerCQ = c.prev.peerMR, c.prev.peerRing, c.prev.peerCQ
		c.borrowed[c.peerMR], c.borrowed[c.peerRing], c.borrowed[c.peerCQ] = true, true, true
		c.AcceptNamed = true
	} else {
		if len(fds) != 3 {
			closeFds(fds)
			return fmt.Errorf("accept carried %d descriptors, want 3", len(fds))
		}
		if c.peerMR, err = mapReceived(fds[0], mrTableSize); err != nil {
			closeFds(fds[1:])
			return fmt.Errorf("MR table: %w", err)
		}
		if c.peerRing, err = mapReceived(fds[1], 1); err != nil {
			closeFds(fds[2:])
			return fmt.Errorf("QP ring: %w", err)
		}
		if c.peerCQ, err = mapReceived(fds[2], 1); err != nil {
			return fmt.Errorf("CQ: %w", err)
		}
	}
	ringEnd := q.RingOff + ringHdr + uint64(max(q.RecvCap, 1))*recvSlotSize(q.RecvSGE)
	if uint64(c.peerRing.size) < ringEnd {
		return fmt.Errorf("QP ring window ends at %d, file has %d", ringEnd, c.peerRing.size)
	}
	if uint64(c.peerCQ.size) < q.CQOff+cqHdrSize {
		return fmt.Errorf("CQ window ends at %d, file has %d", q.CQOff+cqHdrSize, c.peerCQ.size)
	}
	if q.Flags&acceptNoReady == 0 {
		if _, _, err := c.sock.WriteMsgUnix([]byte{msgReady}, nil, nil); err != nil {
			return fmt.Errorf("send ready: %w", err)
		}
		c.SentReady = true
	}
	c.credits = int(c.PeerHello.SlotCount)
	return nil
}

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("control message: %w", err)
	}
	var fds []int
	for _, m := range msgs {
		f, err := unix.ParseUnixRights(&m)
		if err != nil {
			closeFds(fds)
			return nil, err
		}
		fds = append(fds, f...)
	}
	return fds, nil
}

func closeFds(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// readLoop serves the socket after set-up: memreq, memrep, wake, errnote,
// disconnect, and ignores unknown types.
func (c *ShmConn) readLoop() {
	defer close(c.closed)
	buf := make([]byte, 512)
	oobBuf := make([]byte, unix.CmsgSpace(8*4))
	for {
		n, oobn, _, _, err := c.sock.ReadMsgUnix(buf, oobBuf)
		var fds []int
		if oobn > 0 {
			fds, _ = parseRights(oobBuf[:oobn])
		}
		if err != nil || n == 0 {
			closeFds(fds)
			if err == nil || errors.Is(err, io.EOF) {
				err = io.EOF
				c.peerDisc.Store(true)
			}
			c.mu.Lock()
			c.readErr = err
			c.mu.Unlock()
			return
		}
		switch buf[0] {
		case msgMemreq:
			closeFds(fds)
			c.memreqs.Add(1)
			if n < 21 {
				continue
			}
			req := binary.LittleEndian.Uint64(buf[1:])
			id := binary.LittleEndian.Uint64(buf[9:])
			rkey := binary.LittleEndian.Uint32(buf[17:])
			rep := binary.LittleEndian.AppendUint64([]byte{msgMemrep}, req)
			if rkey == c.rkey && id == c.memfdID {
				rep = append(rep, 1)
				c.sock.WriteMsgUnix(rep, unix.UnixRights(c.ring.fd), nil)
			} else {
				rep = append(rep, 0)
				c.sock.WriteMsgUnix(rep, nil, nil)
			}
		case msgMemrep:
			if n < 10 {
				closeFds(fds)
				continue
			}
			r := memrep{req: binary.LittleEndian.Uint64(buf[1:]), ok: buf[9] == 1, fd: -1}
			if r.ok && len(fds) == 1 {
				r.fd = fds[0]
			} else {
				closeFds(fds)
			}
			select {
			case c.memreps <- r:
			default:
				if r.fd >= 0 {
					unix.Close(r.fd)
				}
			}
		case msgWake:
			closeFds(fds)
			c.wakes.Add(1)
		case msgErrnote:
			closeFds(fds)
			c.errnotes.Add(1)
		case msgDisconnect:
			closeFds(fds)
			c.peerDisc.Store(true)
			atomic.StoreUint32(c.qpRing.u32(c.ringOff), qpStateErr)
			c.sock.Close()
		default:
			closeFds(fds)
		}
	}
}

// Close sends disconnect and waits (at most 1 s) for the listener to close
// its end (section 3.3.3).
func (c *ShmConn) Close() error {
	c.disconnect()
	c.release()
	return nil
}

// CloseKeepFiles disconnects but keeps the control files and mappings, for
// a later connection that reuses them (ShmConfig.Reuse); Release frees
// them.
func (c *ShmConn) CloseKeepFiles() { c.disconnect() }

// Release frees what CloseKeepFiles kept.
func (c *ShmConn) Release() { c.release() }

func (c *ShmConn) disconnect() {
	if c.sock != nil {
		c.sock.WriteMsgUnix([]byte{msgDisconnect}, nil, nil)
		select {
		case <-c.closed:
		case <-time.After(time.Second):
		}
		c.sock.Close()
		<-c.closed
	}
}

func (c *ShmConn) release() {
	for _, m := range []*mapping{c.mr, c.qpRing, c.cq, c.ring, c.peerMR, c.peerRing, c.peerCQ} {
		if !c.borrowed[m] {
			m.close()
		}
	}
	c.mu.Lock()
	for _, m := range c.arenas {
		m.close()
	}
	c.arenas = nil
	c.mu.Unlock()
}

// SocketName is the abstract name the dial connected to.
func (c *ShmConn) SocketName() string { return c.name }

// Counters of socket messages received after set-up.
func (c *ShmConn) Counters() (memreqs, wakes, errnotes int64, peerClosed bool) {
	return c.memreqs.Load(), c.wakes.Load(), c.errnotes.Load(), c.peerDisc.Load()
}
