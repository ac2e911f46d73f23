package conn

import (
	"context"
	"net"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// Transport events on the RPC spans that paid for them.
//
// StatsHandler's handler finds the connection under each RPC by the
// net.Addr values grpc-go passes it (OutHeader on a client, InHeader on a
// server): grpc-go takes them from the net.Conn once, so they are our
// Conn's own values, and a map keyed by the remote one's identity (never
// its text, which two shm connections may share) finds that Conn exactly
// and without allocating. While a recording RPC is in flight on a
// connection, the connection knows its span: each transport event that
// ends then is added to it, and an enlargement that starts then links to
// it.
//
// "During" is exact and narrow: an event is on an RPC's span when it
// ended on the RPC's connection between the RPC's start on that
// connection (its headers written, on a client; read, on a server) and
// its end as grpc-go reports it. An enlargement the RPC waited for ends
// while it waits, so it is there; one that ended just before it started,
// or that an RPC left running behind it, is not. Every RPC on a
// multiplexed connection in flight when an event ended gets it: the
// transport does not know which HTTP/2 stream a slot carried, and an
// enlargement or a stall holds up every stream of its direction.

// StatsHandler returns a grpc-go stats.Handler that puts rdmagrpc's
// transport events on the RPC spans (grpc.WithStatsHandler on a client,
// grpc.StatsHandler on a server). It reads the span from the RPC's
// context, so it goes after otelgrpc's handler, which starts that span:
//
//	grpc.WithStatsHandler(otelgrpc.NewClientHandler()),
//	grpc.WithStatsHandler(conn.StatsHandler()),
//
// On each RPC's span it sets rdmagrpc.connection.id, rdmagrpc.provider and
// rdmagrpc.buffer.phase (of the sending direction at the RPC's start), and
// adds an event per enlargement and rendezvous transfer that ended on that
// connection while the RPC was in flight, with a link to the enlargement's
// span, and one event with the credit stalls of that time and their total
// wait. An RPC whose span does not record costs nothing: no allocation,
// no lock.
func StatsHandler() stats.Handler { return statsHandler{} }

type statsHandler struct{}

type rpcKey struct{}

// rpcState is one recording RPC, from TagRPC to End. Its fields are
// guarded by its mutex: grpc-go may report End from another goroutine
// than the one that reports the headers (a client's context watcher).
type rpcState struct {
	span trace.Span

	mu      sync.Mutex
	c       *connCore // once the RPC is on a connection
	ended   bool
	flushed bool // the stalls are on the span
	// The connection's stall counters when the RPC started on it.
	stalls    uint64
	stallWait int64
}

func (statsHandler) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (statsHandler) HandleConn(context.Context, stats.ConnStats) {}

func (statsHandler) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return ctx
	}
	return context.WithValue(ctx, rpcKey{}, &rpcState{span: span})
}

func (statsHandler) HandleRPC(ctx context.Context, s stats.RPCStats) {
	st, _ := ctx.Value(rpcKey{}).(*rpcState)
	if st == nil {
		return
	}
	switch s := s.(type) {
	case *stats.OutHeader:
		if s.Client {
			st.attach(s.RemoteAddr)
		}
	case *stats.InHeader:
		if !s.Client {
			st.attach(s.RemoteAddr)
		}
	case *stats.InTrailer, *stats.OutTrailer:
		// The last events before End, whose handlers run in the order
		// they were given: otelgrpc's, before ours, ends the span.
		st.flushStalls()
	case *stats.End:
		st.flushStalls() // no trailer: a failed RPC
		st.end()
	}
}

func (st *rpcState) attach(remote net.Addr) {
	c := lookupConn(remote)
	if c == nil {
		return
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.c != nil || st.ended {
		return
	}
	st.c = c.core()
	st.span.SetAttributes(c.rpcAttrs()...)
	r := &st.c.rpcs
	r.mu.Lock()
	st.stalls, st.stallWait = r.stalls.Load(), r.stallWait.Load()
	r.inflight = append(r.inflight, st)
	r.n.Store(int32(len(r.inflight)))
	r.mu.Unlock()
}

// flushStalls puts the credit stalls that ended while the RPC was in
// flight on its span, once.
func (st *rpcState) flushStalls() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.c == nil || st.flushed {
		return
	}
	st.flushed = true
	r := &st.c.rpcs
	if n := r.stalls.Load() - st.stalls; n > 0 {
		wait := time.Duration(r.stallWait.Load() - st.stallWait)
		st.span.AddEvent(telemetry.EventCreditStalls, trace.WithAttributes(
			telemetry.KeyStallCount.Int64(int64(n)), telemetry.KeyStallWait.Float64(wait.Seconds())))
	}
}

func (st *rpcState) end() {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.ended = true
	c := st.c
	if c == nil {
		return
	}
	r := &c.rpcs
	r.mu.Lock()
	if i := slices.Index(r.inflight, st); i >= 0 {
		r.inflight = slices.Delete(r.inflight, i, i+1)
	}
	r.n.Store(int32(len(r.inflight)))
	r.mu.Unlock()
}

// rpcTrack is a connection's part: its recording RPCs in flight and its
// credit stall counters.
type rpcTrack struct {
	n         atomic.Int32 // len(inflight), read without the lock
	stalls    atomic.Uint64
	stallWait atomic.Int64 // nanoseconds

	mu       sync.Mutex // after c.mu
	inflight []*rpcState
}

// rpcsInFlight says a transport event has RPC spans to go on: call sites
// build their attributes only then.
func (c *connCore) rpcsInFlight() bool { return c.rpcs.n.Load() > 0 }

