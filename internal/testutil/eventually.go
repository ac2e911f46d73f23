// Package testutil holds helpers shared by the module's tests.
package testutil

import (
	"testing"
	"time"
)

// Poll intervals of Eventually: the first check is immediate, the next after
// firstPoll, each wait then doubles up to maxPoll.
const (
	firstPoll = time.Millisecond
	maxPoll   = 20 * time.Millisecond
)

// Eventually polls cond until it reports ok and returns the state it
// reported with it. cond is called at once, then after waits that start at
// 1 ms and double up to 20 ms, so an early condition costs little and a
// loaded machine is not flooded with polls. If timeout passes first, t fails
// (t.Fatalf) with what was awaited and the last state cond reported. Like
// t.Fatalf, Eventually must be called from the test's goroutine.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() (ok bool, state string)) string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for wait := firstPoll; ; wait = min(2*wait, maxPoll) {
		ok, state := cond()
		if ok {
			return state
		}
		if time.Now().After(deadline) {
			if state == "" {
				t.Fatalf("timed out after %v waiting for %s", timeout, what)
			} else {
				t.Fatalf("timed out after %v waiting for %s; last state:\n%s", timeout, what, state)
			}
			return state // for a t whose Fatalf returns
		}
		time.Sleep(wait)
	}
}

// Bool adapts a condition that has no state worth reporting to Eventually.
func Bool(cond func() bool) func() (bool, string) {
	return func() (bool, string) { return cond(), "" }
}
