package shm

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/internal/logx"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Connection management. A listener on host:port is a SOCK_SEQPACKET unix
// socket in the abstract namespace named after the IP and port, so it
// needs no file system and is private to the network namespace, as a TCP
// port is. Wildcard listeners use "*" for the IP and are found by dialers
// of any local address.

const (
	maxPrivate   = transport.MaxPrivateData
	sockPrefix   = "@rdmagrpc-shm/"
	portLo       = 32768
	portHi       = 60999
	setupTimeout = 10 * time.Second
)

// Addr is the address of an shm endpoint: the host:port it was named by.
type Addr struct {
	IP   netip.Addr
	Port int
}

// Network returns "rdma": the address space is the one RDMA CM uses.
func (a *Addr) Network() string { return "rdma" }

func (a *Addr) String() string {
	return net.JoinHostPort(a.IP.String(), strconv.Itoa(a.Port))
}

func addrPort(a net.Addr) netip.AddrPort {
	if x, ok := a.(*Addr); ok && x != nil {
		return netip.AddrPortFrom(x.IP, uint16(x.Port))
	}
	return netip.AddrPortFrom(netip.IPv4Unspecified(), 0)
}

// resolve parses host:port; an empty host or an unspecified IP is a wildcard.
func resolve(ctx context.Context, hostport string) (netip.Addr, int, error) {
	host, ps, err := net.SplitHostPort(hostport)
	if err != nil {
		return netip.Addr{}, 0, fmt.Errorf("shm: address %q: %w", hostport, err)
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port < 0 || port > 65535 {
		return netip.Addr{}, 0, fmt.Errorf("shm: address %q: bad port", hostport)
	}
	if host == "" {
		return netip.IPv4Unspecified(), port, nil
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return ip.Unmap(), port, nil // an IPv6 zone stays: fe80::1%eth0 is not fe80::1%eth1
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil || len(ips) == 0 {
		return netip.Addr{}, 0, fmt.Errorf("shm: resolve %q: %w", host, err)
	}
	best := ips[0]
	for _, ip := range ips {
		if ip.Unmap().Is4() {
			best = ip
			break
		}
	}
	return best.Unmap(), port, nil
}

func sockName(ip netip.Addr, port int) string {
	if ip.IsUnspecified() {
		return sockPrefix + "*:" + strconv.Itoa(port)
	}
	return sockPrefix + net.JoinHostPort(ip.String(), strconv.Itoa(port))
}

// isLocal reports whether ip is an address of this host: whether a TCP
// socket could bind it, asked of the kernel the same way (a bind of a
// datagram socket to ip, port 0), so shm agrees with TCP about what
// "this host" is, zones and net.ipv4.ip_nonlocal_bind included, at the
// cost of three system calls instead of a walk over every interface.
func isLocal(ip netip.Addr) bool {
	if ip.IsLoopback() || ip.IsUnspecified() {
		return true
	}
	return bindable(ip) == nil
}

func bindable(ip netip.Addr) error {
	var sa unix.Sockaddr
	family := unix.AF_INET
	if ip.Is4() {
		sa = &unix.SockaddrInet4{Addr: ip.As4()}
	} else {
		family = unix.AF_INET6
		s6 := &unix.SockaddrInet6{Addr: ip.As16()}
		if z := ip.Zone(); z != "" {
			idx, err := transport.ZoneIndex(z)
			if err != nil {
				return err
			}
			s6.ZoneId = uint32(idx)
		}
		sa = s6
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Bind(fd, sa)
}

// errNotLocal: shm joins processes of this host only, so an address of
// another host is refused outright, by Listen as TCP refuses to bind it
// and by Connect instead of reaching whatever local process listens under
// that name.
func errNotLocal(op, addr string, ip netip.Addr) error {
	return fmt.Errorf("shm: %s %s: %v is not an address of this host (shm joins local processes only; RDMA to other hosts needs an RDMA device and the verbs provider): %w",
		op, addr, ip, syscall.EADDRNOTAVAIL)
}

func (d *device) Listen(addr string) (transport.Listener, error) {
	ip, port, err := resolve(context.Background(), addr)
	if err != nil {
		return nil, err
	}
	if !isLocal(ip) {
		return nil, errNotLocal("listen on", addr, ip)
	}
	var ul *os.File
	if port != 0 {
		ul, err = listenSock(sockName(ip, port))
		if err != nil {
			return nil, fmt.Errorf("shm: listen on %s: %w", addr, err)
		}
	} else {
		// Port 0: try random ports of the ephemeral range until the
		// abstract name is free.
		for range 1000 {
			port = portLo + rand.IntN(portHi-portLo+1)
			ul, err = listenSock(sockName(ip, port))
			if err == nil || !errors.Is(err, syscall.EADDRINUSE) {
				break
			}
		}
		if err != nil {
			return nil, fmt.Errorf("shm: listen on %s: no free port: %w", addr, err)
		}
	}
	l := &listener{
		uid:     os.Geteuid(),
		dev:     d,
		ul:      ul,
		addr:    &Addr{IP: ip, Port: port},
		reqs:    make(chan *connReq),
		handled: make(chan struct{}),
		done:    make(chan struct{}),
	}
	dir, err := sockDir()
	if err == nil && dir != "" {
		err = l.listenDir(dir)
	}
	if err != nil {
		ul.Close()
		return nil, fmt.Errorf("shm: listen on %s: %w", addr, err)
	}
	for _, f := range append([]*os.File{ul}, l.dirSocks...) {
		l.wg.Add(1)
		go l.acceptLoop(f)
	}
	return l, nil
}

// listenSock makes the listening socket of name. It is a file, not a
// listener of Go's net: its connections are taken as descriptors of our
// own (acceptLoop), which a net.Listener cannot give, and a file's
// descriptor can still be waited for in Go's netpoller.
func listenSock(name string) (*os.File, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: name}); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("bind", err)
	}
	// The kernel caps the backlog at net.core.somaxconn.
	if err := unix.Listen(fd, 1<<16-1); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("listen", err)
	}
	return os.NewFile(uintptr(fd), name), nil
}

