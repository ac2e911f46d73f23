package shm

import (
	"context"
	"errors"
	"fmt"
	"github.com/rdmagrpc/rdmagrpc/internal/hostload"
	"net"
	"net/netip"
	"runtime"
	"strconv"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Isolation between peer processes. A peer maps the MR table of the
// device its connection lives on and whole arenas of it (the receive
// rings and CQ headers at connect time, data arenas once it holds a key
// into them). If every connection of a process lived on one device, a
// process that bypasses this package could read and write every other
// connection's buffers in the arenas it was handed. So a device opened by
// Open has a child device per peer process, with an MR table and arenas
// of its own: conn makes a dialed connection's PD, CQ and memory on the
// child for the listener's process (Router.DeviceFor, which connects the
// socket first to learn who listens), and an accepted one's on the child
// for the dialer's process (RequestDevice). Many connections to one peer
// process share its child, so they still cost few descriptors and
// mappings; two peer processes never see each other's bytes, as two
// clients of a TCP server never do.

// peerID names a peer process: its pid and its start time (so that a
// reused pid is another peer). The kernel shows pid 0 for a process of
// a PID namespace this one cannot see into (a listener in a container
// sees every client outside it so), and the uid of a process whose user
// is not mapped in this user namespace as the overflow uid: neither
// tells two such processes apart. So a peer with pid 0 is never taken
// for another: it is named by the connection (solo), and each of its
// connections has a child of its own.
type peerID struct {
	pid   int
	start uint64
	uid   int
	solo  uint64 // pid 0: the connection's own number
}

func (p peerID) String() string {
	if p.pid == 0 {
		return "conn" + strconv.FormatUint(p.solo, 10)
	}
	return "pid" + strconv.Itoa(p.pid)
}

// soloPeers numbers the connections of peers whose pid is hidden.
var soloPeers atomic.Uint64

// peerOf names the process the kernel says is at the other end of a
// socket (SO_PEERCRED).
func peerOf(cred *unix.Ucred) peerID {
	id := peerID{pid: int(cred.Pid), uid: int(cred.Uid)}
	if id.pid == 0 {
		id.solo = soloPeers.Add(1)
		return id
	}
	id.start = startTime(id.pid)
	return id
}

// alive reports whether the peer may still use its child: its process
// still runs. A solo peer's child serves one connection, and is done with
// once that is closed.
func (p peerID) alive() bool {
	return p.pid != 0 && startTime(p.pid) == p.start && p.start != 0
}

// child returns the device for connections to peer, creating it; idle
// children of peers that exited are dropped on the way.
func (d *device) child(peer peerID) (*device, error) {
	if d.parent != nil {
		return d.parent.child(peer)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("shm: device %s closed: %w", d.name, net.ErrClosed)
	}
	if c := d.children[peer]; c != nil {
		return c, nil
	}
	for id, c := range d.children {
		// A child made moments ago is idle until its connection makes
		// its PD: only those older than a set-up are swept.
		if !id.alive() && c.idle() && time.Since(c.born) > setupTimeout {
			c.drop()
			delete(d.children, id)
		}
	}
	t, err := newMRTable()
	if err != nil {
		return nil, fmt.Errorf("shm: device for peer %v: %w", peer, err)
	}
	c := &device{
		name: d.name + "/" + peer.String(), mrs: t, parent: d, peer: peer, born: time.Now(),
		data: &pool{name: dataPool.name}, ctl: &pool{name: ctlPool.name},
	}
	if d.children == nil {
		d.children = map[peerID]*device{}
	}
	d.children[peer] = c
	if peer.pid != ownPID {
		// Its CPU time is this side's work, not a neighbour's: a peer
		// that works hard must not stop this process spinning for it.
		hostload.AddPeer(peer.pid)
	}
	return c, nil
}

// knownChild returns the device for connections to peer, if there is one.
func (d *device) knownChild(peer peerID) *device {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.children[peer]
}

// idle: nothing of the child is in use (no PD, CQ, memory, QP ring).
func (d *device) idle() bool {
	if d.pds.Load() != 0 || d.cqs.Load() != 0 {
		return false
	}
	allocs.Lock()
	defer allocs.Unlock()
	return d.data.empty() && d.ctl.empty()
}

// drop releases an idle child's MR table and arenas.
func (d *device) drop() error {
	if d.peer.pid != ownPID {
		hostload.DropPeer(d.peer.pid)
	}
	d.releaseArenas()
	allocs.Lock()
	err := errors.Join(d.data.drop(), d.ctl.drop())
	allocs.Unlock()
	return errors.Join(err, d.mrs.close())
}

// DeviceFor implements transport.Router: it connects to the listener of
// addr now and returns the device of that listener's process, on which
// the connection's PD, CQ and memory are to be made; its Connect uses
// the socket already connected. It is for one dial.
func (d *device) DeviceFor(ctx context.Context, addr string) (transport.Device, error) {
	ip, port, c, cred, err := dialAddr(ctx, addr)
	if err != nil {
		return nil, err
	}
	child, err := d.child(peerOf(cred))
	if err != nil {
		c.close()
		return nil, fmt.Errorf("shm: connect to %s: %w", addr, err)
	}
	h := &preDialed{c: c}
	dd := &dialDevice{device: child, pre: h, cred: cred, addr: addr, ip: ip, port: port}
	// A dial given up before Connect leaves its socket to the collector.
	runtime.AddCleanup(dd, func(h *preDialed) {
		if c := h.take(); c != nil {
			c.close()
		}
	}, h)
	return dd, nil
}

// preDialed is a socket connected by DeviceFor, taken once by Connect.
type preDialed struct {
	c     *rawSock
	taken atomic.Bool
}

func (h *preDialed) take() *rawSock {
	if h.taken.Swap(true) {
		return nil
	}
	return h.c
}

// dialDevice is the device DeviceFor returns: the peer process's device,
// with the socket to its listener already connected.
type dialDevice struct {
	*device
	pre  *preDialed
	cred *unix.Ucred // of the socket's peer: the answer comes over it
	addr string
	ip   netip.Addr
	port int
}

// Unwrap implements transport.DeviceWrapper.
func (dd *dialDevice) Unwrap() transport.Device { return dd.device }

func (dd *dialDevice) Connect(ctx context.Context, addr string, cfg transport.QPConfig, private []byte) (transport.QP, error) {
	c, err := dd.take(addr, private)
	if err != nil {
		return nil, err
	}
	return dd.device.connectOn(ctx, c, dd.cred, addr, dd.ip, dd.port, cfg, private)
}

// ConnectEarly implements transport.EarlyConnector: it returns once the
// request is in the listener's socket, as a TCP connect returns once the
// kernel queued it.
func (dd *dialDevice) ConnectEarly(ctx context.Context, addr string, cfg transport.QPConfig, private []byte) (transport.EarlyQP, error) {
	c, err := dd.take(addr, private)
	if err != nil {
		return nil, err
	}
	return dd.device.sendEarly(c, dd.cred, addr, dd.ip, dd.port, cfg, private)
}

// ConnectEarly implements transport.EarlyConnector on a device that did
// not pre-dial (Connect's counterpart).
func (d *device) ConnectEarly(ctx context.Context, addr string, cfg transport.QPConfig, private []byte) (transport.EarlyQP, error) {
	if err := checkPrivate(addr, private); err != nil {
		return nil, err
	}
	ip, port, c, cred, err := dialAddr(ctx, addr)
	if err != nil {
		return nil, err
	}
	return d.sendEarly(c, cred, addr, ip, port, cfg, private)
}

// sendEarly sends the connect request over c and returns its QP; cred,
// if known, is c's peer's.
func (d *device) sendEarly(c sock, cred *unix.Ucred, addr string, ip netip.Addr, port int, cfg transport.QPConfig, private []byte) (transport.EarlyQP, error) {
	q, err := d.sendConnect(c, addr, ip, port, cfg, private)
	if err != nil {
		return nil, err
	}
	q.early.Store(&earlyDial{cred: cred, addr: addr})
	return q, nil
}

// take hands the pre-dialed socket to the one connection to addr.
func (dd *dialDevice) take(addr string, private []byte) (*rawSock, error) {
	if err := checkPrivate(addr, private); err != nil {
		return nil, err
	}
	c := dd.pre.take()
	if c == nil || addr != dd.addr {
		if c != nil {
			c.close()
		}
		return nil, fmt.Errorf("shm: connect to %s: this device was prepared for one dial to %s", addr, dd.addr)
	}
	return c, nil
}

// Device implements transport.RequestDevice: the device of the dialing
// process.
func (r *connReq) Device() transport.Device {
	if c, err := r.l.dev.child(r.peer); err == nil {
		return c
	}
	// Without a device of its own the request is answered from the
	// listener's; Accept then refuses a PD of another device.
	return r.l.dev
}
