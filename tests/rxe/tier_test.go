package rxe

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// defaultGuestPkgs are the packages whose tests form the rxe tier proper:
// built on the host with `go test -c` and run inside the guest, where
// rxe0 exists. RDMAGRPC_RXE_PKGS overrides the list (space-separated,
// relative to the module root).
const defaultGuestPkgs = "./transport/verbs/ ./bpf/ ./conn/ ./interop/"

// guestHelpers are programs a package's guest tests need (the guest has
// neither a C compiler nor a Go toolchain): built on the host, copied
// into /rxe/bin, and named to the test binary by an environment variable.
// A src ending in .c is compiled with cc against libibverbs; anything
// else is a Go main package, built with cgo (it may import
// transport/verbs: the binary links dynamically against libibverbs and
// librdmacm, which the guest has).
var guestHelpers = map[string][]struct{ src, env string }{
	"./bpf/": {
		{"bpf/testdata/ibvreg/ibvreg.c", "RDMATRACE_IBVREG"},
		{"./bpf/testdata/verbsreg", "RDMATRACE_VERBSREG"},
	},
}

// buildHelpers compiles pkg's guest helpers into dir and returns the
// files to copy and the environment naming them.
func buildHelpers(t *testing.T, root, pkg, dir string) (files []string, env []string) {
	t.Helper()
	for _, h := range guestHelpers[pkg] {
		var cmd *exec.Cmd
		name := filepath.Base(h.src)
		if c, ok := strings.CutSuffix(name, ".c"); ok {
			name = c
			cmd = exec.Command("cc", "-O1", "-o", filepath.Join(dir, name), filepath.Join(root, h.src), "-libverbs")
		} else {
			cmd = exec.Command("go", "build", "-o", filepath.Join(dir, name), h.src)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		}
		cmd.Dir = root
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build guest helper %s: %v\n%s", h.src, err, b)
		}
		files = append(files, filepath.Join(dir, name))
		env = append(env, h.env+"="+GuestBin+"/"+name)
	}
	return files, env
}

// pairTests selects the tests of a package binary that need two hosts;
// they run in both guests of a pair (RXE_ROLE=a serves, b dials RXE_PEER).
const pairTests = "^TestRXEPair"

func moduleRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil || strings.TrimSpace(string(out)) == "" {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// buildTestBinary runs `go test -c` for pkg; it returns "" when the
// package has no tests.
func buildTestBinary(t *testing.T, root, pkg, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, strings.ReplaceAll(strings.Trim(filepath.Clean(pkg), "./"), "/", "_")+".test")
	args := []string{"test", "-c", "-o", bin}
	args = append(args, strings.Fields(os.Getenv("RDMAGRPC_RXE_GOFLAGS"))...)
	args = append(args, pkg)
	cmd := exec.Command("go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	if _, err := os.Stat(bin); err != nil {
		return "" // "no test files"
	}
	return bin
}

func listTests(t *testing.T, bin, pattern string) []string {
	t.Helper()
	out, err := exec.Command(bin, "-test.list", pattern).Output()
	if err != nil {
		t.Fatalf("%s -test.list: %v", filepath.Base(bin), err)
	}
	return strings.Fields(string(out))
}

