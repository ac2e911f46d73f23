package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Conn is the telemetry of one connection: its span, the parent of its
// enlargement and rendezvous spans, and its place in the gauges.
type Conn struct {
	set      *Set
	role     string
	provider string
	id       uint64
	span     trace.Span
	// ctx carries span and nothing else: the dial context may be
	// cancelled or carry values the connection must not keep alive. Made
	// only when rec: it is the parent of child spans alone.
	ctx context.Context
	// rec: the connection span records, so child spans are worth making.
	rec   bool
	stall []metric.AddOption

	// Set by Connected before the connection's goroutines start, read
	// only after: no lock.
	attrs []attribute.KeyValue // on every child span
	snap  func() Snapshot

	mu     sync.Mutex
	reads  []trace.Span // the rendezvous read requests in flight, oldest first (at most two)
	failed error
	ended  bool
}

// StartConn starts the span of a connection being set up: ctx is the dial
// context (a span in it becomes the parent), or context.Background() for
// an accepted connection. Nil-safe: a nil Set gives a nil Conn.
func (s *Set) StartConn(ctx context.Context, role string, id uint64, provider, providerWhy string) *Conn {
	if s == nil {
		return nil
	}
	_, span := s.tracer.Start(ctx, SpanConn, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		KeyConnID.Int64(int64(id)), KeyRole.String(role), KeyProvider.String(provider), KeyProviderWhy.String(providerWhy),
		semconv.NetworkTransportKey.String(Transport)))
	c := &Conn{
		set: s, role: role, provider: provider, id: id, span: span,
		rec:   span.IsRecording(),
		stall: s.stallServer,
	}
	if role == Client {
		c.stall = s.stallClient
	}
	if c.rec { // child spans and their attrs, made only when this one records
		c.ctx = trace.ContextWithSpan(context.Background(), span)
		c.attrs = []attribute.KeyValue{KeyConnID.Int64(int64(id))}
	}
	return c
}

// Connected records the addresses and puts the connection in the gauges;
// snap is read at each collection until End. Call it before the
// connection's goroutines start.
func (c *Conn) Connected(local, remote net.Addr, snap func() Snapshot) {
	if c == nil {
		return
	}
	if c.rec { // the attributes are for spans only: none without one
		peer := append(addrAttrs(remote, semconv.NetworkPeerAddress, semconv.NetworkPeerPort), networkType(remote)...)
		c.attrs = append(append(c.attrs, semconv.NetworkTransportKey.String(Transport)), peer...)
		c.span.SetAttributes(peer...)
		c.span.SetAttributes(addrAttrs(local, semconv.NetworkLocalAddress, semconv.NetworkLocalPort)...)
	}
	c.snap = snap
	c.set.mu.Lock()
	c.set.live[c] = struct{}{}
	c.set.providers[c.provider] = struct{}{}
	c.set.mu.Unlock()
}

// Recording reports whether the connection span records: what only it
// would show need not be looked up otherwise.
func (c *Conn) Recording() bool { return c != nil && c.rec }

// Fabric records on the connection span the device the connection lives
// on and the path its traffic takes (Port 0: none, shm).
func (c *Conn) Fabric(device string, p transport.Path) {
	if c == nil || !c.rec {
		return
	}
	c.span.SetAttributes(KeyDevice.String(device))
	if p.Port == 0 {
		return
	}
	c.span.SetAttributes(KeyPort.Int(p.Port), KeyGIDIndex.Int(p.GIDIndex), KeyGIDType.String(p.GIDType),
		KeyPathMTU.Int(p.MTU), KeyTrafficClass.Int(p.TrafficClass), KeyServiceLevel.Int(p.ServiceLevel))
}

// addrAttrs splits a host:port address (every provider's form, the port
// being the connection manager's) into the semconv address and port.
func addrAttrs(a net.Addr, address func(string) attribute.KeyValue, port func(int) attribute.KeyValue) []attribute.KeyValue {
	if a == nil {
		return nil
	}
	host, p, err := net.SplitHostPort(a.String())
	if err != nil {
		return []attribute.KeyValue{address(a.String())}
	}
	kv := []attribute.KeyValue{address(host)}
	if n, err := strconv.Atoi(p); err == nil {
		kv = append(kv, port(n))
	}
	return kv
}

// networkType is network.type of the peer, when its host is an IP address.
func networkType(a net.Addr) []attribute.KeyValue {
	if a == nil {
		return nil
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return nil
	}
	ip, err := netip.ParseAddr(host)
	switch {
	case err != nil:
		return nil
	case ip.Unmap().Is4():
		return []attribute.KeyValue{semconv.NetworkTypeIPv4}
	default:
		return []attribute.KeyValue{semconv.NetworkTypeIPv6}
	}
}

// Fail marks the connection as failed (set-up refused, reset, protocol
// error); End then sets the error status with this reason.
func (c *Conn) Fail(err error) {
	if c == nil || err == nil {
		return
	}
	c.mu.Lock()
	if c.failed == nil {
		c.failed = err
	}
	c.mu.Unlock()
}

