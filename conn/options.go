package conn

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/logx"
	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// Option configures Listen, Dial and Dialer.
type Option func(*options)

type options struct {
	provider   string
	slotSize   int
	slotCount  int
	threshold  int
	largeSize  int
	largeCount int
	// more: the large phases above the first (WithBufferPhases), each a
	// step up the ladder a stalling direction climbs; ladder: the first
	// and more, made once by validate.
	more       []Phase
	ladder     []Phase
	recvCap    int // receives the deepest phase needs (validate; Conn.recvDepth)
	ackTimeout time.Duration
	ackRetries int
	budget     *bufpool.Budget
	freeSmall  bool
	idleShrink time.Duration // <= 0: never
	// Writes above rdvThreshold go by rendezvous, rdvChunk at a time
	// (0: the large ring's size; negative: never).
	rdvThreshold int
	rdvChunk     int
	pollSpin     time.Duration
	spinOnBusy   bool
	backlog      int
	peerCheck    func(pid, uid, gid int) error
	logger       *slog.Logger // nil: the process-wide one (SetLogger)
	// Mixed fleets (negotiate.go).
	noTCP          bool
	noFallback     bool
	upgradeTimeout time.Duration
	// providerWhy is why pickProvider chose the provider (Stats, span).
	providerWhy string
	// pinned: the provider was named (WithProvider, RDMAGRPC_PROVIDER),
	// so connections use it alone, never shm beside it (offer.go).
	pinned bool
	// OpenTelemetry: nil providers mean the otel globals; tel is what
	// setup resolved them to (nil: no telemetry, for tests).
	tracerProvider trace.TracerProvider
	meterProvider  metric.MeterProvider
	noTelemetry    bool
	tel            *telemetry.Set
}

// Defaults, for grpc-go's write pattern (at most 32 KiB per Write, 16 KiB
// frames): control frames and small RPCs are far below 1 KiB, so a small
// phase of four 1 KiB slots to receive into plus the same to stage sends
// keeps an idle connection at 8 KiB of registered memory per side
// (rsockets registers 256 KiB). The first write above the threshold
// enlarges that direction to sixteen 32 KiB slots, so one grpc-go write
// fills one slot and 512 KiB are in flight: with fewer slots a writer in
// another process runs out of credits and waits for the reader's credit
// return more often. A direction that keeps stalling even so climbs to a
// third phase, thirty-two 64 KiB slots (2 MiB). The two-process bench
// chose these sizes; its figures are in doc/benchmarks.md.
const (
	DefaultSlotSize   = 1024
	DefaultSlotCount  = 4
	DefaultLargeSize  = 32 << 10
	DefaultLargeCount = 16
	// DefaultDeepSize and DefaultDeepCount are the third phase's.
	DefaultDeepSize   = 64 << 10
	DefaultDeepCount  = 32
	DefaultAckTimeout = time.Second
	DefaultAckRetries = 2
	// DefaultRendezvousChunk is the most one advert holds, and so the
	// largest registered source and destination region a transfer uses;
	// a bigger write is several adverts, two in flight.
	DefaultRendezvousChunk = 4 << 20
	// DefaultPollSpin: see WithPollSpin.
	DefaultPollSpin = 500 * time.Microsecond
	// DefaultIdleShrink: see WithIdleShrink.
	DefaultIdleShrink = 30 * time.Second
)

func defaults() options {
	return options{
		slotSize: DefaultSlotSize, slotCount: DefaultSlotCount,
		largeSize: DefaultLargeSize, largeCount: DefaultLargeCount, more: []Phase{{DefaultDeepSize, DefaultDeepCount}},
		ackTimeout: DefaultAckTimeout, ackRetries: DefaultAckRetries,
		rdvChunk: DefaultRendezvousChunk, pollSpin: DefaultPollSpin,
		backlog: defaultBacklog(), upgradeTimeout: DefaultUpgradeTimeout,
		idleShrink: DefaultIdleShrink,
	}
}

// WithoutTCP turns the TCP side off: Listen serves rdmagrpc clients over
// the RDMA provider only (plain gRPC clients cannot reach it), and Dial
// dials RDMA directly, with no negotiation and no fall-back.
func WithoutTCP() Option { return func(o *options) { o.noTCP = true } }

// WithoutFallback makes a dial that cannot have RDMA (a plain gRPC
// server, a server without an RDMA device or with another provider, an
// upgrade that failed) fail with an error wrapping ErrNoRDMA, instead of
// carrying on over TCP. Such a dial waits for the negotiation's verdict
// inside Dial, so that its error comes from Dial.
func WithoutFallback() Option { return func(o *options) { o.noFallback = true } }

