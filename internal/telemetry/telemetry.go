// Package telemetry is rdmagrpc's OpenTelemetry instrumentation: a span
// per connection, per enlargement on each side and per rendezvous read,
// and the metrics listed in README.md ("Metrics").
//
// conn holds one *Conn per connection and calls it at the points of the
// protocol; every method is safe on a nil *Conn, which is what a
// connection made without telemetry has. Only the API is imported here:
// the SDK is the application's choice.
//
// Cost: nothing here runs per ring Write except CreditStall, and the
// per-write hooks (CreditStall, RendezvousOut, RendezvousIn) add to
// instruments with attribute options built once per connection, so with
// no provider configured (the otel globals left as they are) they
// allocate nothing. Child spans are started only when the connection span
// records: with no provider, or an unsampled connection, an enlargement or
// a rendezvous read costs no span at all.
package telemetry

import (
	"context"
	"maps"
	"reflect"
	"slices"
	"sync"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the tracer and the meter.
const ScopeName = "github.com/rdmagrpc/rdmagrpc/conn"

// Span names.
const (
	SpanConn             = "rdmagrpc.connection"
	SpanEnlargeSender    = "rdmagrpc.enlargement.sender"
	SpanEnlargeReceiver  = "rdmagrpc.enlargement.receiver"
	SpanRendezvousRead   = "rdmagrpc.rendezvous.read"
	SpanShrink           = "rdmagrpc.shrink"
	EventRegistration    = "rdmagrpc.registration"
	EventEnlargeRequest  = "rdmagrpc.enlargement.request"
	EventEnlargeAck      = "rdmagrpc.enlargement.ack"
	EventEnlargeRefusal  = "rdmagrpc.enlargement.refusal"
	EventEnlargeAnswered = "rdmagrpc.enlargement.answer"

	// Events on RPC spans (conn.StatsHandler): a transport event that
	// ended on the RPC's connection while the RPC was in flight.
	EventRPCEnlargement = "rdmagrpc.enlargement"
	EventRPCShrink      = "rdmagrpc.shrink"
	EventRPCRdvSent     = "rdmagrpc.rendezvous.sent"
	EventRPCRdvReceived = "rdmagrpc.rendezvous.received"
	EventCreditStalls   = "rdmagrpc.credit.stalls"
)

// Metric names, per the OpenTelemetry semantic conventions: a counter is
// named for what it counts (plural, no ".count" suffix, which the
// conventions keep for UpDownCounters and which would read as the
// "_count" series of a histogram once exported to Prometheus), units are
// UCUM ("By", "s") or a {annotation}, and durations are histograms in s.
const (
	MetricConnections     = "rdmagrpc.connection.count"
	MetricRegistered      = "rdmagrpc.memory.registered"
	MetricEnlargements    = "rdmagrpc.enlargements"
	MetricEnlargeDuration = "rdmagrpc.enlargement.duration"
	MetricShrinks         = "rdmagrpc.shrinks"
	MetricParks           = "rdmagrpc.parks"
	MetricRegistrations   = "rdmagrpc.registrations"
	MetricRegBytes        = "rdmagrpc.registration.bytes"
	MetricRegDuration     = "rdmagrpc.registration.duration"
	MetricCreditStalls    = "rdmagrpc.credit.stalls"
	MetricRendezvous      = "rdmagrpc.rendezvous.messages"
	MetricRendezvousBytes = "rdmagrpc.rendezvous.bytes"
)

// Attribute keys of the rdmagrpc namespace.
const (
	KeyConnID      = attribute.Key("rdmagrpc.connection.id")
	KeyRole        = attribute.Key("rdmagrpc.connection.role") // client | server
	KeyProvider    = attribute.Key("rdmagrpc.provider")        // verbs | shm | a wrapper's name
	KeyProviderWhy = attribute.Key("rdmagrpc.provider.reason") // why it was chosen (Stats.ProviderReason)
	KeyPhase       = attribute.Key("rdmagrpc.buffer.phase")    // small | large | rendezvous
	KeySide        = attribute.Key("rdmagrpc.enlargement.side")
	KeyFromSize    = attribute.Key("rdmagrpc.enlargement.from_size")
	KeyToSize      = attribute.Key("rdmagrpc.enlargement.to_size")
	KeyToCount     = attribute.Key("rdmagrpc.enlargement.to_count")
	KeyOutcome     = attribute.Key("rdmagrpc.enlargement.outcome")
	KeyAttempts    = attribute.Key("rdmagrpc.enlargement.attempts")
	KeyAttempt     = attribute.Key("rdmagrpc.enlargement.attempt")
	KeyRegDuration = attribute.Key("rdmagrpc.registration.duration") // seconds
	KeyRegBytes    = attribute.Key("rdmagrpc.registration.bytes")
	KeyRdvBytes    = attribute.Key("rdmagrpc.rendezvous.bytes")
	KeyRdvAdvert   = attribute.Key("rdmagrpc.rendezvous.advert")
	KeyRdvRequest  = attribute.Key("rdmagrpc.rendezvous.request")

	KeyEnlargeDuration = attribute.Key("rdmagrpc.enlargement.duration") // seconds
	KeyShrinkReason    = attribute.Key("rdmagrpc.shrink.reason")        // idle | pressure
	KeyRdvDuration     = attribute.Key("rdmagrpc.rendezvous.duration")  // seconds
	KeyStallCount      = attribute.Key("rdmagrpc.credit.stall.count")
	KeyStallWait       = attribute.Key("rdmagrpc.credit.stall.wait") // seconds, all stalls together
	KeyLinkEvent       = attribute.Key("rdmagrpc.link.event")        // on a link: the event it explains
	KeyLinkSpan        = attribute.Key("rdmagrpc.link.span_id")      // on an event: the span its link leads to

	// The device and, on verbs, the path a connection's traffic takes.
	KeyDevice       = attribute.Key("rdmagrpc.device")
	KeyPort         = attribute.Key("rdmagrpc.port")
	KeyGIDIndex     = attribute.Key("rdmagrpc.gid.index")
	KeyGIDType      = attribute.Key("rdmagrpc.gid.type") // RoCE v2 | IB/RoCE v1
	KeyPathMTU      = attribute.Key("rdmagrpc.path_mtu") // bytes
	KeyTrafficClass = attribute.Key("rdmagrpc.traffic_class")
	KeyServiceLevel = attribute.Key("rdmagrpc.service_level")
)

// Transport is the network.transport value of every rdmagrpc span.
// Semantic conventions have no value for RDMA: "tcp" would be false, and
// "udp", true only of RoCEv2's encapsulation, would hide that the
// transport layer is the InfiniBand reliable connection (on IB and RoCEv1
// there is no IP transport at all; on the shm provider, no network). The
// attribute is open to other values, so we name what the connection is.
const Transport = "rdma"

// Roles.
const (
	Client = "client"
	Server = "server"
)

// Sides of an enlargement.
const (
	Sender   = "sender"
	Receiver = "receiver"

	// Reasons of a shrink.
	ReasonIdle     = "idle"
	ReasonPressure = "pressure" // the peer's budget was short (its ask)
)

// Outcome is the rdmagrpc.enlargement.outcome of an enlargement.
type Outcome string

// The outcomes of conn's enlargement (conn/enlarge.go).
const (
	Enlarged     Outcome = "enlarged"      // sender: acknowledged, large buffers usable
	Refused      Outcome = "refused"       // sender: the peer could not provision
	TimedOut     Outcome = "timed_out"     // sender: no valid ack after the retries
	LocalError   Outcome = "local_error"   // sender: our own large staging failed
	Served       Outcome = "served"        // receiver: provisioned and acknowledged
	ServeRefused Outcome = "serve_refused" // receiver: could not provision, refused
)

// ProviderTCP is the provider of a connection that runs over TCP (a plain
// gRPC peer, or a fall-back): it has no buffer phase.
const ProviderTCP = "tcp"

// Phases of rdmagrpc.buffer.phase.
const (
	Small      = "small"
	Large      = "large"
	Rendezvous = "rendezvous"
)

// durationBuckets cover registrations (microseconds to a few ms on real
// devices) and enlargements (a round trip plus two registrations, up to
// the acknowledgement time-outs: 1 s × 3 by default).
var durationBuckets = []float64{
	1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
	1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
}

// Set is the tracer and the instruments of one pair of providers, shared
// by every connection made with them, with the connections that are open
// (the observable gauges sum over them).
type Set struct {
	tracer trace.Tracer

	enlargements    metric.Int64Counter
	shrinks         metric.Int64Counter
	parks           metric.Int64Counter
	enlargeDuration metric.Float64Histogram
	registrations   metric.Int64Counter
	regBytes        metric.Int64Counter
	regDuration     metric.Float64Histogram
	stalls          metric.Int64Counter
	rendezvous      metric.Int64Counter
	rendezvousBytes metric.Int64Counter

	// Attribute options built once: Add with these allocates nothing.
	transmit, receive []metric.AddOption
	stallClient       []metric.AddOption // by the connection's role
	stallServer       []metric.AddOption
	regOK             []metric.AddOption
	regOKRecord       []metric.RecordOption

	mu   sync.Mutex
	live map[*Conn]struct{}
	// providers: every provider a connection was made with (gauge series).
	providers map[string]struct{}
}

type providers struct {
	tp trace.TracerProvider
	mp metric.MeterProvider
}

// sets caches a Set per pair of providers: every Dial resolves its
// options, and observable instruments registered per Dial would be
// counted once per connection ever made. Providers are few and live as
// long as the process, so the cache is never pruned.
var (
	setsMu sync.Mutex
	sets   = map[providers]*Set{}
)

// For returns the Set of tp and mp; nil means the otel global provider
// (resolved now: a global set later reaches these instruments through the
// globals' delegation).
func For(tp trace.TracerProvider, mp metric.MeterProvider) *Set {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	k := providers{tp, mp}
	if !reflect.ValueOf(tp).Comparable() || !reflect.ValueOf(mp).Comparable() {
		// Cannot be a map key; a Set per call still counts right, its
		// gauges covering only its own connections.
		return newSet(tp, mp)
	}
	setsMu.Lock()
	defer setsMu.Unlock()
	if s, ok := sets[k]; ok {
		return s
	}
	s := newSet(tp, mp)
	sets[k] = s
	return s
}

func newSet(tp trace.TracerProvider, mp metric.MeterProvider) *Set {
	s := &Set{tracer: tp.Tracer(ScopeName, trace.WithSchemaURL(semconv.SchemaURL)), live: map[*Conn]struct{}{}, providers: map[string]struct{}{}}
	m := mp.Meter(ScopeName, metric.WithSchemaURL(semconv.SchemaURL))
	// Instrument errors are reported to otel's error handler by the SDK
	// and still return a usable (no-op) instrument: telemetry never stops
	// a connection.
	s.enlargements, _ = m.Int64Counter(MetricEnlargements, metric.WithUnit("{enlargement}"),
		metric.WithDescription("Buffer enlargements by side and outcome."))
	s.shrinks, _ = m.Int64Counter(MetricShrinks, metric.WithUnit("{shrink}"),
		metric.WithDescription("Returns of a direction to its small buffers, by side and reason."))
	s.parks, _ = m.Int64Counter(MetricParks, metric.WithUnit("{park}"),
		metric.WithDescription("Idle small rings whose pages went back to the system, by side."))
	s.enlargeDuration, _ = m.Float64Histogram(MetricEnlargeDuration, metric.WithUnit("s"),
		metric.WithDescription("Sender: first large write to usable large buffers; receiver: control message to acknowledgement sent."),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	s.registrations, _ = m.Int64Counter(MetricRegistrations, metric.WithUnit("{registration}"),
		metric.WithDescription("Memory registrations (RegMR calls) of connection buffer pools; error.type set on failure."))
	s.regBytes, _ = m.Int64Counter(MetricRegBytes, metric.WithUnit("By"),
		metric.WithDescription("Bytes registered by successful registrations."))
	s.regDuration, _ = m.Float64Histogram(MetricRegDuration, metric.WithUnit("s"),
		metric.WithDescription("Time spent in one memory registration call."),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	s.stalls, _ = m.Int64Counter(MetricCreditStalls, metric.WithUnit("{stall}"),
		metric.WithDescription("Writes that waited for the peer to return ring credits."))
	s.rendezvous, _ = m.Int64Counter(MetricRendezvous, metric.WithUnit("{message}"),
		metric.WithDescription("Rendezvous messages (adverts) sent and received."))
	s.rendezvousBytes, _ = m.Int64Counter(MetricRendezvousBytes, metric.WithUnit("By"),
		metric.WithDescription("Bytes advertised (transmit) and fetched (receive) by rendezvous."))
	_, _ = m.Int64ObservableUpDownCounter(MetricConnections, metric.WithUnit("{connection}"),
		metric.WithDescription("Open connections by role, provider and sending phase (tcp connections: no phase)."),
		metric.WithInt64Callback(s.observeConns))
	_, _ = m.Int64ObservableUpDownCounter(MetricRegistered, metric.WithUnit("By"),
		metric.WithDescription("Registered memory of open connections by buffer phase."),
		metric.WithInt64Callback(s.observeMemory))

	s.transmit = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(semconv.NetworkIODirectionTransmit))}
	s.stallClient = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(KeyRole.String(Client)))}
	s.stallServer = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(KeyRole.String(Server)))}
	s.receive = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(semconv.NetworkIODirectionReceive))}
	s.regOK = []metric.AddOption{metric.WithAttributeSet(*attribute.EmptySet())}
	s.regOKRecord = []metric.RecordOption{metric.WithAttributeSet(*attribute.EmptySet())}
	return s
}