// End ends the connection span and takes the connection out of the
// gauges; later calls do nothing.
func (c *Conn) End() {
	if c == nil {
		return
	}
	c.set.mu.Lock()
	delete(c.set.live, c)
	c.set.mu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended {
		return
	}
	c.ended = true
	for _, r := range c.reads {
		r.SetStatus(codes.Error, "connection closed before the read request landed")
		r.End()
	}
	c.reads = nil
	if c.failed != nil {
		c.span.SetAttributes(semconv.ErrorTypeKey.String(errorType(c.failed)))
		c.span.SetStatus(codes.Error, c.failed.Error())
	}
	c.span.End()
}

// errorType is a low-cardinality error.type: the type of the innermost
// error, which is what a wrapped chain ends in (an errno, a provider's
// status error, a sentinel's type).
func errorType(err error) string {
	for {
		u := errors.Unwrap(err)
		if u == nil {
			return fmt.Sprintf("%T", err)
		}
		err = u
	}
}

// Registered records one memory registration of the connection's pool:
// the metrics, and an event on the connection span.
func (c *Conn) Registered(bytes int, d time.Duration, err error) {
	if c == nil {
		return
	}
	s := c.set
	ctx := context.Background()
	if err == nil {
		s.registrations.Add(ctx, 1, s.regOK...)
		s.regBytes.Add(ctx, int64(bytes), s.regOK...)
		s.regDuration.Record(ctx, d.Seconds(), s.regOKRecord...)
	} else {
		et := semconv.ErrorTypeKey.String(errorType(err))
		s.registrations.Add(ctx, 1, metric.WithAttributes(et))
		s.regDuration.Record(ctx, d.Seconds(), metric.WithAttributes(et))
	}
	if c.rec {
		kv := []attribute.KeyValue{KeyRegBytes.Int(bytes), KeyRegDuration.Float64(d.Seconds())}
		if err != nil {
			kv = append(kv, semconv.ErrorTypeKey.String(errorType(err)))
		}
		c.span.AddEvent(EventRegistration, trace.WithAttributes(kv...))
	}
}

// CreditStall counts a write that waits for credits: on the write path,
// so it allocates nothing.
func (c *Conn) CreditStall() {
	if c == nil {
		return
	}
	c.set.stalls.Add(context.Background(), 1, c.stall...)
}

// RendezvousOut counts an advert of n bytes sent.
func (c *Conn) RendezvousOut(n int) {
	if c == nil {
		return
	}
	c.set.rendezvous.Add(context.Background(), 1, c.set.transmit...)
	c.set.rendezvousBytes.Add(context.Background(), int64(n), c.set.transmit...)
}

// RendezvousIn counts an advert received.
func (c *Conn) RendezvousIn() {
	if c == nil {
		return
	}
	c.set.rendezvous.Add(context.Background(), 1, c.set.receive...)
}

// ReadRequested starts the span of a rendezvous read request (M5): n
// bytes of advert advert asked for at start. At most two are in flight
// (a reader asks for the next advert before the last lands), and they
// land in order.
func (c *Conn) ReadRequested(seq, advert uint32, n int, start time.Time) {
	if c == nil || !c.rec {
		return
	}
	_, span := c.set.tracer.Start(c.ctx, SpanRendezvousRead, trace.WithTimestamp(start),
		trace.WithAttributes(c.attrs...), trace.WithAttributes(
			KeyRdvBytes.Int(n), KeyRdvAdvert.Int64(int64(advert)), KeyRdvRequest.Int64(int64(seq))))
	c.mu.Lock()
	if len(c.reads) >= maxReads { // cannot happen; never leak a span
		c.reads[0].End()
		c.reads = c.reads[1:]
	}
	c.reads = append(c.reads, span)
	c.mu.Unlock()
}

// maxReads: the read requests a reader has in flight at most.
const maxReads = 2

// ReadLanded ends the oldest read request: its last segment's immediate
// came.
func (c *Conn) ReadLanded(n int) {
	if c == nil {
		return
	}
	c.set.rendezvousBytes.Add(context.Background(), int64(n), c.set.receive...)
	c.mu.Lock()
	var span trace.Span
	if len(c.reads) > 0 {
		span = c.reads[0]
		c.reads = c.reads[1:]
	}
	c.mu.Unlock()
	if span != nil {
		span.End()
	}
}

// Enlargement is one side of one enlargement (M3, M4).
type Enlargement struct {
	c        *Conn
	side     string
	span     trace.Span // nil unless the connection span records
	start    time.Time
	attempts int
}

// StartEnlargement starts an enlargement from slots of from bytes to
// count slots of to bytes, begun at start (the sender's first large
// write, the receiver's arrival of the control message).
func (c *Conn) StartEnlargement(side string, start time.Time, from, to, count int) *Enlargement {
	if c == nil {
		return nil
	}
	e := &Enlargement{c: c, side: side, start: start}
	if c.rec {
		name := SpanEnlargeSender
		if side == Receiver {
			name = SpanEnlargeReceiver
		}
		_, e.span = c.set.tracer.Start(c.ctx, name, trace.WithTimestamp(start),
			trace.WithAttributes(c.attrs...), trace.WithAttributes(
				KeySide.String(side), KeyFromSize.Int(from), KeyToSize.Int(to), KeyToCount.Int(count)))
	}
	return e
}