// WithUpgradeTimeout bounds the RDMA dial a listener's offer starts
// (default 2 s); past it the connection stays TCP. Only a peer whose RDMA
// address is offered but unreachable (RoCE: a NIC the route does not
// reach) waits that long, and only the first dial to it in 30 s: later
// ones stay on TCP at once. The dial itself has returned by then; its
// first read waits for the verdict.
func WithUpgradeTimeout(d time.Duration) Option {
	return func(o *options) { o.upgradeTimeout = max(d, time.Millisecond) }
}

// WithLogger sends what this listener's or dialer's connections have to
// say (the provider chosen and why, at debug level) to l instead of the
// process-wide logger (SetLogger).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// SetLogger sets the process-wide logger of rdmagrpc, used by the
// providers and by connections without WithLogger. rdmagrpc prints
// nothing by default: the logger starts out discarding, unless the
// environment variable RDMAGRPC_LOG names a level (debug, info, warn,
// error), which logs from that level up to standard error. nil restores
// the discarding logger. One exception: an RDMAGRPC_ variable that is no
// setting (a misspelling) is reported once, as a warning, to standard
// error when no logger is set.
func SetLogger(l *slog.Logger) { logx.Set(l) }

func (o *options) log() *slog.Logger {
	if o.logger != nil {
		return o.logger
	}
	return logx.L()
}

// WithPollSpin sets the longest a connection's completion loop keeps
// polling, yielding to other goroutines between polls, after its last
// completion before it arms the queue and sleeps (default 500 µs; 0:
// sleep at once). Under traffic the next completion lands meanwhile,
// which saves two wake-ups: ours, and the peer's wake-up of us (on shm a
// message on the connection's socket), since an unarmed queue is not
// notified. A spin shorter than the peer's answer pays the wake-ups
// anyway, so the default is longer than the server's work for a 256 KiB
// unary call on a small VM; doc/benchmarks.md has the runs that chose it.
//
// Below the ceiling each connection learns its own spin from how its
// quiet periods end (spin.go): a spin that runs out shrinks it, one that
// succeeds late, or a short sleep, grows it. A connection that goes quiet
// after each burst (a gRPC connection's set-up, a client between calls)
// stops paying the full spin every time; an idle one never pays. Past
// 50 µs each round of a spin also yields the processor, and at most two
// loops per processor spin at once. Aeron's IPC idle strategies and
// brpc's polling mode make the same trade. While the host is busy (see
// WithSpinOnBusyHost) connections do not spin at all, and work as with a
// WithPollSpin of 0: a completion loop arms the queue rather than leave
// it to a waiter. Raise it where answers take longer and CPU is to spare.
func WithPollSpin(d time.Duration) Option { return func(o *options) { o.pollSpin = max(d, 0) } }

// WithSpinOnBusyHost keeps connections spinning (within WithPollSpin)
// while the host is busy. By default a connection does not spin while
// processes other than this one and its peers on the host leave fewer
// than one and a half processors free (measured over 100 ms windows from
// /proc; a host found busy stays so until three windows in a row find it
// idle, or one finds the others all but stopped): there a spinning
// thread takes turns with them and with the peer it waits for, and
// answers come later than to a sleeping one.
// For a host whose other processes are known to yield, or a benchmark
// of spinning itself.
func WithSpinOnBusyHost() Option { return func(o *options) { o.spinOnBusy = true } }

// WithProvider picks the transport provider ("verbs" or "shm", either
// case, or another registered one), over RDMAGRPC_PROVIDER.
func WithProvider(name string) Option { return func(o *options) { o.provider = name } }

// WithSmallBuffers sets the slot size and count of the small phase: the
// pre-registered receive ring and send staging area each connection
// starts with (default 4 slots of 1 KiB: 8 KiB per idle side). One
// receive slot is kept for control records, so at least 3 are needed.
func WithSmallBuffers(size, count int) Option {
	return func(o *options) { o.slotSize, o.slotCount = size, count }
}

// WithThreshold sets the write size above which a direction is enlarged:
// such a write first asks the peer for large buffers and waits for its
// acknowledgement. Default: the small slot size.
func WithThreshold(n int) Option { return func(o *options) { o.threshold = n } }

// WithLargeBuffers sets the slot size and count of the large phase a
// direction's first enlargement asks for (default 16 slots of 32 KiB:
// one grpc-go write fills one slot, and 512 KiB are in flight). It is the
// whole ladder above the small phase: no deeper phase follows
// (WithBufferPhases sets more).
func WithLargeBuffers(size, count int) Option {
	return func(o *options) { o.largeSize, o.largeCount, o.more = size, count, nil }
}

// Phase is one step of the buffer ladder: Count slots of Size bytes in
// each receive ring (and send staging area, where the provider needs
// one).
type Phase struct{ Size, Count int }

