package testutil

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeTB records a failure instead of ending the test.
type fakeTB struct {
	testing.TB
	failed string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Fatalf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

func TestEventuallyReturnsOnceTrue(t *testing.T) {
	var n atomic.Int32
	go func() {
		for range 3 {
			time.Sleep(2 * time.Millisecond)
			n.Add(1)
		}
	}()
	start := time.Now()
	got := Eventually(t, 5*time.Second, "n to reach 3", func() (bool, string) {
		v := n.Load()
		return v >= 3, fmt.Sprint("n = ", v)
	})
	if got != "n = 3" {
		t.Errorf("returned state %q, want %q", got, "n = 3")
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("took %v for a condition true after ~6 ms", d)
	}
}

func TestEventuallyImmediate(t *testing.T) {
	calls := 0
	start := time.Now()
	Eventually(t, time.Second, "true", Bool(func() bool { calls++; return true }))
	if calls != 1 || time.Since(start) > 100*time.Millisecond {
		t.Errorf("a true condition took %d calls and %v", calls, time.Since(start))
	}
}

func TestEventuallyTimeout(t *testing.T) {
	f := &fakeTB{TB: t}
	calls := 0
	start := time.Now()
	Eventually(f, 100*time.Millisecond, "the moon", func() (bool, string) {
		calls++
		return false, fmt.Sprint("poll ", calls)
	})
	d := time.Since(start)
	if d < 100*time.Millisecond || d > 2*time.Second {
		t.Errorf("gave up after %v, want about 100 ms", d)
	}
	want := fmt.Sprintf("timed out after 100ms waiting for the moon; last state:\npoll %d", calls)
	if f.failed != want {
		t.Errorf("failure %q, want %q", f.failed, want)
	}
	// The interval grows: 100 ms at 1, 2, 4, ... 20 ms waits is few polls.
	if calls < 2 || calls > 15 {
		t.Errorf("%d polls in 100 ms", calls)
	}
}

func TestEventuallyTimeoutNoState(t *testing.T) {
	f := &fakeTB{TB: t}
	Eventually(f, 10*time.Millisecond, "nothing", Bool(func() bool { return false }))
	if !strings.HasPrefix(f.failed, "timed out after 10ms waiting for nothing") || strings.Contains(f.failed, "last state") {
		t.Errorf("failure %q", f.failed)
	}
}
