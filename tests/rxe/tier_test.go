package rxe

import (
	"context"
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
const defaultGuestPkgs = "./transport/verbs/ ./bpf/ ./conn/"

// guestHelpers are C programs a package's guest tests need (the guest has
// no compiler): built on the host against libibverbs, copied into
// /rxe/bin, and named to the test binary by an environment variable.
var guestHelpers = map[string][]struct{ src, env string }{
	"./bpf/": {{"bpf/testdata/ibvreg/ibvreg.c", "RDMATRACE_IBVREG"}},
}

// buildHelpers compiles pkg's guest helpers into dir and returns the
// files to copy and the environment naming them.
func buildHelpers(t *testing.T, root, pkg, dir string) (files []string, env []string) {
	t.Helper()
	for _, h := range guestHelpers[pkg] {
		name := strings.TrimSuffix(filepath.Base(h.src), ".c")
		out := filepath.Join(dir, name)
		cmd := exec.Command("cc", "-O1", "-o", out, filepath.Join(root, h.src), "-libverbs")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("cc %s: %v\n%s", h.src, err, b)
		}
		files = append(files, out)
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
	for _, pkg := range strings.Fields(pkgs) {
		t.Run(strings.Trim(pkg, "./"), func(t *testing.T) {
			bin := buildTestBinary(t, root, pkg, dir)
			if bin == "" {
				t.Skipf("%s has no tests", pkg)
			}
			name := filepath.Base(bin)
			helpers, env := buildHelpers(t, root, pkg, dir)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			r, err := img.RunOne(ctx, Payload{
				Files: Files(append([]string{bin}, helpers...)...),
				Args:  []string{name, "-test.v", "-test.count=1", "-test.timeout=8m"},
				Env:   env,
			})
			t.Logf("%s in one guest: exit %d, boot %v, run %v", name, r.ExitCode, r.Boot.Round(time.Millisecond), r.Run.Round(time.Millisecond))
			if err != nil {
				t.Fatalf("%v\noutput:\n%s", err, r.Output)
			}
			if r.ExitCode != 0 || testing.Verbose() {
				t.Logf("output:\n%s", r.Output)
			}
			if r.ExitCode != 0 {
				t.Fatalf("%s failed in the guest (exit %d)", name, r.ExitCode)
			}
			if len(listTests(t, bin, pairTests)) == 0 {
				return
			}
			args := []string{name, "-test.v", "-test.count=1", "-test.timeout=8m", "-test.run", pairTests}
			ra, rb, err := img.RunPair(ctx, Payload{Files: Files(bin), Args: args}, Payload{Files: Files(bin), Args: args})
			t.Logf("%s across two guests: exit a=%d b=%d, run %v / %v", name, ra.ExitCode, rb.ExitCode, ra.Run, rb.Run)
			if err != nil || ra.ExitCode != 0 || rb.ExitCode != 0 || testing.Verbose() {
				t.Logf("guest a output:\n%s\nguest b output:\n%s", ra.Output, rb.Output)
			}
			if err != nil {
				t.Fatal(err)
			}
			if ra.ExitCode != 0 || rb.ExitCode != 0 {
				t.Fatalf("%s pair tests failed: exit a=%d b=%d", name, ra.ExitCode, rb.ExitCode)
			}
		})
	}
}