// WithBufferPhases sets the whole ladder: the first phase is the small
// one every connection starts with (WithSmallBuffers), the second the
// first large one (WithLargeBuffers), and each further one a deeper ring
// that a large direction climbs to when it keeps stalling on credits
// (climbStalls waits for the peer's credits within climbWindow). A climb
// is a shrink record marked as a step followed by an enlargement request
// for the next phase, with the same guarantees as both. Idle and
// pressure shrinks go back to the first phase; the next enlargement asks
// for the second. A receiver provisions the largest of its own phases
// that fits what is asked, or its first large phase when its budget has
// no room for the step (no other connection is asked to shrink for a
// step up), so the two ends may have different ladders; a writer given
// less than it asked stops climbing. Default: 1 KiB × 4, 32 KiB × 16,
// 64 KiB × 32.
func WithBufferPhases(phases ...Phase) Option {
	return func(o *options) {
		if len(phases) == 0 {
			o.more = nil
			return
		}
		o.slotSize, o.slotCount = phases[0].Size, phases[0].Count
		if len(phases) > 1 {
			o.largeSize, o.largeCount = phases[1].Size, phases[1].Count
		}
		o.more = phases[min(2, len(phases)):]
	}
}

// largePhases is the ladder above the small phase (validate makes it).
func (o *options) largePhases() []Phase { return o.ladder }

// phaseFor is the large phase a receiver provisions for a request of
// count slots of size bytes: the largest of its own that is no larger,
// else its first.
func (o *options) phaseFor(size, count int) Phase {
	ph := o.largePhases()
	best := ph[0]
	for _, p := range ph {
		if p.Size*p.Count <= size*count && p.Size*p.Count > best.Size*best.Count {
			best = p
		}
	}
	return best
}

// levelFor is the index among the large phases of the largest one that
// holds at most n bytes (0 when none does).
func (o *options) levelFor(n int) int {
	level := 0
	for i, p := range o.largePhases() {
		if p.Size*p.Count <= n {
			level = i
		}
	}
	return level
}

// maxLarge is the deepest large phase's slot size and count (bounds of
// posted receives, send queue, inline size).
func (o *options) maxLarge() (size, count int) {
	for _, p := range o.largePhases() {
		size, count = max(size, p.Size), max(count, p.Count)
	}
	return size, count
}

// WithAckTimeout sets how long a writer waits for the enlargement
// acknowledgement, and how many times it asks again before going on with
// the small buffers (default 1 s, 2 retries). A missing or corrupt
// acknowledgement is asked for again; the data is delivered either way.
// After a failed enlargement the next large write asks again after a
// back-off (1 s, doubling with each failure in a row up to 1 min;
// Stats.EnlargeRetryAt).
func WithAckTimeout(d time.Duration, retries int) Option {
	return func(o *options) { o.ackTimeout, o.ackRetries = d, retries }
}

// WithRendezvousThreshold sets the write size (or net.Buffers element
// size) above which data goes by rendezvous (the reader asks, the writer
// RDMA-writes into the reader's registered memory) instead of through the
// rings: default, the large ring's whole size (32 KiB × 16), so grpc-go's
// default 32 KiB writes never use it and raised write buffer sizes do.
// Negative: never.
func WithRendezvousThreshold(n int) Option { return func(o *options) { o.rdvThreshold = n } }

// WithRendezvousChunk sets how much one rendezvous advert holds (default
// 4 MiB): the registered memory a transfer uses on each side. A bigger
// write is several adverts, two in flight, so a transfer holds at most
// twice this of registered source memory and this of destination.
func WithRendezvousChunk(n int) Option { return func(o *options) { o.rdvChunk = n } }

// WithFreeSmallOnEnlarge makes the receiving side deregister and free
// its small receive ring once the peer has moved to the large one: 4 KiB
// less registered memory per enlarged direction, at the price of never
// going back to small buffers (the acknowledgement says so, and that
// direction never shrinks). Records and control messages then travel in
// the large ring.
func WithFreeSmallOnEnlarge() Option { return func(o *options) { o.freeSmall = true } }

// WithIdleShrink: a sending direction whose large buffers carried nothing
// for d goes back to its small buffers, and both sides give the large
// ones back to the pool and the budget (registered memory returns to its
// idle 8 KiB per side). The next large write enlarges again. Default
// DefaultIdleShrink; 0 or negative: never. A small direction idle for d
// more parks: the pages of its small ring and staging go back to the
// system, registration kept, on providers that can release them (shm);
// the first write after a park waits one round trip for the peer's
// answer. A peer that frees its small ring on enlargement
// (WithFreeSmallOnEnlarge) says so in its ack, and our direction to it
// then stays large.
func WithIdleShrink(d time.Duration) Option { return func(o *options) { o.idleShrink = d } }

// WithTracerProvider sets where the connection, enlargement and
// rendezvous spans go (default: the otel global provider). Spans are
// made only while the connection span records.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) { o.tracerProvider = tp }
}

