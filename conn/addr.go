package conn

import (
	"net"
	"net/netip"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// setQP makes qp the connection's, and its addresses c's: once, so that
// an early dial's Conn keeps the values grpc-go took at its return.
func (c *rdmaConn) setQP(qp transport.QP) {
	c.qp = qp
	if c.ends == nil {
		c.ends = &ends{local: tcpAddr(qp.LocalAddr()), remote: tcpAddr(qp.RemoteAddr())}
	}
}

// ends are an RDMA connection's addresses as grpc-go and its users read
// them, and the other key it is found by (trackAs).
type ends struct {
	local, remote net.Addr
	alias         net.Addr
}

// tcpAddr is a provider's address as a *net.TCPAddr: the IP, and the port
// in the provider's port space (RDMA CM's TCP port space on verbs; shm
// numbers its ends the same way). grpc-go's channelz, xDS filter chains,
// local credentials and IP-based authorization read a connection's
// addresses as TCP ones; the provider is on Stats (StatsFromContext).
func tcpAddr(a net.Addr) net.Addr {
	if a == nil {
		return nil
	}
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return a
	}
	return net.TCPAddrFromAddrPort(ap)
}

// LocalAddr is a *net.TCPAddr with the IP of this end and its port in
// the provider's port space.
func (c *rdmaConn) LocalAddr() net.Addr {
	if c.ends == nil { // never connected
		return nil
	}
	return c.ends.local
}

func (c *rdmaConn) RemoteAddr() net.Addr {
	if c.ends == nil {
		return nil
	}
	return c.ends.remote
}

func (c *rdmaConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rdl, c.wdl = t, t
	c.broadcastLocked()
	return nil
}

func (c *rdmaConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rdl = t
	c.broadcastLocked()
	return nil
}

func (c *rdmaConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wdl = t
	c.broadcastLocked()
	return nil
}
