package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The demo as `make demo` runs it: its eBPF view must see, from outside
// the Go code, exactly what the connections' Stats report from inside —
// every registered byte, and each side's enlargement and served
// enlargement.
func TestDemoShowsEBPFView(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the demo")
	}
	if os.Geteuid() != 0 {
		t.Skip("the eBPF view needs root (uprobes); run the tests as root")
	}
	bin := filepath.Join(t.TempDir(), "demo")
	build := exec.Command("go", "build", "-ldflags=-s=false", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the demo: %v\n%s", err, out)
	}
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "RDMAGRPC_PROVIDER=shm")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	text := string(out)
	t.Logf("demo output:\n%s", text)

	// Registered bytes per connection after the large RPCs (the last
	// "registered" line of each side) against what the probes counted.
	after := text[strings.LastIndex(text, "connections after large RPCs"):]
	var statsBytes int
	for _, m := range regexp.MustCompile(`registered\s+(\d+) bytes`).FindAllStringSubmatch(after, -1) {
		n, _ := strconv.Atoi(m[1])
		statsBytes += n
	}
	m := regexp.MustCompile(`registrations (\d+) \((\d+) bytes, 0 failed\)`).FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("no eBPF registration line in the demo's output")
	}
	if probeBytes, _ := strconv.Atoi(m[2]); probeBytes != statsBytes || statsBytes == 0 {
		t.Fatalf("probes saw %d registered bytes, the connections' Stats say %d", probeBytes, statsBytes)
	}
	outcomes := map[string]int{}
	for _, m := range regexp.MustCompile(`(?m)^  enlargement  conn \d+  \d+ → \d+ bytes  took \S+  (.+)$`).FindAllStringSubmatch(text, -1) {
		outcomes[m[1]]++
	}
	enlarged, served := outcomes["enlarged"], outcomes["served"]
	if enlarged != 2 || served != 2 || len(outcomes) != 2 {
		t.Fatalf("probes saw %d enlargements and %d served, want 2 and 2 (client and server each enlarge)", enlarged, served)
	}
}
