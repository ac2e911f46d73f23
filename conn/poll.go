package conn

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/hostload"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// pollState says whether a completion loop runs. With a provider whose
// CQ calls us back (transport.NotifyCQ, shm), the loop runs only while
// there is traffic: after WithPollSpin of quiet it arms the queue and
// exits, and the next completion starts it again, so an idle connection
// has no goroutine of its own. Otherwise one loop runs for the life of the
// connection and sleeps in CQ.Wait.
//
// While a connection is busy, the loop hands its work to the goroutines
// that wait on the connection (a reader waiting for data, a writer for
// credits): when a round of completions left data for a reader or woke
// a writer waiting for credits, the loop suspends instead of spinning
// (the queue stays unarmed) and the waiter, once it would wait again,
// polls and spins in the loop's place. A busy connection's completions
// are then taken by the goroutine that wants them, with no goroutine
// switch between them and no second spinning goroutine holding a core
// while the first works: across two processes on two cores, a loop that
// spun on one core while grpc-go's reader worked on the other took the
// core the peer process needed. If nobody polls within WithPollSpin of a
// suspension, a loop starts again (backstop).
type pollState struct {
	mu        sync.Mutex
	running   bool
	kicked    bool          // an event came while the loop ran: look again
	stopped   bool          // Close: no more loops
	suspended bool          // no loop runs, the queue is not armed: a waiter or the backstop polls next
	stop      atomic.Bool   // stopped, read by the loop each round
	done      chan struct{} // closed when the running loop exits
	aux       *pollAux      // what few loops need, apart (a Conn fits an allocation class)

	// The spin budget (spin.go), kept by whoever polls: what this
	// connection learned, and when its queue last went quiet.
	spinUS   uint16 // µs; 0: not learned yet
	sleeping bool   // the open quiet period does not spin (hostload.Busy)
	probing  bool   // the open quiet period spins the whole ceiling (spinProbeEvery)
	quietAt  uint32 // µs on the spin clock; 0: not quiet
	quiets   uint8  // quiet periods opened, counted for spinProbeEvery

	// flags: plFlagWaiting, plFlagPosting, plFlagDeferred, and above
	// them (plWaitShift) when a waiter last marked itself, on the spin
	// clock: in the same word, as a Conn fits its allocation class.
	flags atomic.Uint32
}

const (
	// plFlagWaiting: a waiter sleeps on c.changed (markWaiting); once
	// no loop runs, the next kick wakes it to poll in the loop's place
	// (kickWaiterLocked).
	plFlagWaiting = 1 << iota
	// plFlagPosting: a writer is posting (postSend). A kick meanwhile is
	// its own send completion finding the queue armed, most of the
	// time: the writer polls once it let go of c.mu (plFlagDeferred),
	// rather than have a loop start for it.
	plFlagPosting
	plFlagDeferred
	plWaitShift = iota
)

type pollAux struct {
	cancel   context.CancelFunc // ends a loop that sleeps in CQ.Wait
	backstop *time.Timer        // restarts the loop when nobody polled after a suspension
	// The backstop is due at due; pending: its timer is set and has not
	// fired. A pending timer is never reset: Go's runtime keeps every
	// timer of a P in one heap, and a timer reset while set is marked
	// modified, which makes the next timer check that reaches its time
	// walk and rebuild the whole heap. A busy connection suspends its
	// loop every few tens of µs, so a reset each time made that walk run
	// about every WithPollSpin: with 10,000 connections held (grpc-go
	// keeps timers for each), it took 19% of the client's CPU and 30% of
	// the server's in a loop of gRPC set-ups. Instead the timer fires
	// when it was set for, and the callback sets it again for what is
	// left until due.
	due     time.Time
	pending bool
}

var wcPool = sync.Pool{New: func() any { return new([32]transport.WorkCompletion) }}