// WithMeterProvider sets where the rdmagrpc.* metrics go (default: the
// otel global provider).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) { o.meterProvider = mp }
}

// WithBacklog bounds the connections a Listener sets up ahead of Accept
// (default: the kernel's net.core.somaxconn, as Go's net.Listen uses for
// TCP, at most 4096). Each holds a queue pair and registered memory until
// Accept takes it; a dial beyond the bound is refused at once, with an
// error saying so.
func WithBacklog(n int) Option { return func(o *options) { o.backlog = n } }

// defaultBacklog reads net.core.somaxconn as Go's net package does, once:
// every Dial and Listen applies the defaults.
var defaultBacklog = sync.OnceValue(func() int {
	const fallback, most = 4096, 4096
	b, err := os.ReadFile("/proc/sys/net/core/somaxconn")
	if err != nil {
		return fallback
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n <= 0 {
		return fallback
	}
	return min(n, most)
})

// WithPeerCheck decides which local processes a connection may have at
// its other end, from their credentials as the kernel gives them
// (SO_PEERCRED). On a Listener it runs on every dialer: an error refuses
// the dial, which fails with ErrPeerRefused and the error's text, and
// nothing of the listener's is handed to it. On a dial it runs on the
// process that answers, before anything is sent to it: an error skips
// that process (a wildcard listener on the same port is tried next), and
// a dial that finds no other fails with ErrListenerRefused. Without it
// a listener admits only processes of its own user, as a 0600 socket
// file would, and a dial only a listener of its own user or of root: the abstract unix sockets shm listens on have no
// permissions, and any user of the network namespace could dial one, or
// bind the name a dial tries first. Listen fails with this option on a
// provider whose peers are remote (verbs); a dial over such a provider
// ignores it.
func WithPeerCheck(check func(pid, uid, gid int) error) Option {
	return func(o *options) { o.peerCheck = check }
}

// WithBudget charges registered memory to b instead of bufpool.Default()
// (process-wide: 1 GiB, or RDMAGRPC_REG_BUDGET). An exhausted budget
// slows a stream, never breaks it: the peer refuses enlargement, a
// rendezvous source goes through the rings, a reader asks for smaller
// parts (down to one page, taken beyond the budget when there is no room
// at all). A side asked to enlarge whose budget has no room first asks
// the writers of its least recently used idle large rings on that budget
// to shrink, and serves once the memory is back.
func WithBudget(b *bufpool.Budget) Option { return func(o *options) { o.budget = b } }

func (o *options) validate() error {
	if err := checkRing(uint32(o.slotSize), uint32(o.slotCount)); err != nil {
		return fmt.Errorf("conn: small buffers: %w", err)
	}
	if o.slotCount < 3 {
		return fmt.Errorf("conn: small buffers: %d slots, want at least 3 (one is kept for control records)", o.slotCount)
	}
	o.ladder = append([]Phase{{o.largeSize, o.largeCount}}, o.more...)
	for i, p := range o.ladder {
		if err := checkRing(uint32(p.Size), uint32(p.Count)); err != nil {
			return fmt.Errorf("conn: large buffers (phase %d): %w", i+1, err)
		}
		if i > 0 {
			if prev := o.ladder[i-1]; p.Size*p.Count <= prev.Size*prev.Count {
				return fmt.Errorf("conn: buffer phase %d (%d × %d bytes) is no larger than the one before it", i+1, p.Count, p.Size)
			}
		}
	}
	_, maxCount := o.maxLarge()
	o.recvCap = o.slotCount + maxCount + controlRecvs // see Conn.recvDepth
	if o.recvCap > math.MaxUint16 {
		return fmt.Errorf("conn: %d slots in the small and deepest large rings: want at most %d", o.slotCount+maxCount, math.MaxUint16-controlRecvs)
	}
	if o.threshold == 0 {
		o.threshold = o.slotSize
	}
	switch {
	case o.rdvThreshold == 0:
		// What the first large ring holds: a bigger message waits in the
		// writer's memory rather than filling the rings (deeper phases
		// are for streams of ring-sized writes).
		o.rdvThreshold = o.largeSize * o.largeCount
	case o.rdvThreshold < 0:
		o.rdvThreshold = 0
	}
	if o.rdvChunk < minSlot || o.rdvChunk > bufpool.DefaultMaxSize {
		return fmt.Errorf("conn: rendezvous chunk of %d bytes: want %d–%d", o.rdvChunk, minSlot, bufpool.DefaultMaxSize)
	}
	if o.backlog < 1 {
		return fmt.Errorf("conn: accept backlog of %d: want at least 1", o.backlog)
	}
	if o.ackTimeout <= 0 || o.ackRetries < 0 {
		return fmt.Errorf("conn: ack timeout %v with %d retries", o.ackTimeout, o.ackRetries)
	}
	return nil
}
