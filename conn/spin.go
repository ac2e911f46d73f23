package conn

import (
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/hostload"
)

// The spin budget: how long a poller spins after the queue went quiet
// before it arms the queue and sleeps. WithPollSpin is its ceiling; each
// connection learns its own below it from how its quiet periods ended.
//
// A spin that finds the next completion saves two wake-ups; one that runs
// out is all waste, and on a host with as many busy processes as cores it
// takes the core the peer needed. A fixed spin pays that at the end of
// every burst: a gRPC connection's set-up ends several bursts in a row,
// and a connection that goes quiet after each spins its whole budget out
// each time.
//
// So a spin that runs out shrinks the budget by a quarter (not below
// spinFloor, which still catches completions already on their way), and
// one that succeeds in the upper half of the budget grows it by a quarter.
// A quiet period the poller slept through that ended within half the
// ceiling raises the budget to twice its length: the peer answers that
// fast, so spinning would have caught it (without this a connection whose
// answers take longer than the floor would never spin again). New
// connections start from what the process's connections learned last.
//
// A quiet period the poller slept through is measured to the poller's
// wake-up, which makes it longer than the peer's answer by a wake-up's
// cost; where that cost passes half the ceiling (an emulated guest, a
// loaded host) no slept-through period ever raises the budget again, and
// a connection whose budget once fell stays asleep. So one quiet period
// in spinProbeEvery spins the whole ceiling while the budget is below it:
// if the completion comes within the ceiling, the budget becomes twice
// the time it took; if not, the probe's spin is what it cost.
const (
	spinFloor      = 10 * time.Microsecond
	spinProbeEvery = 16
)

// spinHint is the budget, in µs, that a connection of this process set
// last: where a new connection starts (0: the ceiling).
var spinHint atomic.Uint32

// spinEpoch starts the spin clock: µs since it, in 32 bits, wrap every 71
// minutes, far beyond any quiet period that changes a budget.
var spinEpoch = time.Now()

func spinClock() uint32 { return uint32(time.Since(spinEpoch)/time.Microsecond) | 1 }

// maxLearned is the longest budget the 16 bits of pollState.spinUS hold.
// A WithPollSpin beyond it is spun in full every time, as asked: a choice
// made that deliberately is not one to learn under.
const maxLearned = (1<<16 - 1) * time.Microsecond

// learns says whether this connection's budget is learned: no for a
// ceiling of 0 (it never spins) or beyond maxLearned.
func (c *rdmaConn) learns() bool { return c.o.pollSpin > 0 && c.o.pollSpin <= maxLearned }

// spinBudget is how long to spin now: 0 in a quiet period that opened
// while the host was busy (hostload.Busy). Called by whoever holds the polling
// role, as are the other methods here: the budget is theirs.
func (c *rdmaConn) spinBudget() time.Duration {
	if c.pl.sleeping {
		return 0
	}
	if c.pl.probing {
		return c.o.pollSpin
	}
	return c.learnedBudget()
}

// learnedBudget is how long a spin may last, whether or not the open
// quiet period spins.
func (c *rdmaConn) learnedBudget() time.Duration {
	ceil := c.o.pollSpin
	if !c.learns() {
		return ceil
	}
	if c.pl.spinUS == 0 {
		b := time.Duration(spinHint.Load()) * time.Microsecond
		if b == 0 {
			b = ceil
		}
		c.setSpin(b)
	}
	return min(time.Duration(c.pl.spinUS)*time.Microsecond, ceil)
}

func (c *rdmaConn) setSpin(b time.Duration) {
	b = max(min(b, c.o.pollSpin), min(spinFloor, c.o.pollSpin), time.Microsecond)
	c.pl.spinUS = uint16(b / time.Microsecond)
	spinHint.Store(uint32(c.pl.spinUS))
}

// yieldsToHost says whether this connection stops spinning while the
// host is busy (hostload): unless its spin is not learned (none, or one
// asked for beyond maxLearned) or WithSpinOnBusyHost asked to spin
// regardless.
func (c *rdmaConn) yieldsToHost() bool { return c.learns() && !c.o.spinOnBusy }

