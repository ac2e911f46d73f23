package conn

import (
	"context"
	"net"
	"time"

	"google.golang.org/grpc/mem"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Conn is an rdmagrpc connection, as Dial and Listener.Accept return it:
// over RDMA (a queue pair of the verbs or shm provider), or over TCP
// where the negotiation found no RDMA or a plain gRPC peer connected. It
// implements net.Conn; CloseWrite, SetLinger, WriteBuffers, ReadOnReady,
// Handshake, Stats, SetupSteps and ID are its additions.
type Conn struct {
	// Exactly one is set, for the connection's whole life: an RDMA
	// connection (conn.go) or a TCP one (tcp.go). A dial whose
	// negotiation runs behind it is a TCP one that hands every call to
	// the RDMA connection its negotiation found, once there is one
	// (lazy.go).
	rdma *rdmaConn
	tcp  *tcpConn
}

// connCore is what every connection has, over RDMA or TCP.
type connCore struct {
	id   uint64
	o    *options
	tel  *telemetry.Conn // nil-safe; see conn/telemetry.go
	rpcs rpcTrack        // the RPCs on it, for StatsHandler (rpcstats.go)
}

// Read reads data written by the peer; io.EOF once the peer closed its
// direction and everything before was read.
func (c *Conn) Read(b []byte) (int, error) {
	if c.tcp != nil {
		return c.tcp.Read(b)
	}
	return c.rdma.Read(b)
}

// Write writes b. Over RDMA, above the threshold it first enlarges this
// direction (an enlargement request and its acknowledgement): the call
// blocks until the peer's acknowledgement, a refusal, or the
// acknowledgement time-out, honouring the write deadline.
func (c *Conn) Write(b []byte) (int, error) {
	if c.tcp != nil {
		return c.tcp.Write(b)
	}
	return c.rdma.Write(b)
}

// WriteBuffers is the vectored write, checked element by element over
// RDMA: elements at or below the threshold go as they are; at the first
// element above it the connection is enlarged, so a small prefix goes
// through the small buffers and the rest, from the large element on,
// after the enlargement. Elements above the rendezvous threshold go by
// rendezvous.
func (c *Conn) WriteBuffers(v net.Buffers) (int64, error) {
	if c.tcp != nil {
		return c.tcp.WriteBuffers(v)
	}
	return c.rdma.WriteBuffers(v)
}

// ReadOnReady waits until the connection is readable (data, EOF or an
// error, within the read deadline), then takes a buffer of bufSize from
// pool and reads into it. It returns the buffer, which the caller puts
// back in pool, and the bytes read; on an error, no buffer.
func (c *Conn) ReadOnReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error) {
	if c.tcp != nil {
		return c.tcp.ReadOnReady(bufSize, pool)
	}
	return c.rdma.ReadOnReady(bufSize, pool)
}

// Close ends both directions: the peer reads what was written, then
// io.EOF. It returns at once (see SetLinger); every resource of the
// connection is released once the peer has what was written, or the
// linger ran out.
func (c *Conn) Close() error {
	if c.tcp != nil {
		return c.tcp.Close()
	}
	return c.rdma.Close()
}

// CloseWrite ends our direction: the peer reads io.EOF after the data.
func (c *Conn) CloseWrite() error {
	if c.tcp != nil {
		return c.tcp.CloseWrite()
	}
	return c.rdma.CloseWrite()
}

// SetLinger sets what Close does with data written but not yet delivered,
// as net.TCPConn's SetLinger: sec < 0 (the default), Close returns at
// once and the connection delivers it in the background, for at most
// DefaultLinger; sec == 0, Close discards it and tears down at once;
// sec > 0, Close blocks until it is delivered or sec seconds passed,
// then tears down. Over RDMA, data in the peer's rings is delivered in
// every case: only rendezvous messages, which the peer fetches from us,
// need us.
func (c *Conn) SetLinger(sec int) error {
	if c.tcp != nil {
		return c.tcp.SetLinger(sec)
	}
	return c.rdma.SetLinger(sec)
}