// Snapshot is what the gauges read from an open connection.
type Snapshot struct {
	Large bool // the sending direction is enlarged
	// Registered memory: small rings and staging, large ones, and the
	// rest of the connection's pool (rendezvous regions, in use or kept
	// registered for reuse).
	SmallBytes, LargeBytes, RendezvousBytes int64
}

var (
	memAttrs = [3]metric.ObserveOption{
		metric.WithAttributes(KeyPhase.String(Small)),
		metric.WithAttributes(KeyPhase.String(Large)),
		metric.WithAttributes(KeyPhase.String(Rendezvous)),
	}
)

type observed struct {
	server   bool
	provider string
	Snapshot
}

// snapshots reads the open connections. It runs in a collection, outside
// every conn lock; each snapshot takes its connection's lock briefly.
func (s *Set) snapshots() []observed {
	s.mu.Lock()
	conns := make([]*Conn, 0, len(s.live))
	for c := range s.live {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	out := make([]observed, 0, len(conns))
	for _, c := range conns {
		out = append(out, observed{c.role == Server, c.provider, c.snap()})
	}
	return out
}

// observeConns reports every role and phase, zeros included, so that a
// series goes to 0 when its last connection closes instead of vanishing.
// Every provider seen since the Set was made keeps its series.
func (s *Set) observeConns(_ context.Context, o metric.Int64Observer) error {
	type key struct {
		provider      string
		server, large bool
	}
	n := map[key]int64{}
	for _, x := range s.snapshots() {
		n[key{x.provider, x.server, x.Large && x.provider != ProviderTCP}]++
	}
	s.mu.Lock()
	providers := slices.Sorted(maps.Keys(s.providers))
	s.mu.Unlock()
	for _, p := range providers {
		for _, server := range []bool{false, true} {
			role := KeyRole.String(Client)
			if server {
				role = KeyRole.String(Server)
			}
			if p == ProviderTCP {
				o.Observe(n[key{p, server, false}], metric.WithAttributes(role, KeyProvider.String(p)))
				continue
			}
			for _, large := range []bool{false, true} {
				phase := KeyPhase.String(Small)
				if large {
					phase = KeyPhase.String(Large)
				}
				o.Observe(n[key{p, server, large}], metric.WithAttributes(role, KeyProvider.String(p), phase))
			}
		}
	}
	return nil
}

func (s *Set) observeMemory(_ context.Context, o metric.Int64Observer) error {
	var n [3]int64
	for _, x := range s.snapshots() {
		n[0] += x.SmallBytes
		n[1] += x.LargeBytes
		n[2] += x.RendezvousBytes
	}
	for i := range n {
		o.Observe(n[i], memAttrs[i])
	}
	return nil
}