type listener struct {
	dev       *device
	ul        *os.File   // the listening socket (listenSock)
	dirSocks  []*os.File // its sockets in the socket directory (sockdir.go)
	addr      *Addr
	reqs      chan *connReq
	handle    atomic.Pointer[func(transport.ConnRequest)] // HandleRequests; nil: queue for Accept
	handled   chan struct{}                               // closed by HandleRequests
	done      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
	uid       int // the effective uid at Listen: without a check, the only one admitted

	mu        sync.Mutex
	pending   map[*net.UnixConn]bool // connections still in handshake
	peerCheck func(pid, uid, gid int) error
	lastWarn  atomic.Int64 // unix nanoseconds of the last warning logged
	// requestsRead counts the requests read whole (tests).
	requestsRead atomic.Int64
}

func (l *listener) Addr() net.Addr { return l.addr }

// acceptLoop accepts the sockets of connect requests as descriptors of
// our own, outside Go's netpoller (see rawSock): only the listening
// socket is waited for there.
func (l *listener) acceptLoop(ul *os.File) {
	defer l.wg.Done()
	rc, err := ul.SyscallConn()
	if err != nil {
		logx.L().Error("rdmagrpc shm: listener stops", "listener", l.addr.String(), "err", err)
		return
	}
	backoff := time.Duration(0)
	for {
		var fd int
		var aerr error
		if err := rc.Read(func(lfd uintptr) bool {
			fd, _, aerr = unix.Accept4(int(lfd), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
			return aerr != unix.EAGAIN
		}); err != nil {
			return // closed
		}
		switch aerr {
		case nil:
			backoff = 0
			l.wg.Add(1)
			go l.handshake(&rawSock{fd: fd})
		case unix.EINTR, unix.ECONNABORTED:
		default:
			// Out of descriptors or memory: the request stays queued and
			// the socket readable, so wait a little before trying again,
			// longer each time, rather than spin or give up the listener.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			if l.warnNow() {
				logx.L().Warn("rdmagrpc shm: cannot accept connection requests (at most one such line a second)", "listener", l.addr.String(), "err", os.NewSyscallError("accept4", aerr))
			}
			select {
			case <-l.done:
				return
			case <-time.After(backoff):
			}
		}
	}
}

