package rxe

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The guest tests boot qemu and take a minute or two; they run only when
// RDMAGRPC_RXE=1 (make test-rxe sets it), as root.
func needGuest(t *testing.T) *Image {
	t.Helper()
	if os.Getenv("RDMAGRPC_RXE") != "1" {
		t.Skip("rxe guest tests are opt-in: set RDMAGRPC_RXE=1 (make test-rxe)")
	}
	if err := HostReady(); err != nil {
		t.Skipf("rxe guest tests skipped: %v", err)
	}
	imgOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		start := time.Now()
		img, imgErr = Build(ctx, DefaultCacheDir(), WithLog(testLog{t}))
		t.Logf("Build took %v", time.Since(start).Round(time.Millisecond))
	})
	if imgErr != nil {
		t.Fatal(imgErr)
	}
	return img
}

var (
	imgOnce sync.Once
	img     *Image
	imgErr  error
)

type testLog struct{ t *testing.T }

func (l testLog) Write(b []byte) (int, error) {
	l.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

// goBuild compiles the cgo check program and its test binary.
func goBuild(t *testing.T) (prog, test string) {
	t.Helper()
	dir := t.TempDir()
	prog, test = filepath.Join(dir, "regmr"), filepath.Join(dir, "regmr.test")
	for _, args := range [][]string{
		{"build", "-o", prog, "./testdata/regmr"},
		{"test", "-c", "-o", test, "./testdata/regmr"},
	} {
		cmd := exec.Command("go", args...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s\n(needs gcc and libibverbs-dev: make deps)", strings.Join(args, " "), err, out)
		}
	}
	return prog, test
}

func wantAll(t *testing.T, name string, out []byte, subs ...string) {
	t.Helper()
	for _, s := range subs {
		if !strings.Contains(string(out), s) {
			t.Errorf("%s output lacks %q", name, s)
		}
	}
}

func TestGuestSmoke(t *testing.T) {
	img := needGuest(t)
	prog, test := goBuild(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r, err := img.RunOne(ctx, Payload{
		Files: Files("testdata/smoke.sh", prog, test),
		Args:  []string{"smoke.sh"},
	})
	t.Logf("boot %v, run %v, total %v", r.Boot, r.Run, r.Duration)
	if err != nil {
		t.Fatal(err)
	}
	if r.ExitCode != 0 {
		t.Fatalf("smoke payload exited %d:\n%s", r.ExitCode, r.Output)
	}
	wantAll(t, "smoke", r.Output, "rxe0", "PORT_ACTIVE", "GID ::ffff:"+GuestAddrA,
		"50 iters in", "regmr: ok", "--- PASS: TestRegMR", "SMOKE-OK")
	if n := strings.Count(string(r.Output), "50 iters in"); n != 2 {
		t.Errorf("want server and client ping-pong summaries, got %d", n)
	}
	if t.Failed() {
		t.Logf("output:\n%s", r.Output)
	}
}

func TestGuestExitStatusAndOutput(t *testing.T) {
	img := needGuest(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := img.RunOne(ctx, Payload{
		Args: []string{"sh", "-c", `printf 'x y\n'; printf "%s" "$GREETING" >&2; exit 7`},
		Env:  []string{"GREETING=it's ok"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if r.ExitCode != 7 {
		t.Errorf("exit code %d, want 7", r.ExitCode)
	}
	if got, want := string(r.Output), "x y\nit's ok"; got != want {
		t.Errorf("output %q, want %q", got, want)
	}
	t.Logf("per-run overhead of a trivial payload: boot %v, total %v", r.Boot, r.Duration)
}

func TestGuestPairPingPong(t *testing.T) {
	img := needGuest(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	a := Payload{Args: []string{"ibv_rc_pingpong", "-d", "rxe0", "-g", "1", "-n", "100"}}
	b := Payload{Files: Files("testdata/pingpong-client.sh"), Args: []string{"pingpong-client.sh"}}
	ra, rb, err := img.RunPair(ctx, a, b)
	t.Logf("a: boot %v run %v; b: boot %v run %v; total %v", ra.Boot, ra.Run, rb.Boot, rb.Run, max(ra.Duration, rb.Duration))
	if err != nil {
		t.Fatal(err)
	}
	if ra.ExitCode != 0 || rb.ExitCode != 0 {
		t.Fatalf("exit codes a=%d b=%d\na:\n%s\nb:\n%s", ra.ExitCode, rb.ExitCode, ra.Output, rb.Output)
	}
	wantAll(t, "server", ra.Output, "GID ::ffff:"+GuestAddrA, "GID ::ffff:"+GuestAddrB, "100 iters in")
	wantAll(t, "client", rb.Output, "GID ::ffff:"+GuestAddrB, "GID ::ffff:"+GuestAddrA, "100 iters in")
}

// TestGuestTimeoutKillsQemu checks that a run whose context ends leaves
// no qemu behind.
func TestGuestTimeoutKillsQemu(t *testing.T) {
	img := needGuest(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err := img.RunOne(ctx, Payload{Args: []string{"sleep", "600"}})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want deadline exceeded", err)
	}
	if kids := qemuChildren(t); len(kids) > 0 {
		t.Fatalf("qemu still running after the run returned: pids %v", kids)
	}
}

// qemuChildren lists qemu processes whose parent is this test process.
func qemuChildren(t *testing.T) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	me := os.Getpid()
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid …; comm may hold spaces, so cut at the last ')'.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || !strings.Contains(s[:i], "qemu") {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) > 1 {
			if ppid, _ := strconv.Atoi(f[1]); ppid == me {
				pids = append(pids, pid)
			}
		}
	}
	return pids
}
