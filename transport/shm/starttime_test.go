package shm

import (
	"os/exec"
	"testing"
)

// A cached start time is served only while its process runs: once the
// process is reaped (and its pid free for another), the entry goes and
// the start time is read afresh.
func TestStartTimeCache(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Skipf("no sleep command: %v", err)
	}
	pid := cmd.Process.Pid
	want := readStartTime(pid)
	if want == 0 {
		t.Fatalf("no start time for pid %d in /proc", pid)
	}
	for range 2 {
		if got := startTime(pid); got != want {
			t.Fatalf("startTime(%d) = %d, want %d", pid, got, want)
		}
	}
	startTimes.Lock()
	_, cached := startTimes.m[pid]
	startTimes.Unlock()
	if !cached {
		t.Skip("no pidfd here (Linux before 5.3?): start times are read every time")
	}
	cmd.Process.Kill()
	cmd.Wait()
	if got := startTime(pid); got != 0 {
		t.Fatalf("startTime(%d) of a reaped process = %d, want 0", pid, got)
	}
	startTimes.Lock()
	_, cached = startTimes.m[pid]
	startTimes.Unlock()
	if cached {
		t.Fatal("the reaped process's entry is still cached")
	}
}