// spinQuiet marks the start of a quiet period, unless one is open, and
// says whether it spins.
func (c *rdmaConn) spinQuiet() {
	if c.pl.quietAt == 0 {
		c.pl.quietAt = spinClock()
		c.pl.sleeping = c.yieldsToHost() && hostload.Busy()
		// probing is false here: the last quiet period's end cleared it.
		if c.learns() && !c.pl.sleeping {
			c.pl.quiets++
			c.pl.probing = c.pl.quiets%spinProbeEvery == 0 && c.learnedBudget() < c.o.pollSpin
		}
	}
}

// spinTimedOut is a spin that ran out of budget.
func (c *rdmaConn) spinTimedOut() {
	if !c.learns() || c.pl.sleeping {
		return // nothing to learn, nor to tell the other connections
	}
	if c.pl.probing {
		c.pl.probing = false // the budget already says the peer is slower
		return
	}
	c.setSpin(c.learnedBudget() * 3 / 4)
}

// spinQuietEnded is a completion (or the event a waiter waited for): it
// ends the open quiet period, if any, and learns from its length.
func (c *rdmaConn) spinQuietEnded() { c.spinQuietEndedAt(spinClock()) }

func (c *rdmaConn) spinQuietEndedAt(now uint32) {
	if c.pl.quietAt == 0 || !c.learns() {
		return
	}
	g := time.Duration(now-c.pl.quietAt) * time.Microsecond
	probing := c.pl.probing
	c.pl.quietAt = 0
	c.pl.sleeping, c.pl.probing = false, false
	b := c.learnedBudget()
	switch {
	case g <= b:
		if g > b/2 {
			c.setSpin(b * 5 / 4)
		}
	case g <= c.o.pollSpin/2, probing && g <= c.o.pollSpin:
		c.setSpin(2 * g)
	}
}

// spinYieldAfter is how long a spin polls with only Go's scheduler to
// yield to; past it, each round also yields the processor (sched_yield),
// so that a spin waiting on a peer that works for hundreds of µs stops
// taking the core that peer, or this process's own other threads, need.
// Aeron's BackoffIdleStrategy moves from spinning to yielding the same
// way. It is longer than a small call's cross-process round trip, so
// small calls keep what the spin is for; yielding from the start would
// cost them a wake-up. The runs that chose it are in doc/benchmarks.md.
const spinYieldAfter = 50 * time.Microsecond

// osYield gives the processor to another runnable thread, if any; it
// returns at once otherwise. A syscall, not a raw one: when it does give
// the processor away, Go's scheduler may hand this thread's P to another.
func osYield() { syscall.Syscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) }

// spinners counts the completion loops of this process spinning now. A
// spinning loop is not armed: what completes meanwhile wakes nobody, and
// it waits for its turn to run. When more loops spin than there are
// processors to spare, each waits in the run queue behind the others
// (milliseconds under -race with hundreds of connections: every credit
// exchange of a stream paid that), so beyond maxSpinners a loop arms at
// once and sleeps, woken by the next completion, as Go's scheduler bounds
// its own spinning threads. Two per processor: a few busy connections
// per process (the benchmarks', both ends of pairs in one process) spin
// as before; one per processor already made such pairs' loops stop and
// start again, a goroutine per message.
var spinners atomic.Int32

func maxSpinners() int32 { return int32(2 * runtime.GOMAXPROCS(0)) }

// spinTurn is a polling goroutine's share of the spinners.
type spinTurn struct{ held bool }

// spin yields once, as one of the spinners, and reports whether it could
// (false: maxSpinners spin already, or yieldsToHost and the host became
// busy, so arm and sleep instead). spun is how long this spin has run:
// past spinYieldAfter it also yields the processor to the other
// processes.
func (s *spinTurn) spin(spun time.Duration, yieldsToHost bool) bool {
	if !s.held {
		if spinners.Add(1) > maxSpinners() {
			spinners.Add(-1)
			return false
		}
		s.held = true
	}
	if yieldsToHost && hostload.Busy() {
		s.release()
		return false
	}
	runtime.Gosched()
	if spun >= spinYieldAfter {
		osYield()
	}
	return true
}

// release gives the share back, if held.
func (s *spinTurn) release() {
	if s.held {
		spinners.Add(-1)
		s.held = false
	}
}