// SetDeadline sets the read and write deadlines, as net.Conn's.
func (c *Conn) SetDeadline(t time.Time) error {
	if c.tcp != nil {
		return c.tcp.SetDeadline(t)
	}
	return c.rdma.SetDeadline(t)
}

// SetReadDeadline sets the read deadline, as net.Conn's.
func (c *Conn) SetReadDeadline(t time.Time) error {
	if c.tcp != nil {
		return c.tcp.SetReadDeadline(t)
	}
	return c.rdma.SetReadDeadline(t)
}

// SetWriteDeadline sets the write deadline, as net.Conn's.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	if c.tcp != nil {
		return c.tcp.SetWriteDeadline(t)
	}
	return c.rdma.SetWriteDeadline(t)
}

// LocalAddr is the address of this end: over TCP, the TCP connection's;
// over RDMA, a *net.TCPAddr with the IP of this end and its port in the
// provider's port space. A dial that was upgraded after its TCP
// connection opened keeps that connection's addresses.
func (c *Conn) LocalAddr() net.Addr {
	if c.tcp != nil {
		return c.tcp.nc.LocalAddr()
	}
	return c.rdma.LocalAddr()
}

// RemoteAddr is the address of the peer's end, as LocalAddr is this
// end's.
func (c *Conn) RemoteAddr() net.Addr {
	if c.tcp != nil {
		return c.tcp.nc.RemoteAddr()
	}
	return c.rdma.RemoteAddr()
}

// Stats returns the connection's counters. It never waits for a peer: a
// dial whose negotiation has no verdict yet says ProviderNegotiating.
func (c *Conn) Stats() Stats {
	if c.tcp != nil {
		return c.tcp.Stats()
	}
	return c.rdma.Stats()
}

// SetupSteps is how long each step of the provider's part of the dial
// took, in order (verbs: rdma_cm's; transport.SetupTimer), on the dialing
// side; nil on the listening side, over TCP, and on providers that do not
// time them. A method, not a field of Stats: every Conn holds a Stats.
func (c *Conn) SetupSteps() []transport.SetupStep {
	if c.tcp != nil {
		return c.tcp.SetupSteps()
	}
	return c.rdma.SetupSteps()
}

// Handshake waits until the connection knows what it runs on: the
// negotiation behind its dial (see Dial) upgraded it to RDMA, or it
// carries on over TCP, and what was written before went out. It returns
// why neither, such as a listener's refusal or a server that closed.
// Read and Write wait for the negotiation themselves, as crypto/tls's
// Conn does its handshake (Stats does not: it says ProviderNegotiating
// until then); Handshake is for a caller that wants its outcome, or an
// error, at a point of its choosing, and it starts the negotiation of a
// dial that has written nothing yet. A dial to a listener known to offer
// RDMA, which returns once its request is sent, waits for the listener's
// answer the same way. A connection that never negotiated returns nil at
// once.
func (c *Conn) Handshake(ctx context.Context) error {
	if c.tcp != nil {
		return c.tcp.Handshake(ctx)
	}
	return c.rdma.Handshake(ctx)
}

// ID is the connection's identity: unique among the connections of this
// process (each end of a connection has its own), it is the
// rdmagrpc.connection.id of the connection's spans and of the RPC spans
// on it, and the id rdmatrace reads from the connection's markers. With
// the process id (rdmatrace's PID column, an OpenTelemetry resource's
// process.pid) it names one connection end on a host. A dial whose
// upgrade is negotiated behind its TCP connection keeps its ID: the
// upgraded connection takes the dial's.
func (c *Conn) ID() uint64 {
	if c.tcp != nil {
		return c.tcp.id
	}
	return c.rdma.id
}

func wrapRDMA(r *rdmaConn) *Conn { return &Conn{rdma: r} }