// TestPackagesInGuest is the tier: every package's tests, run in the
// guest (all tests in one guest; the TestRXEPair* ones also across two).
func TestPackagesInGuest(t *testing.T) {
	img := needGuest(t)
	root := moduleRoot(t)
	pkgs := os.Getenv("RDMAGRPC_RXE_PKGS")
	if pkgs == "" {
		pkgs = defaultGuestPkgs
	}
	dir := t.TempDir()
	// CI shows the end of the log: repeat what failed there, after all
	// the packages' output.
	var failed []string
	t.Cleanup(func() {
		if len(failed) > 0 {
			t.Logf("what failed in the guests (the whole output is above):\n%s", strings.Join(failed, "\n"))
		}
	})
	for _, pkg := range strings.Fields(pkgs) {
		t.Run(strings.Trim(pkg, "./"), func(t *testing.T) {
			bin := buildTestBinary(t, root, pkg, dir)
			if bin == "" {
				t.Skipf("%s has no tests", pkg)
			}
			name := filepath.Base(bin)
			helpers, env := buildHelpers(t, root, pkg, dir)
			// Pinned, so that a package's dials within the guest test
			// verbs: chosen, verbs serves other hosts and shm this one
			// (TestRXESameHost*, TestRXEPairChooses* unset it).
			// The watchdog fires after the test's own time-out (8m) and
			// before the host gives up (10m).
			pinned := []string{"RDMAGRPC_PROVIDER=verbs", "RXE_WATCHDOG=540"}
			env = append(env, pinned...)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			r, err := img.RunOne(ctx, Payload{
				Files: Files(append([]string{bin}, helpers...)...),
				Args:  []string{name, "-test.v", "-test.count=1", "-test.timeout=8m"},
				Env:   env,
			})
			t.Logf("%s in one guest: exit %d, boot %v, run %v", name, r.ExitCode, r.Boot.Round(time.Millisecond), r.Run.Round(time.Millisecond))
			if err != nil {
				// A guest that never printed its exit marker (hung, or
				// killed at the deadline): what it was running when it
				// stopped is the end of its output.
				failed = append(failed, name+" in one guest: "+err.Error(), "the output's last lines:", lastLines(r.Output, 40))
				t.Fatalf("%v\noutput:\n%s", err, r.Output)
			}
			if r.ExitCode != 0 || testing.Verbose() {
				t.Logf("output:\n%s", r.Output)
			}
			t.Logf("%s in one guest: %s", name, countResults(r.Output))
			if r.ExitCode != 0 {
				failed = append(failed, name+" in one guest:")
				failed = append(failed, failureLines(r.Output)...)
				t.Fatalf("%s failed in the guest (exit %d)", name, r.ExitCode)
			}
			if len(listTests(t, bin, pairTests)) == 0 {
				return
			}
			args := []string{name, "-test.v", "-test.count=1", "-test.timeout=8m", "-test.run", pairTests}
			// A deadline of its own, so that the watchdog fires before it
			// in the pair too.
			pctx, pcancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer pcancel()
			ra, rb, err := img.RunPair(pctx, Payload{Files: Files(bin), Args: args, Env: pinned}, Payload{Files: Files(bin), Args: args, Env: pinned})
			t.Logf("%s across two guests: exit a=%d b=%d, run %v / %v", name, ra.ExitCode, rb.ExitCode, ra.Run, rb.Run)
			if err != nil || ra.ExitCode != 0 || rb.ExitCode != 0 || testing.Verbose() {
				t.Logf("guest a output:\n%s\nguest b output:\n%s", ra.Output, rb.Output)
			}
			if err != nil {
				failed = append(failed, name+" across two guests: "+err.Error(),
					"guest a's last lines:", lastLines(ra.Output, 20), "guest b's last lines:", lastLines(rb.Output, 20))
				t.Fatal(err)
			}
			t.Logf("%s across two guests, guest a: %s", name, countResults(ra.Output))
			t.Logf("%s across two guests, guest b: %s", name, countResults(rb.Output))
			if ra.ExitCode != 0 || rb.ExitCode != 0 {
				failed = append(failed, name+" across two guests, guest a:")
				failed = append(failed, failureLines(ra.Output)...)
				failed = append(failed, name+" across two guests, guest b:")
				failed = append(failed, failureLines(rb.Output)...)
				t.Fatalf("%s pair tests failed: exit a=%d b=%d", name, ra.ExitCode, rb.ExitCode)
			}
		})
	}
}

// failureLines picks out of `go test -v` output what says why it failed:
// the log lines of each failed test (-v streams them under the test's
// "=== RUN", "=== CONT" or "=== NAME" line, not under "--- FAIL"), and
// panics, races and time-outs with the lines after them; at most
// maxFailureLines.
func failureLines(out []byte) []string {
	const maxFailureLines, perTest, perPanic = 80, 20, 12
	lines := strings.Split(string(out), "\n")
	logs := map[string][]string{}
	var failed, panics []string
	cur := ""
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		trimmed := strings.TrimLeft(line, " \t")
		f := strings.Fields(trimmed)
		switch {
		case len(f) >= 3 && f[0] == "===":
			cur = f[2]
		case len(f) >= 3 && f[0] == "---":
			if f[1] == "FAIL:" {
				failed = append(failed, f[2])
			}
			cur = ""
		case strings.HasPrefix(trimmed, "panic:"), strings.HasPrefix(trimmed, "WARNING: DATA RACE"):
			end := min(len(lines), i+perPanic)
			panics = append(panics, lines[i:end]...)
			i = end - 1
		case cur != "" && trimmed != "":
			logs[cur] = append(logs[cur], line)
		}
	}
	parent := map[string]bool{}
	for _, n := range failed {
		for i := strings.IndexByte(n, '/'); i >= 0; i = next(n, i) {
			parent[n[:i]] = true
		}
	}
	var picked []string
	for _, n := range failed {
		if parent[n] && len(logs[n]) == 0 {
			continue // its failed subtests say why
		}
		l := logs[n]
		if len(l) > perTest {
			l = l[len(l)-perTest:]
		}
		picked = append(picked, "--- FAIL: "+n)
		picked = append(picked, l...)
	}
	picked = append(picked, panics...)
	if len(picked) > maxFailureLines {
		picked = picked[:maxFailureLines]
	}
	if len(picked) == 0 {
		picked = []string{"(no FAIL line: the end of the output is above)"}
	}
	return picked
}