// startPolling starts the completion loop, or hands the CQ our kick.
func (c *rdmaConn) startPolling() {
	if n, ok := c.cq.(transport.NotifyCQ); ok {
		n.SetNotify(c.kickPoll)
		c.kickPoll() // arms the queue, or finds what came already
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.pl.aux = &pollAux{cancel: cancel}
	c.pl.running, c.pl.done = true, make(chan struct{})
	go c.poll(ctx, c.pl.done, false)
}

// kickPoll is the CQ's callback: run the loop, or make the running one
// look again before it exits.
func (c *rdmaConn) kickPoll() {
	for f := c.pl.flags.Load(); f&plFlagPosting != 0; f = c.pl.flags.Load() {
		if c.pl.flags.CompareAndSwap(f, f|plFlagDeferred) {
			return
		}
	}
	// A waiter that armed the queue polls in the loop's place once woken:
	// one goroutine switch instead of two (a new loop, which would then
	// wake it), each of which may cost a sleeping thread's wake-up. Only
	// with c.mu free: a kick may come from a goroutine that holds it, or
	// holds the lock of a peer connection in this process.
	if c.pl.flags.Load()&plFlagWaiting != 0 && c.mu.TryLock() {
		woke := c.kickWaiterLocked()
		c.mu.Unlock()
		if woke {
			return
		}
	}
	c.pl.mu.Lock()
	defer c.pl.mu.Unlock()
	switch {
	case c.pl.stopped:
	case c.pl.running:
		c.pl.kicked = true
	default:
		kickedLoops.Add(1)
		go c.poll(context.Background(), c.takeRoleLocked(), true)
	}
}

// pollSpinNow is WithPollSpin, or 0 while the host is busy for a
// connection that yields to it (hostload). A loop that left data for a
// reader then arms the queue and exits, as with WithPollSpin(0), rather
// than suspend for the reader to poll in its place: with no spin, the
// reader would only take the role to arm the queue, after a round of
// polls, clock reads and the suspension's timer.
func (c *rdmaConn) pollSpinNow() time.Duration {
	if c.yieldsToHost() && hostload.Busy() {
		return 0
	}
	return c.o.pollSpin
}

// loopSuspensions counts the loops that suspended for a waiter (tests).
var loopSuspensions atomic.Uint64

// kickedLoops counts the loops a kick started (tests).
var kickedLoops atomic.Uint64

// kickWaiterLocked wakes the waiter that marked itself, to poll in
// the loop's place, and reports whether it did (false: no loop may
// start on its behalf now, nobody waits, or the waiter has slept, or
// the connection has not written, for longer than waiterFresh: it went
// idle, and what comes now is likelier an idle connection's control
// message, such as a park, which the loop serves on its own stack rather
// than a sleeping reader's).
func (c *rdmaConn) kickWaiterLocked() bool {
	c.pl.mu.Lock()
	if c.pl.stopped || c.pl.running || c.pl.suspended || c.pl.flags.Load()&plFlagWaiting == 0 ||
		c.waited() > uint32(waiterFresh/time.Microsecond) ||
		time.Now().UnixNano()-c.lastWrite.Load() > int64(waiterFresh) {
		c.pl.mu.Unlock()
		return false
	}
	c.pl.flags.And(^uint32(plFlagWaiting))
	c.suspendedLocked()
	c.pl.mu.Unlock()
	kickedWaiters.Add(1)
	c.broadcastLocked()
	return true
}

// markWaiting says that the caller is about to sleep on c.changed: a
// kick that comes once no loop runs wakes it to poll (kickWaiterLocked)
// rather than start a loop that would then wake it. That includes a
// reader that went to sleep while a loop ran (grpc-go's writer posts
// from another goroutine, and its send completions start the loop): the
// loop arms the queue and exits, and the reader is the one to wake.
func (c *rdmaConn) markWaiting() {
	at := spinClock() << plWaitShift
	for {
		f := c.pl.flags.Load()
		if c.pl.flags.CompareAndSwap(f, f&(1<<plWaitShift-1)|at|plFlagWaiting) {
			return
		}
	}
}

// waited is how long ago a waiter last marked itself, in µs (modulo
// 2^29, 9 minutes: a rare wrap only wakes a waiter to poll that a loop
// would have woken).
func (c *rdmaConn) waited() uint32 {
	return (spinClock()<<plWaitShift - c.pl.flags.Load()&^(1<<plWaitShift-1)) >> plWaitShift
}

// waiterFresh: a waiter that slept longer is not woken to poll.
const waiterFresh = 5 * time.Millisecond

// kickedWaiters counts the kicks that woke a waiter (tests).
var kickedWaiters atomic.Uint64

// takeRoleLocked makes the caller the loop, suspended or not before,
// and returns the channel it closes when it lets the role go. c.pl.mu is
// held, and no loop runs.
//
// Taking a suspended loop's role stops the suspension's backstop: whoever
// takes the role arms the queue or suspends again (setting it anew). Left
// to fire, each backstop ran a goroutine of its own WithPollSpin later,
// for nothing, and woke a thread for it when the processors had gone
// idle meanwhile: on a busy host, a context switch taken from the peer.
// A stopped timer is not a reset one (pollAux): the runtime only marks
// it in its heap, and sweeps it out with others.
func (c *rdmaConn) takeRoleLocked() chan struct{} {
	if a := c.pl.aux; c.pl.suspended && a != nil && a.pending && a.backstop.Stop() {
		a.pending = false
	}
	c.pl.suspended = false
	c.pl.running, c.pl.done = true, make(chan struct{})
	return c.pl.done
}

// suspendPoll hands the running loop's role (its done channel) to the
// connection's waiters: the queue stays unarmed, the next waiter polls,
// and the backstop restarts the loop if none does within WithPollSpin.
func (c *rdmaConn) suspendPoll(done chan struct{}) {
	c.pl.mu.Lock()
	defer c.pl.mu.Unlock()
	c.pl.running, c.pl.done = false, nil
	close(done)
	if c.pl.stopped {
		return
	}
	// A kick is a completion that is in the queue now: the next poller
	// finds it.
	c.pl.kicked = false
	c.suspendedLocked()
}

// suspendedLocked leaves the loop's role to the next waiter, with the
// backstop set. c.pl.mu is held.
func (c *rdmaConn) suspendedLocked() {
	c.pl.suspended = true
	d := max(c.o.pollSpin, time.Microsecond)
	if c.pl.aux == nil {
		c.pl.aux = &pollAux{}
	}
	a := c.pl.aux
	a.due = time.Now().Add(d)
	switch {
	case a.pending:
		// It fires before due and sets itself again (resumePoll).
	case a.backstop == nil:
		a.backstop, a.pending = time.AfterFunc(d, func() { c.resumePoll(a) }), true
	default:
		a.resetBackstop(d) // fired or stopped: not in the heap
		a.pending = true
	}
}

// backstopFires counts the backstop timers that fired (tests).
var backstopFires atomic.Uint64

// pendingResets counts the backstop timers reset while still set (tests:
// there must be none).
var pendingResets atomic.Uint64

func (a *pollAux) resetBackstop(d time.Duration) {
	if a.backstop.Reset(d) {
		pendingResets.Add(1)
	}
}

// resumePoll is the backstop of a: nobody polled since the suspension,
// so a loop runs again (and arms the queue once it finds nothing).
func (c *rdmaConn) resumePoll(a *pollAux) {
	c.pl.mu.Lock()
	defer c.pl.mu.Unlock()
	if c.pl.aux != a {
		return // a timer this connection let go (pollExit)
	}
	backstopFires.Add(1)
	a.pending = false
	if !c.pl.suspended || c.pl.stopped || c.pl.running {
		return
	}
	if left := time.Until(a.due); left > 0 {
		// Suspended again since the timer was set.
		a.resetBackstop(left)
		a.pending = true
		return
	}
	go c.poll(context.Background(), c.takeRoleLocked(), true)
}

// pollInstead is for a goroutine about to wait for ch with c.mu held: if
// the loop is suspended, it polls in the loop's place (without c.mu) and
// reports true once it handled completions or ch was closed, so that the
// caller looks at its condition again; false when it found nothing within
// WithPollSpin (or its deadline), armed the queue and let the role go:
// the caller then waits, and the next completion runs the loop.
func (c *rdmaConn) pollInstead(ch chan struct{}, deadline time.Time) bool {
	c.pl.mu.Lock()
	if !c.pl.suspended || c.pl.stopped {
		c.pl.mu.Unlock()
		return false
	}
	done := c.takeRoleLocked()
	c.pl.mu.Unlock()
	c.mu.Unlock()
	again := c.pollFor(ch, deadline, done)
	c.mu.Lock()
	return again
}

// inlineRounds counts the rounds of completions that waiters took in
// the loop's place (tests).
var inlineRounds atomic.Uint64

// pollFor is pollInstead's polling, done holding the loop's role.
func (c *rdmaConn) pollFor(ch chan struct{}, deadline time.Time, done chan struct{}) bool {
	buf := wcPool.Get().(*[32]transport.WorkCompletion)
	defer wcPool.Put(buf)
	wcs := buf[:]
	start := time.Now()
	c.spinQuiet()
	var turn spinTurn
	defer turn.release()
	timedOut := false
	for armed := false; ; {
		n, ok := c.pollRound(wcs, done)
		if !ok {
			return true
		}
		if n > 0 {
			c.spinQuietEnded()
			inlineRounds.Add(1)
			_, _, owed := c.handle(wcs[:n])
			c.suspendPoll(done)
			if owed {
				c.pollNow() // the queue may have fired during the post, and nobody looks
			}
			return true
		}
		if armed {
			// The caller sleeps once the role is let go: the next kick
			// wakes it rather than start a loop (kickPoll).
			c.markWaiting()
			if c.pollExit(done) {
				return false
			}
			c.pl.flags.And(^uint32(plFlagWaiting))
			armed = false // kicked meanwhile: look again
			continue
		}
		select {
		case <-ch:
			c.spinQuietEnded()
			c.suspendPoll(done)
			return true
		default:
		}
		spun, budget := time.Since(start), c.spinBudget()
		if spun < budget && !expired(deadline) && turn.spin(spun, c.yieldsToHost()) {
			continue
		}
		turn.release()
		if !timedOut && spun >= budget {
			timedOut = true
			c.spinTimedOut()
		}
		if err := c.cq.ReqNotify(); err != nil {
			c.loopFailed(done, fmt.Errorf("conn: arm completion queue: %w", err))
			return true
		}
		armed = true // a completion may have landed before arming
	}
}

// postSend posts wr for a writer that holds c.mu, and reports whether
// a kick came meanwhile, which the writer then owes the queue: pollNow,
// once it let go of c.mu.
func (c *rdmaConn) postSend(wr transport.SendWR) (kicked bool, err error) {
	c.pl.flags.Or(plFlagPosting)
	_, err = c.qp.PostSend(wr)
	f := c.pl.flags.And(^uint32(plFlagPosting | plFlagDeferred))
	return f&plFlagDeferred != 0, err
}

// deferredKicks counts the kicks that a writer took at its post (tests).
var deferredKicks atomic.Uint64

// pollNow is a deferred kick, taken by the writer that posted: it takes
// the loop's role, if nobody holds it, and polls until the queue is
// empty and armed, without spinning: a kick during a post means the
// queue was armed, so the connection had gone quiet. c.mu is not held.
func (c *rdmaConn) pollNow() {
	deferredKicks.Add(1)
	c.pl.mu.Lock()
	switch {
	case c.pl.stopped:
		c.pl.mu.Unlock()
		return
	case c.pl.running:
		c.pl.kicked = true
		c.pl.mu.Unlock()
		return
	}
	done := c.takeRoleLocked()
	c.pl.mu.Unlock()
	buf := wcPool.Get().(*[32]transport.WorkCompletion)
	defer wcPool.Put(buf)
	wcs := buf[:]
	for armed := false; ; {
		n, ok := c.pollRound(wcs, done)
		if !ok {
			return
		}
		if n > 0 {
			c.spinQuietEnded()
			c.handle(wcs[:n]) // owed or not, it polls again before it arms
			armed = false
			continue
		}
		if armed {
			if c.pollExit(done) {
				return
			}
			armed = false
			continue
		}
		if err := c.cq.ReqNotify(); err != nil {
			c.loopFailed(done, fmt.Errorf("conn: arm completion queue: %w", err))
			return
		}
		armed = true
	}
}

// pollRound polls once, for the holder of the loop's role (done): how
// many completions it found, or false once the loop ended (Close, or the
// queue failed).
func (c *rdmaConn) pollRound(wcs []transport.WorkCompletion, done chan struct{}) (int, bool) {
	if c.pl.stop.Load() {
		c.pollExit(done)
		return 0, false
	}
	n, err := c.cq.Poll(wcs)
	if err != nil {
		c.loopFailed(done, fmt.Errorf("conn: completion queue: %w", err))
		return 0, false
	}
	return n, true
}

// pollExit ends the loop unless an event came since it last looked.
func (c *rdmaConn) pollExit(done chan struct{}) bool {
	c.pl.mu.Lock()
	defer c.pl.mu.Unlock()
	if c.pl.kicked && !c.pl.stopped {
		c.pl.kicked = false
		return false
	}
	c.pl.running = false
	c.pl.done = nil // an idle connection keeps no channel of a loop gone
	if a := c.pl.aux; a != nil && a.cancel == nil && !c.pl.suspended {
		// Nor a timer: one still pending is let go, to fire once and
		// find nothing to do (stopping it would leave it in the heap
		// too, until the runtime sweeps stopped timers out).
		c.pl.aux = nil
	}
	close(done)
	return true
}

// stopPolling ends the completion loop for good and waits for it.
func (c *rdmaConn) stopPolling() {
	c.pl.mu.Lock()
	c.pl.stopped = true
	c.pl.stop.Store(true)
	var done chan struct{}
	if c.pl.running {
		done = c.pl.done
	}
	if a := c.pl.aux; a != nil {
		if a.cancel != nil {
			a.cancel()
		}
		if a.backstop != nil {
			a.backstop.Stop()
		}
	}
	c.pl.suspended = false
	c.pl.mu.Unlock()
	if n, ok := c.cq.(transport.NotifyCQ); ok {
		n.SetNotify(nil)
	}
	if done != nil {
		<-done
	}
}

// poll is the completion loop: poll, spinning for WithPollSpin after the
// last completion, then arm, poll again, and exit (notified: the next
// completion runs it again) or sleep in CQ.Wait (verbs: the completion
// channel in the netpoller). It owns no OS thread while it sleeps.
func (c *rdmaConn) poll(ctx context.Context, done chan struct{}, notified bool) {
	buf := wcPool.Get().(*[32]transport.WorkCompletion)
	defer wcPool.Put(buf)
	wcs := buf[:]
	armed := false
	var last time.Time // the last completion, zero before the first
	// busy: a completion came since the queue was last armed. Only then
	// is spinning worth it: a loop started with nothing to do (a new
	// connection's first look, a kick that found nothing) arms at once
	// instead of burning WithPollSpin of CPU on every set-up.
	busy := false
	var turn spinTurn
	defer turn.release()
	for {
		n, ok := c.pollRound(wcs, done)
		if !ok {
			return
		}
		if n > 0 {
			c.spinQuietEnded()
			// A connection that closed or failed spins for nothing: its
			// completions now are its receives flushing at the teardown
			// (WithPollSpin of CPU on each side of every close).
			var waiter, owed bool
			busy, waiter, owed = c.handle(wcs[:n])
			if notified && busy && waiter && c.pollSpinNow() > 0 {
				loopSuspensions.Add(1)
				c.suspendPoll(done)
				if owed {
					c.pollNow() // the queue may have fired during the post, and nobody looks
				}
				return
			}
			armed = false
			last = time.Time{}
			continue
		}
		if !armed {
			now := time.Now()
			if last.IsZero() {
				last = now
				if busy {
					c.spinQuiet()
				}
			}
			spun, budget := now.Sub(last), c.spinBudget()
			if busy && spun < budget && turn.spin(spun, c.yieldsToHost()) {
				continue
			}
			turn.release()
			if busy && spun >= budget {
				// Ran out, rather than found too many spinning.
				c.spinTimedOut()
			}
			if err := c.cq.ReqNotify(); err != nil {
				c.loopFailed(done, fmt.Errorf("conn: arm completion queue: %w", err))
				return
			}
			armed, busy = true, false
			continue // a completion may have landed before arming
		}
		if notified {
			if c.pollExit(done) {
				return
			}
		} else if err := c.cq.Wait(ctx); err != nil {
			if ctx.Err() == nil {
				c.fail(fmt.Errorf("conn: wait for completions: %w", err))
			}
			c.stopLoopOnError(done)
			return
		}
		armed = false
		last = time.Time{}
	}
}

// loopFailed fails the connection with err and ends the loop for good.
func (c *rdmaConn) loopFailed(done chan struct{}, err error) {
	c.fail(err)
	c.stopLoopOnError(done)
}

// stopLoopOnError ends the loop after a queue error: no later event
// starts it again.
func (c *rdmaConn) stopLoopOnError(done chan struct{}) {
	c.pl.mu.Lock()
	c.pl.stopped = true
	c.pl.mu.Unlock()
	c.pollExit(done)
}