// stalled accounts a credit stall that waited d.
func (c *connCore) stalled(d time.Duration) {
	c.rpcs.stalls.Add(1)
	c.rpcs.stallWait.Add(int64(d))
}

// rpcEvent adds a transport event that ended at end to the spans of the
// RPCs in flight, with a link to the event's own span when it has one.
func (c *connCore) rpcEvent(name string, end time.Time, link trace.SpanContext, attrs ...attribute.KeyValue) {
	if link.IsValid() {
		// Which link is this event's: the span it leads to.
		attrs = append(attrs, telemetry.KeyLinkSpan.String(link.SpanID().String()))
	}
	r := &c.rpcs
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, st := range r.inflight {
		st.span.AddEvent(name, trace.WithTimestamp(end), trace.WithAttributes(attrs...))
		if link.IsValid() {
			st.span.AddLink(trace.Link{SpanContext: link, Attributes: []attribute.KeyValue{telemetry.KeyLinkEvent.String(name)}})
		}
	}
}

// rpcLinks are links to the spans of the RPCs in flight, for a transport
// event's span that starts now.
func (c *connCore) rpcLinks() []trace.Link {
	r := &c.rpcs
	r.mu.Lock()
	defer r.mu.Unlock()
	links := make([]trace.Link, 0, min(len(r.inflight), maxRPCLinks))
	for _, st := range r.inflight[:min(len(r.inflight), maxRPCLinks)] {
		links = append(links, trace.Link{SpanContext: st.span.SpanContext()})
	}
	return links
}

// maxRPCLinks bounds the links of one event's span (an SDK keeps 128 by
// default); the RPC spans hold the event either way.
const maxRPCLinks = 64

// liveConns finds a Conn by its RemoteAddr value (see the top of this
// file). Only pointer-typed addresses go in: their identity is the
// connection's, and they are always comparable.
var liveConns = struct {
	sync.Mutex
	m map[net.Addr]tracked
}{m: map[net.Addr]tracked{}}

// tracked is a connection that StatsHandler and StatsFromContext find by
// its remote address: over RDMA or over TCP.
type tracked interface {
	core() *connCore
	Stats() Stats
	rpcAttrs() []attribute.KeyValue // what an RPC span on it is given
}

func (c *connCore) core() *connCore { return c }

func (c *rdmaConn) rpcAttrs() []attribute.KeyValue {
	c.mu.Lock()
	phase := telemetry.Small
	if c.sending == large {
		phase = telemetry.Large
	}
	c.mu.Unlock()
	return []attribute.KeyValue{telemetry.KeyConnID.Int64(int64(c.id)), telemetry.KeyProvider.String(c.st.Provider), telemetry.KeyPhase.String(phase)}
}

func (c *tcpConn) rpcAttrs() []attribute.KeyValue {
	return []attribute.KeyValue{telemetry.KeyConnID.Int64(int64(c.id)), telemetry.KeyProvider.String(c.provider)}
}

func byIdentity(a net.Addr) bool {
	return a != nil && reflect.TypeOf(a).Kind() == reflect.Pointer
}

// trackAddr makes c found by a, where a's identity is the connection's.
func trackAddr(a net.Addr, c tracked) {
	if byIdentity(a) {
		liveConns.Lock()
		liveConns.m[a] = c
		liveConns.Unlock()
	}
}

// untrackLocked stops a finding c, if it still does; liveConns is held.
func untrackLocked(a net.Addr, c tracked) {
	if byIdentity(a) && liveConns.m[a] == c {
		delete(liveConns.m, a)
	}
}

func (c *rdmaConn) track() { trackAddr(c.RemoteAddr(), c) }

// trackAs makes c found by a too: the RemoteAddr of the dial's Conn
// whose negotiation upgraded to c (lazy.go), which grpc-go holds.
func (c *rdmaConn) trackAs(a net.Addr) {
	if !byIdentity(a) {
		return
	}
	liveConns.Lock()
	c.ends.alias = a
	liveConns.m[a] = c
	liveConns.Unlock()
}

func (c *rdmaConn) untrack() {
	liveConns.Lock()
	defer liveConns.Unlock()
	untrackLocked(c.RemoteAddr(), c)
	if c.ends != nil {
		untrackLocked(c.ends.alias, c)
	}
}

// track and untrack a connection over TCP (its Conn is found by its
// socket's address; a dial that upgrades is found by it too: trackAs).
func (c *tcpConn) track() { trackAddr(c.nc.RemoteAddr(), c) }

func (c *tcpConn) untrack() {
	liveConns.Lock()
	defer liveConns.Unlock()
	untrackLocked(c.nc.RemoteAddr(), c)
}

func lookupConn(a net.Addr) tracked {
	if !byIdentity(a) {
		return nil
	}
	liveConns.Lock()
	defer liveConns.Unlock()
	return liveConns.m[a]
}

// StatsFromContext returns the Stats of the rdmagrpc connection an RPC
// runs on, from a gRPC server handler's or interceptor's context (its
// peer.Peer); false when the RPC is not on an open rdmagrpc connection
// (a listener that is not conn's, or the connection closed since).
// Stats.Provider says what carries the RPC's bytes: grpc-go shows every
// rdmagrpc connection's addresses as TCP ones (see Conn.RemoteAddr).
func StatsFromContext(ctx context.Context) (Stats, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return Stats{}, false
	}
	return StatsFromPeer(p)
}

// StatsFromPeer is StatsFromContext for a peer.Peer, as a client gets it
// with the grpc.Peer call option.
func StatsFromPeer(p *peer.Peer) (Stats, bool) {
	if p == nil {
		return Stats{}, false
	}
	c := lookupConn(p.Addr)
	if c == nil {
		return Stats{}, false
	}
	return c.Stats(), true
}
