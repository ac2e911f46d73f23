package conn

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// OpenTelemetry glue: the protocol code calls c.tel (nil-safe) at its
// points; what those calls need from the connection's state is computed
// here, so the protocol files carry one line per hook.

// telemetryOutcomes maps enlargement outcomes (enlarge.go) to their
// rdmagrpc.enlargement.outcome values.
var telemetryOutcomes = [...]telemetry.Outcome{
	outcomeEnlarged:   telemetry.Enlarged,
	outcomeRefused:    telemetry.Refused,
	outcomeTimedOut:   telemetry.TimedOut,
	outcomeLocalErr:   telemetry.LocalError,
	outcomeServed:     telemetry.Served,
	outcomeServeError: telemetry.ServeRefused,
}

// ID is the connection's identity: unique among the connections of this
// process (each end of a connection has its own), it is the
// rdmagrpc.connection.id of the connection's spans and of the RPC spans
// on it, and the id rdmatrace reads from the connection's markers. With
// the process id (rdmatrace's PID column, an OpenTelemetry resource's
// process.pid) it names one connection end on a host. A dial whose
// upgrade is negotiated behind its TCP connection keeps its ID: the
// upgraded connection takes the dial's.
func (c *rdmaConn) ID() uint64 { return c.id }

// connIDKey carries a dial's ID to the RDMA connection its negotiation
// makes (newConn), so that the dial's Conn and the connection it hands
// every call to are one connection to rdmatrace, the logs and the spans.
type connIDKey struct{}

// idFor is the ID of a connection newConn makes under ctx.
func idFor(ctx context.Context) uint64 {
	if id, ok := ctx.Value(connIDKey{}).(uint64); ok {
		return id
	}
	return connIDs.Add(1)
}

// ConnName is how a connection ID is printed, by rdmatrace, the demo and
// logs alike: "conn 3", decimal as the span attribute is.
func ConnName(id uint64) string { return "conn " + strconv.FormatUint(id, 10) }

var errPeerRefused = errors.New("peer refused to provision large buffers")

// endEnlargeTelemetryLocked ends the sender's enlargement span with the
// outcome finishEnlargeLocked recorded, and the reason of a failure.
func (c *rdmaConn) endEnlargeTelemetryLocked(outcome int) {
	var reason error
	switch outcome {
	case outcomeRefused:
		reason = errPeerRefused
	case outcomeTimedOut:
		reason = fmt.Errorf("no acknowledgement after %d requests, %v each", c.enl.attempts, c.o.ackTimeout)
	case outcomeLocalErr:
		reason = fmt.Errorf("large send buffers: %w", c.enl.localErr)
	}
	phase := telemetry.Small
	if c.enl.phase == phaseLarge {
		phase = telemetry.Large
	}
	c.enl.tel.End(telemetryOutcomes[outcome], phase, c.st.LastEnlargeDuration, reason)
	c.enl.tel = nil
}

// abortEnlargeTelemetryLocked ends a sender's enlargement span that
// enlarge left without an outcome: the write's deadline passed, the
// connection closed or failed. The next large write starts a new one.
func (c *rdmaConn) abortEnlargeTelemetryLocked() {
	if c.enl.tel == nil {
		return
	}
	err := c.writeErrLocked()
	if err == nil {
		err = errors.New("enlargement abandoned")
	}
	c.enl.tel.Abort(err)
	c.enl.tel = nil
}

// endServeTelemetryLocked ends the receiver's enlargement span once the
// answer is posted: served with the large ring, or refused.
func (c *rdmaConn) endServeTelemetryLocked(tel *telemetry.Enlargement, arrived time.Time) {
	if tel == nil {
		return
	}
	served := c.rx[large].buf != nil
	if c.rpcsInFlight() {
		outcome := telemetry.Served
		if !served {
			outcome = telemetry.ServeRefused
		}
		now := time.Now()
		c.rpcEvent(telemetry.EventRPCEnlargement, now, tel.SpanContext(),
			telemetry.KeySide.String(telemetry.Receiver), telemetry.KeyOutcome.String(string(outcome)),
			telemetry.KeyEnlargeDuration.Float64(now.Sub(arrived).Seconds()), telemetry.KeyToSize.Int(c.rx[large].size))
	}
	tel.Answered(served)
	if served {
		tel.End(telemetry.Served, telemetry.Large, 0, nil)
		return
	}
	tel.End(telemetry.ServeRefused, telemetry.Small, 0, fmt.Errorf("large receive buffers: %w", c.enl.rxRefused))
}

// telemetrySnapshot is what the gauges read, at collection time.
func (c *rdmaConn) telemetrySnapshot() telemetry.Snapshot {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := telemetry.Snapshot{
		Large:      c.enl.phase == phaseLarge,
		SmallBytes: bufLen(c.rx[small].buf) + bufLen(c.tx[small].stage),
		LargeBytes: bufLen(c.rx[large].buf) + bufLen(c.tx[large].stage),
	}
	// The rest of the pool: rendezvous regions in use or kept for reuse.
	s.RendezvousBytes = c.pool.Stats().RegisteredBytes - s.SmallBytes - s.LargeBytes
	return s
}

func bufLen(b *bufpool.Buffer) int64 {
	if b == nil {
		return 0
	}
	return int64(b.Len())
}

// endTelemetry ends the connection span; a connection reset or broken by
// its peer (abortLocked) ends it in error.
func (c *rdmaConn) endTelemetry() {
	if c.tel == nil {
		return
	}
	c.mu.Lock()
	if c.aborted {
		c.tel.Fail(c.err)
	}
	c.mu.Unlock()
	c.tel.End()
}