// TestTwoDevicesInGuest runs conn's multi-device test in a guest with a
// second Soft-RoCE device (rxe1 on its own netdev and subnet): a
// connection through either device has its resources on that device.
func TestTwoDevicesInGuest(t *testing.T) {
	img := needGuest(t)
	root := moduleRoot(t)
	dir := t.TempDir()
	bin := buildTestBinary(t, root, "./conn/", dir)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	script := filepath.Join(root, "tests/rxe/testdata/two-devices.sh")
	name := filepath.Base(bin)
	r, err := img.RunOne(ctx, Payload{
		Files: Files(bin, script),
		Args:  []string{"sh", GuestBin + "/two-devices.sh", name, "-test.v", "-test.count=1", "-test.run", "^TestMultiDevice$"},
		Env:   []string{"RXE_DEV2_ADDR=10.98.0.1", "RDMAGRPC_PROVIDER=verbs"}, // pinned: the test wants verbs within one guest
	})
	if err != nil {
		t.Fatalf("%v\noutput:\n%s", err, r.Output)
	}
	t.Logf("two devices: exit %d, boot %v, run %v; %s", r.ExitCode, r.Boot.Round(time.Millisecond), r.Run.Round(time.Millisecond), countResults(r.Output))
	if r.ExitCode != 0 || !bytes.Contains(r.Output, []byte("--- PASS: TestMultiDevice")) {
		t.Fatalf("TestMultiDevice did not pass in the two-device guest (exit %d):\n%s\n%s", r.ExitCode, r.Output, strings.Join(failureLines(r.Output), "\n"))
	}
	if testing.Verbose() {
		t.Logf("output:\n%s", r.Output)
	}
}

// countResults summarises `go test -v` output: leaf tests (those without
// subtests) passed, skipped and failed, in all and per top-level test
// that has subtests, so the tier's log shows what the guests ran.
func countResults(out []byte) string {
	status := map[string]string{}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "---" {
			continue
		}
		if _, seen := status[f[2]]; !seen {
			names = append(names, f[2])
		}
		status[f[2]] = strings.TrimSuffix(f[1], ":")
	}
	parent := map[string]bool{}
	for _, n := range names {
		for i := strings.IndexByte(n, '/'); i >= 0; i = next(n, i) {
			parent[n[:i]] = true
		}
	}
	type tally struct{ pass, skip, fail int }
	var total tally
	var tops []string
	per := map[string]*tally{}
	for _, n := range names {
		if parent[n] {
			continue
		}
		add := func(c *tally) {
			switch status[n] {
			case "PASS":
				c.pass++
			case "SKIP":
				c.skip++
			case "FAIL":
				c.fail++
			}
		}
		add(&total)
		if top, _, isSub := strings.Cut(n, "/"); isSub {
			if per[top] == nil {
				per[top] = &tally{}
				tops = append(tops, top)
			}
			add(per[top])
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d passed, %d skipped, %d failed", total.pass, total.skip, total.fail)
	for _, top := range tops {
		c := per[top]
		fmt.Fprintf(&b, "; %s: %d passed, %d skipped, %d failed", top, c.pass, c.skip, c.fail)
	}
	return b.String()
}

// next is the index of the next '/' in n after i, or -1.
func next(n string, i int) int {
	j := strings.IndexByte(n[i+1:], '/')
	if j < 0 {
		return -1
	}
	return i + 1 + j
}

// TestMixedFleetGuests runs interop's TestMixedFleetPair across two
// guests, one with Soft-RoCE (a) and one with no RDMA at all (b, no
// rdma_rxe): gRPC between them works both ways, over TCP, with rdmagrpc
// and with plain grpc-go at either end.
func TestMixedFleetGuests(t *testing.T) {
	img := needGuest(t)
	root := moduleRoot(t)
	bin := buildTestBinary(t, root, "./interop/", t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	name := filepath.Base(bin)
	args := []string{name, "-test.v", "-test.count=1", "-test.timeout=6m", "-test.run", "^TestMixedFleetPair$"}
	ra, rb, err := img.RunPair(ctx,
		Payload{Files: Files(bin), Args: args, Env: []string{"RDMAGRPC_MIXED_FLEET=1"}},
		Payload{Files: Files(bin), Args: args, Env: []string{"RDMAGRPC_MIXED_FLEET=1", "RXE_NO_RDMA=1"}})
	if err != nil {
		t.Fatalf("%v\nguest a:\n%s\nguest b:\n%s", err, ra.Output, rb.Output)
	}
	for _, r := range []struct {
		guest string
		res   Result
	}{{"a (Soft-RoCE)", ra}, {"b (no RDMA)", rb}} {
		t.Logf("guest %s: exit %d; %s", r.guest, r.res.ExitCode, countResults(r.res.Output))
		if r.res.ExitCode != 0 || !bytes.Contains(r.res.Output, []byte("--- PASS: TestMixedFleetPair")) {
			t.Errorf("guest %s: TestMixedFleetPair did not pass (exit %d):\n%s\n%s", r.guest, r.res.ExitCode, r.res.Output, strings.Join(failureLines(r.res.Output), "\n"))
		}
		if testing.Verbose() {
			t.Logf("guest %s output:\n%s", r.guest, r.res.Output)
		}
	}
}