// handshake reads the connect request and hands it to Accept. The
// request is most often in the socket already; one that is not yet is
// waited for with Go's netpoller and the set-up timeout, on a socket of
// Go's net made from c.
func (l *listener) handshake(c *rawSock) {
	defer l.wg.Done()
	select {
	case <-l.done:
		c.close()
		return
	default:
	}
	buf := make([]byte, maxMsg)
	oob := make([]byte, unix.CmsgSpace(4*infoFDs))
	var (
		s  sock          = c
		nc *net.UnixConn // s's, once the handshake waits
	)
	// waitable makes s a socket that reads wait, within the set-up
	// timeout, unless Close (which ends them) came first.
	waitable := func() bool {
		if nc != nil {
			return true
		}
		conn, err := c.toNet()
		if err != nil {
			return false
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		select {
		case <-l.done:
			conn.Close()
			return false
		default:
		}
		if l.pending == nil {
			l.pending = map[*net.UnixConn]bool{}
		}
		rc, err := conn.SyscallConn()
		if err != nil {
			conn.Close()
			return false
		}
		l.pending[conn] = true
		conn.SetReadDeadline(time.Now().Add(setupTimeout))
		nc, s = conn, &netSock{c: conn, rc: rc}
		return true
	}
	// handOver takes the socket out of the pending set: from then on
	// Close leaves it (and its deadline) to whoever answers the request.
	// A socket that had to be waited for leaves Go's netpoller too
	// (fromNet): there its every wake-up would wake the netpoller as well.
	handedOver := false
	handOver := func() {
		if nc != nil && !handedOver {
			l.mu.Lock()
			delete(l.pending, nc)
			l.mu.Unlock()
			nc.SetReadDeadline(time.Time{})
			if rs, err := fromNet(nc); err == nil {
				s = rs
			}
		}
		handedOver = true
	}
	defer handOver()
	// refuse answers with a reject that carries private (no descriptor
	// of ours is handed over).
	refuse := func(private []byte) {
		handOver()
		(&connReq{l: l, s: s}).Reject(private)
	}
	b, fds, err := recvMsg(c, buf, oob)
	if errors.Is(err, unix.EAGAIN) {
		if !waitable() {
			return
		}
		b, fds, err = readMsg(nc, buf, oob)
	}
	cut := errors.Is(err, errRightsCut)
	if (err != nil && !cut) || (err == nil && b[0] != msgConnect) {
		closeFDs(fds)
		s.close()
		return
	}
	// Who asks first: a peer the listener does not admit learns nothing
	// more than that, and costs no warning in the log.
	cred, perr := peerCred(s)
	if perr == nil {
		perr = l.checkPeer(cred)
	} else {
		perr = fmt.Errorf("cannot tell who the peer is: %w", perr)
	}
	if perr != nil {
		closeFDs(fds)
		refuse(peerRefusal(perr))
		return
	}
	if cut {
		// Out of descriptors: say so to both sides rather than close the
		// socket, which the dialer would read as a bare end of file.
		if l.warnNow() {
			logx.L().Warn("rdmagrpc shm: refusing connection requests (at most one such line a second)", "listener", l.addr.String(), "err", err)
		}
		refuse(listenerFailure(err))
		return
	}
	info, err := decodeInfo(b)
	if err != nil {
		closeFDs(fds)
		s.close()
		return
	}
	peer := peerOf(cred)
	var maps []peerMapping
	if info.flags&ctlNamed != 0 && len(fds) == 0 {
		var ok bool
		if kd := l.ctlDevice(peer); kd != nil {
			maps, ok = kd.namedCtl(info.ctl[:])
		}
		if !ok {
			// Not (or no longer) held here: ask for them.
			if !waitable() {
				return
			}
			if fds, err = askFDs(nc, buf, oob); err != nil {
				s.close()
				return
			}
		}
	} else if len(fds) != infoFDs {
		closeFDs(fds)
		s.close()
		return
	}
	// From here the socket may become a live QP's: Close must no longer
	// touch its deadline, so it leaves the pending set first.
	handOver()
	r := &connReq{l: l, s: s, info: info, fds: fds, maps: maps, cred: cred, peer: peer}
	l.requestsRead.Add(1)
	select {
	case l.reqs <- r:
	case <-l.handled: // HandleRequests: no Accept takes it
		(*l.handle.Load())(r)
	case <-l.done:
		r.Reject(nil)
	}
}

// ctlDevice is the device whose kept control mappings resolve the files
// the process at the other end of a request names (ctlNamed): the child
// device of that process, if there is one yet.
func (l *listener) ctlDevice(peer peerID) *device {
	if peer.pid == 0 {
		return nil
	}
	return l.dev.knownChild(peer)
}

// askFDs asks the dialer for the descriptors its connect named and reads
// them, within the request's read deadline.
func askFDs(c *net.UnixConn, buf, oob []byte) ([]int, error) {
	handshakes.asked.Add(1)
	if err := writeMsg(c, []byte{msgNeedFDs}); err != nil {
		return nil, err
	}
	b, fds, err := readMsg(c, buf, oob)
	if err != nil {
		return nil, err
	}
	if b[0] != msgFDs || len(fds) != infoFDs {
		closeFDs(fds)
		return nil, fmt.Errorf("shm: asked for the connect's descriptors, got message %d with %d", b[0], len(fds))
	}
	return fds, nil
}

// HandleRequests: see transport.RequestHandler. The handshake goroutine
// that read a request runs fn, so a connection costs the listener's
// process one goroutine, not two, and no wake-up of Accept's.
func (l *listener) HandleRequests(fn func(transport.ConnRequest)) {
	if l.handle.CompareAndSwap(nil, &fn) {
		close(l.handled)
	}
}

func (l *listener) Accept(ctx context.Context) (transport.ConnRequest, error) {
	select {
	case r := <-l.reqs:
		return r, nil
	case <-l.done:
		return nil, fmt.Errorf("shm: accept on %v: %w", l.addr, net.ErrClosed)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *listener) Close() error {
	l.closeOnce.Do(func() {
		close(l.done)
		l.ul.Close()
		l.closeDir()
		// Unblock handshakes still reading a request.
		l.mu.Lock()
		for c := range l.pending {
			c.SetReadDeadline(aLongTimeAgo)
		}
		l.mu.Unlock()
		l.wg.Wait()
	})
	return nil
}

// warnNow reports whether a warning may be logged now: at most one a
// second, however many requests a listener out of descriptors refuses.
func (l *listener) warnNow() bool {
	now := time.Now().UnixNano()
	last := l.lastWarn.Load()
	return now-last >= int64(time.Second) && l.lastWarn.CompareAndSwap(last, now)
}

// SetPeerCheck implements transport.PeerChecker.
func (l *listener) SetPeerCheck(check func(pid, uid, gid int) error) {
	l.mu.Lock()
	l.peerCheck = check
	l.mu.Unlock()
}

// checkPeer asks the kernel who is at the other end of c and applies the
// listener's check; without one, only this process's user is admitted.
func (l *listener) checkPeer(cred *unix.Ucred) error {
	l.mu.Lock()
	check := l.peerCheck
	l.mu.Unlock()
	if check == nil {
		if int(cred.Uid) != l.uid {
			return fmt.Errorf("uid %d is not the listener's (%d)", cred.Uid, l.uid)
		}
		return nil
	}
	return check(int(cred.Pid), int(cred.Uid), int(cred.Gid))
}

// peerRefusal is the private data of a reject for a peer the listener's
// check refused.
func peerRefusal(err error) []byte {
	return transport.RejectWith(transport.RejectPeerRefused, err, maxPrivate)
}

// listenerFailure is the private data of a reject for a request the
// listener could not take (it ran out of descriptors).
func listenerFailure(err error) []byte {
	return transport.RejectWith(transport.RejectListenerFailed, err, maxPrivate)
}

// connReq is a connect request waiting for Accept or Reject.
type connReq struct {
	l    *listener
	s    sock
	info qpInfo
	// The dialer's control files: descriptors it passed, or the
	// mappings of those it named (ctlNamed).
	fds  []int
	maps []peerMapping
	cred *unix.Ucred // the dialer, by the kernel's word
	peer peerID      // and its process
	used atomic.Bool
}

// dropCtl gives back what the request holds of the dialer's files.
func (r *connReq) dropCtl() {
	closeFDs(r.fds)
	releaseMaps(r.maps)
	r.fds, r.maps = nil, nil
}

func (r *connReq) PeerPrivate() []byte {
	return transport.PadPrivate(r.info.private, transport.PrivateLenConnect)
}

func (r *connReq) RemoteAddr() net.Addr {
	return &Addr{IP: r.info.addr.Addr(), Port: int(r.info.addr.Port())}
}

// rejectMsg is a reject carrying private, cut to what fits.
func rejectMsg(private []byte) []byte {
	private = private[:min(len(private), maxPrivate)]
	return append([]byte{msgReject, byte(len(private))}, private...)
}

func (r *connReq) Reject(private []byte) error {
	if r.used.Swap(true) {
		return errors.New("shm: connection request already answered")
	}
	defer r.s.close()
	r.dropCtl()
	if err := r.s.send(rejectMsg(private)); err != nil {
		return fmt.Errorf("shm: reject: %w", err)
	}
	return nil
}

func (r *connReq) Accept(ctx context.Context, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	if r.used.Swap(true) {
		return nil, errors.New("shm: connection request already answered")
	}
	if len(private) > maxPrivate {
		r.dropCtl()
		r.s.close()
		return nil, fmt.Errorf("shm: accept: %d bytes of private data, max %d: %w", len(private), maxPrivate, transport.ErrInvalidWR)
	}
	// The connection lives on the device its PD is from: the listener's,
	// or the one of the peer process (Device).
	d := r.l.dev
	if p, ok := cfg.PD.(*pd); ok && p != nil && p.dev.parent == r.l.dev {
		d = p.dev
	}
	// Until our answer is sent, a failure is told to the dialer as a
	// reject with its reason (out of descriptors, most often), not a bare
	// close that it reads as an end of file.
	refuse := func(err error) { r.s.send(rejectMsg(listenerFailure(err))) }
	q, err := d.newQP(cfg)
	if err != nil {
		r.dropCtl()
		refuse(err)
		r.s.close()
		return nil, err
	}
	fail := func(err error) (transport.QP, error) {
		r.s.close()
		q.Close()
		return nil, fmt.Errorf("shm: accept from %v: %w", r.RemoteAddr(), err)
	}
	same := int(r.cred.Pid) == ownPID
	var p *peer
	if r.maps != nil {
		p, err = newPeerOf(r.info, r.maps, same)
	} else {
		p, err = newPeer(r.info, r.fds, same)
	}
	r.fds, r.maps = nil, nil
	if err != nil {
		refuse(err)
		return fail(err)
	}
	d.keepCtl(p)
	q.peer = p
	local := &Addr{IP: r.l.addr.IP, Port: r.l.addr.Port}
	if local.IP.IsUnspecified() {
		local.IP = r.info.addr.Addr()
		if !local.IP.IsValid() || local.IP.IsUnspecified() {
			local.IP = netip.AddrFrom4([4]byte{127, 0, 0, 1})
		}
	}
	q.local, q.remote = local, r.RemoteAddr()
	info := q.info(local, private)
	info.flags = acceptFlags
	if d.namesCtl() && d.peer == r.peer {
		info.held = d.heldCtl()
	}
	fds, err := q.shareCtl(info, r.info.held)
	if err != nil {
		refuse(err)
		return fail(err)
	}
	err = r.s.send(info.encode(msgAccept), fds...)
	closeFDs(fds)
	if err != nil {
		return fail(err)
	}
	// Started now, not once the dialer says it mapped our memory
	// (msgReady, which the dialer sends only to listeners without
	// acceptNoReady, and the socket poller reads and ignores): what we
	// write lands in the dialer's ring, which it made before it asked,
	// and waits for its first poll, as data a TCP server writes at accept
	// waits in the client's socket. Waiting cost every new connection a
	// wake-up of this process before the application had it: about 50 µs
	// of a gRPC connection's set-up on a 2-core VM, and the server's
	// HTTP/2 settings, which the client waits for, one more wake-up of
	// the dialer's.
	if err := q.start(r.s, p, r.info.private, transport.PrivateLenConnect); err != nil {
		return fail(err)
	}
	return q, nil
}

// acceptFlags are the flags a listener's accept carries (a variable for
// the tests that play a listener without acceptNoReady).
var acceptFlags byte = acceptNoReady

var localPorts atomic.Uint32

func (d *device) Connect(ctx context.Context, addr string, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	if err := checkPrivate(addr, private); err != nil {
		return nil, err
	}
	ip, port, c, cred, err := dialAddr(ctx, addr)
	if err != nil {
		return nil, err
	}
	return d.connectOn(ctx, c, cred, addr, ip, port, cfg, private)
}

// checkPrivate refuses a connect request's private data beyond maxPrivate.
func checkPrivate(addr string, private []byte) error {
	if len(private) > maxPrivate {
		return fmt.Errorf("shm: connect to %s: %d bytes of private data, max %d: %w", addr, len(private), maxPrivate, transport.ErrInvalidWR)
	}
	return nil
}

// dialAddr resolves addr, refuses another host's, and connects to its
// listener's socket, whose process passed ctx's peer check (dialShm).
func dialAddr(ctx context.Context, addr string) (netip.Addr, int, *rawSock, *unix.Ucred, error) {
	ip, port, err := resolve(ctx, addr)
	if err != nil {
		return ip, 0, nil, nil, err
	}
	var c *rawSock
	var cred *unix.Ucred
	if isLocal(ip) {
		c, cred, err = dialShm(ctx, ip, port)
	} else {
		// Another namespace's address: only through a socket directory.
		dir, derr := sockDir()
		if derr != nil || dir == "" {
			return ip, 0, nil, nil, errors.Join(errNotLocal("connect to", addr, ip), derr)
		}
		c, cred, err = dialDir(dir, ip, port, transport.PeerCheckFrom(ctx))
	}
	if err != nil {
		return ip, 0, nil, nil, fmt.Errorf("shm: connect to %s: %w", addr, err)
	}
	return ip, port, c, cred, nil
}

// connectOn sets up a connection over c, a socket connected to the
// listener of addr; cred, if known, is c's peer's.
func (d *device) connectOn(ctx context.Context, c sock, cred *unix.Ucred, addr string, ip netip.Addr, port int, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	q, err := d.sendConnect(c, addr, ip, port, cfg, private)
	if err != nil {
		return nil, err
	}
	if err := q.awaitAccept(ctx, time.Time{}, cred, addr, nil); err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

// sendConnect makes the QP and sends the connect request over c, which
// it closes on error.
func (d *device) sendConnect(c sock, addr string, ip netip.Addr, port int, cfg transport.QPConfig, private []byte) (*qp, error) {
	q, err := d.newQP(cfg)
	if err != nil {
		c.close()
		return nil, err
	}
	fail := func(err error) (*qp, error) {
		c.close()
		q.Close()
		return nil, fmt.Errorf("shm: connect to %s: %w", addr, err)
	}
	localIP := ip
	if localIP.IsUnspecified() {
		localIP = netip.AddrFrom4([4]byte{127, 0, 0, 1})
	}
	q.local = &Addr{IP: localIP, Port: portLo + int(localPorts.Add(1))%(portHi-portLo)}
	q.remote = &Addr{IP: ip, Port: port}
	myInfo := q.info(q.local, private)
	// The listener's files we hold stay mapped until its answer, which
	// may name them.
	pins := q.dev.pinCtl()
	for _, k := range pins {
		myInfo.held = append(myInfo.held, k.key.ino)
	}
	q.pinned(pins)
	fds, err := q.shareCtl(myInfo, q.dev.peerHeld())
	if err != nil {
		return fail(err)
	}
	err = c.send(myInfo.encode(msgConnect), fds...)
	closeFDs(fds)
	if err != nil {
		return fail(err)
	}
	q.sock = c
	return q, nil
}

// awaitAccept waits for the listener's answer on q's socket (sendConnect
// sent the request on it), read by the socket poller, and starts q; on
// error the socket is closed and q is left for its owner to close. The
// wait ends at deadline (zero: none of the caller's) or with ctx, and in
// any case after the set-up timeout; e, an early dial's wait, lets
// Disconnect end it too. cred, if known, is the socket's peer's.
func (q *qp) awaitAccept(ctx context.Context, deadline time.Time, cred *unix.Ucred, addr string, e *earlyDial) error {
	c := q.sock
	w := newAnswerWait()
	q.answer.Store(w)
	leave := func() {
		w.leave() // kept in q.answer: the poller drops what comes
		sockets.remove(q)
	}
	fail := func(err error) error {
		leave()
		c.close()
		return fmt.Errorf("shm: connect to %s: %w", addr, err)
	}
	dl := time.Now().Add(setupTimeout)
	if !deadline.IsZero() && deadline.Before(dl) {
		dl = deadline
	}
	ctxDL, ctxHas := ctx.Deadline()
	if ctxHas && ctxDL.Before(dl) {
		dl = ctxDL
	}
	if e != nil && !e.startRead(w.ready) {
		return fail(net.ErrClosed)
	}
	t := time.NewTimer(time.Until(dl))
	next := func() sockMsg {
		if err := sockets.await(q); err != nil {
			return sockMsg{err: err}
		}
		select {
		case <-w.ready:
			if m, ok := w.take(); ok {
				return m
			}
			return sockMsg{err: net.ErrClosed} // end's word
		case <-ctx.Done():
			return sockMsg{err: ctx.Err()}
		case <-t.C:
			return sockMsg{err: os.ErrDeadlineExceeded}
		}
	}
	m := next()
	if m.err == nil && m.b[0] == msgNeedFDs {
		// The listener dropped the files our connect named.
		closeFDs(m.fds)
		if err := q.sendFDs(c); err != nil {
			m = sockMsg{err: err}
		} else {
			m = next()
		}
	}
	t.Stop()
	ended := e != nil && e.stopRead()
	b, rfds, err := m.b, m.fds, m.err
	if err != nil {
		switch {
		case ended:
			return fail(net.ErrClosed)
		case ctx.Err() != nil:
			return fail(ctx.Err())
		case ctxHas && !time.Now().Before(ctxDL):
			// The set-up's deadline, ctx's, fired before ctx's own
			// timer: callers read ctx.Err() to tell a time-out.
			<-ctx.Done()
			return fail(ctx.Err())
		case !deadline.IsZero() && !time.Now().Before(deadline):
			return fail(context.DeadlineExceeded)
		}
		// The listener went away before answering.
		return fail(fmt.Errorf("%w (%v)", transport.ErrConnRefused, err))
	}
	switch b[0] {
	case msgReject:
		closeFDs(rfds)
		priv := transport.PadPrivate(decodeReject(b), transport.PrivateLenReject)
		q.shared = false // the listener closed what it was handed
		leave()
		c.close()
		return &transport.RejectError{Addr: addr, Private: priv}
	case msgAccept:
	default:
		closeFDs(rfds)
		return fail(fmt.Errorf("unexpected message %d", b[0]))
	}
	info, err := decodeInfo(b)
	if err != nil {
		closeFDs(rfds)
		return fail(err)
	}
	pins := q.unpin()
	defer releaseKept(pins)
	// Who answered, by the kernel's word, not the peer's: SO_PEERCRED of
	// a connected socket is fixed at connect, so the caller may know it.
	var cerr error
	if cred == nil {
		cred, cerr = peerCred(c)
	}
	same := cerr == nil && int(cred.Pid) == ownPID
	var p *peer
	if info.flags&ctlNamed != 0 && len(rfds) == 0 {
		// Names resolve among the files of the process the pins are
		// of, which must be the one that answered.
		maps, ok := findCtl(pins, info.ctl[:])
		if !ok || cerr != nil || peerOf(cred) != q.dev.peer {
			releaseMaps(maps)
			return fail(errors.New("the accept named control files this side did not list as held"))
		}
		p, err = newPeerOf(info, maps, same)
	} else {
		p, err = newPeer(info, rfds, same)
	}
	if err != nil {
		return fail(err)
	}
	q.dev.keepCtl(p)
	q.dev.notePeerHolds(info.held)
	q.peer = p
	if info.flags&acceptNoReady == 0 {
		// A listener without acceptNoReady waits for this.
		if err := c.send([]byte{msgReady}); err != nil {
			return fail(err)
		}
	}
	// The socket is disarmed (one shot) since the answer: whatever came
	// after it is served once start arms it for good.
	w.finish()
	q.answer.Store(nil)
	if err := q.start(c, p, info.private, transport.PrivateLenAccept); err != nil {
		return fail(err)
	}
	return nil
}

// dialShm connects to the listener for ip:port, or to a wildcard listener
// on that port when ip is an address of this host, and returns the
// credentials of the process that answered. Either name is an abstract
// socket any local user may bind: a process that fails ctx's peer check
// (transport.ContextWithPeerCheck; by default, one of another user) is
// skipped before a byte is sent to it, as a name with no listener is.
func dialShm(ctx context.Context, ip netip.Addr, port int) (*rawSock, *unix.Ucred, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	check := transport.PeerCheckFrom(ctx)
	// The second name is made only when the first has no listener.
	other := netip.IPv4Unspecified() // for a local address (Connect checked)
	if ip.IsUnspecified() {
		other = netip.AddrFrom4([4]byte{127, 0, 0, 1})
	}
	var last, refused error
	for _, a := range [2]netip.Addr{ip, other} {
		name := sockName(a, port)
		c, err := dialSock(name)
		if err == nil {
			cred, cerr := peerCred(c)
			if cerr == nil {
				cerr = checkListener(cred, check)
			}
			if cerr == nil {
				return c, cred, nil
			}
			c.close()
			refused = fmt.Errorf("%w: %s: %v", transport.ErrListenerRefused, strings.TrimPrefix(name, "@"), cerr)
			continue
		}
		last = err
		if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.ENOENT) {
			return nil, nil, err
		}
	}
	if refused != nil {
		return nil, nil, refused
	}
	return nil, nil, fmt.Errorf("%w: nothing listens on port %d (%v)", transport.ErrConnRefused, port, last)
}

// dialerEUID is this process's effective uid: whose listeners a dial
// admits by default.
var dialerEUID = os.Geteuid()

// checkListener applies a dial's peer check to the process that answered;
// without one, only a listener of this process's effective user or of
// root passes (root may read this process's memory anyway).
func checkListener(cred *unix.Ucred, check func(pid, uid, gid int) error) error {
	if check == nil {
		if int(cred.Uid) != dialerEUID && cred.Uid != 0 {
			return fmt.Errorf("uid %d listens there, not this process's (%d)", cred.Uid, dialerEUID)
		}
		return nil
	}
	return check(int(cred.Pid), int(cred.Uid), int(cred.Gid))
}