// Shrunk records a shrink (the sender's: its direction back to small; the
// receiver's: the peer's large ring dropped), begun at start and lasting
// d, from slots of from bytes to slots of to; links are the RPCs in
// flight. It returns the span's context, for links to it (invalid when
// there is no span).
func (c *Conn) Shrunk(side, reason string, start time.Time, d time.Duration, from, to int, links []trace.Link) trace.SpanContext {
	if c == nil {
		return trace.SpanContext{}
	}
	c.set.shrinks.Add(context.Background(), 1, metric.WithAttributes(KeySide.String(side), KeyShrinkReason.String(reason)))
	if !c.rec {
		return trace.SpanContext{}
	}
	_, span := c.set.tracer.Start(c.ctx, SpanShrink, trace.WithTimestamp(start), trace.WithLinks(links...),
		trace.WithAttributes(c.attrs...), trace.WithAttributes(
			KeySide.String(side), KeyShrinkReason.String(reason), KeyFromSize.Int(from), KeyToSize.Int(to)))
	span.End(trace.WithTimestamp(start.Add(d)))
	return span.SpanContext()
}

// Parked counts a park: side Sender, our small direction parked (its
// peer released the ring); Receiver, the peer's parked and we released
// our ring. No span: a park happens when nothing is in flight, and ten
// thousand idle connections would make ten thousand spans of nothing.
func (c *Conn) Parked(side string) {
	if c == nil {
		return
	}
	c.set.parks.Add(context.Background(), 1, metric.WithAttributes(KeySide.String(side)))
}

// SpanContext is the enlargement span's, for links to it; invalid when
// it has none (telemetry off, or not recording).
func (e *Enlargement) SpanContext() trace.SpanContext {
	if e == nil || e.span == nil {
		return trace.SpanContext{}
	}
	return e.span.SpanContext()
}

// Link links the enlargement's span to spans it concerns (the RPCs in
// flight when it started).
func (e *Enlargement) Link(links []trace.Link) {
	if e == nil || e.span == nil {
		return
	}
	for _, l := range links {
		e.span.AddLink(l)
	}
}

// Requested notes a control message sent (attempt counts from 1).
func (e *Enlargement) Requested(attempt int) {
	if e == nil {
		return
	}
	e.attempts = attempt
	if e.span != nil {
		e.span.AddEvent(EventEnlargeRequest, trace.WithAttributes(KeyAttempt.Int(attempt)))
	}
}

// Answered notes the peer's answer (sender), or ours sent (receiver).
func (e *Enlargement) Answered(ack bool) {
	if e == nil || e.span == nil {
		return
	}
	switch {
	case e.side == Receiver:
		e.span.AddEvent(EventEnlargeAnswered, trace.WithAttributes(attribute.Bool("rdmagrpc.enlargement.ack", ack)))
	case ack:
		e.span.AddEvent(EventEnlargeAck)
	default:
		e.span.AddEvent(EventEnlargeRefusal)
	}
}

// Registration records how long provisioning this side's large buffers
// took (getting them from the pool: allocation and registration).
func (e *Enlargement) Registration(d time.Duration) {
	if e == nil || e.span == nil {
		return
	}
	e.span.SetAttributes(KeyRegDuration.Float64(d.Seconds()))
}

// End finishes the enlargement with its outcome and the sending or
// receiving phase it leaves, d after it started (0: now; the sender
// passes the duration its Stats and the eBPF marker report, so all three
// agree); reason explains a failed outcome and becomes the span's error
// status.
func (e *Enlargement) End(outcome Outcome, phase string, d time.Duration, reason error) {
	if e == nil {
		return
	}
	if d <= 0 {
		d = time.Since(e.start)
	}
	s := e.c.set
	attrs := metric.WithAttributes(KeySide.String(e.side), KeyOutcome.String(string(outcome)))
	s.enlargements.Add(context.Background(), 1, attrs)
	s.enlargeDuration.Record(context.Background(), d.Seconds(), attrs)
	if e.span == nil {
		return
	}
	// Ends where the metric's duration does.
	defer e.span.End(trace.WithTimestamp(e.start.Add(d)))
	e.span.SetAttributes(KeyOutcome.String(string(outcome)), KeyPhase.String(phase))
	if e.side == Sender {
		e.span.SetAttributes(KeyAttempts.Int(e.attempts))
	}
	if reason != nil {
		e.span.SetAttributes(semconv.ErrorTypeKey.String(string(outcome)))
		e.span.SetStatus(codes.Error, reason.Error())
	}
}

// Abort ends an enlargement that has no outcome (the connection closed or
// failed under it): error status, not counted.
func (e *Enlargement) Abort(err error) {
	if e == nil || e.span == nil {
		return
	}
	e.span.SetAttributes(semconv.ErrorTypeKey.String(errorType(err)))
	e.span.SetStatus(codes.Error, err.Error())
	e.span.End()
}
