package bpf

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: eBPF probes need root (CAP_BPF, CAP_PERFMON); run `sudo go test ./bpf/`")
	}
}

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
	noGCC     error // set when the C helpers could not be built
)

// cHelpers returns the directory holding libfakeverbs.so and fvdriver.
func cHelpers(t testing.TB) string {
	t.Helper()
	dir := helpers(t)
	if noGCC != nil {
		t.Fatalf("cannot build the C stand-in for libibverbs: %v", noGCC)
	}
	return dir
}

// helpers builds the test targets once per test binary: goreg (Go) and
// libfakeverbs.so plus its driver (C, needs gcc).
func helpers(t testing.TB) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		// The rxe guest runs a prebuilt bpf.test without a toolchain.
		t.Skip("skipping: needs the go toolchain to build its test helpers")
	}
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "bpftest")
		if buildErr != nil {
			return
		}
		cmds := [][]string{
			{"go", "build", "-o", filepath.Join(buildDir, "goreg"), "./testdata/goreg"},
		}
		if _, err := exec.LookPath("gcc"); err != nil {
			noGCC = err
		} else {
			fv := "testdata/fakeverbs/"
			cmds = append(cmds,
				[]string{"gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wl,--version-script=" + fv + "fakeverbs.map",
					"-o", filepath.Join(buildDir, "libfakeverbs.so"), fv + "fakeverbs.c"},
				[]string{"gcc", "-O1", "-Wall", "-o", filepath.Join(buildDir, "fvdriver"), fv + "driver.c",
					"-L" + buildDir, "-lfakeverbs", "-Wl,-rpath," + buildDir})
		}
		for _, c := range cmds {
			out, err := exec.Command(c[0], c[1:]...).CombinedOutput()
			if err != nil {
				buildErr = errors.New(strings.Join(c, " ") + ": " + err.Error() + "\n" + string(out))
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatalf("build test helpers: %v", buildErr)
	}
	return buildDir
}

var (
	shmOnce sync.Once
	shmErr  error
)

// shmHelper builds testdata/shmreg, which registers through the real shm
// provider, into the helpers' directory.
func shmHelper(t testing.TB) string {
	t.Helper()
	dir := helpers(t)
	bin := filepath.Join(dir, "shmreg")
	shmOnce.Do(func() {
		out, err := exec.Command("go", "build", "-o", bin, "./testdata/shmreg").CombinedOutput()
		if err != nil {
			shmErr = fmt.Errorf("%w\n%s", err, out)
		}
	})
	if shmErr != nil {
		t.Fatalf("build testdata/shmreg against transport/shm: %v", shmErr)
	}
	return bin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// target is a helper process that waits for "go" on stdin.
type target struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

func startTarget(t testing.TB, path string, args ...string) *target {
	t.Helper()
	cmd := exec.Command(path, args...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", path, err)
	}
	tg := &target{cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout)}
	t.Cleanup(func() {
		tg.stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	tg.expect(t, "ready")
	return tg
}

func (tg *target) expect(t testing.TB, line string) {
	t.Helper()
	if !tg.out.Scan() {
		t.Fatalf("target exited before printing %q: %v", line, tg.out.Err())
	}
	if got := tg.out.Text(); got != line {
		t.Fatalf("target printed %q, want %q", got, line)
	}
}

func (tg *target) run(t *testing.T) {
	t.Helper()
	if _, err := io.WriteString(tg.stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	tg.expect(t, "done")
}

// drain reads every event already in the ring buffer: the probes submit
// synchronously, so once the target printed "done" all its events are
// there, and a quiet spell means there are no more.
func drain(t *testing.T, tr *Tracer) []Event {
	t.Helper()
	var evs []Event
	for {
		tr.SetDeadline(time.Now().Add(300 * time.Millisecond))
		ev, err := tr.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			tr.SetDeadline(time.Time{})
			return evs
		}
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		evs = append(evs, ev)
	}
}

// asMain rewrites rdmagrpc's probe points to goreg's package main copies,
// keeping their register layouts.
func asMain(fns []GoFunc) []GoFunc {
	out := make([]GoFunc, len(fns))
	for i, fn := range fns {
		fn.Symbol = "main." + fn.Symbol[strings.LastIndexByte(fn.Symbol, '.')+1:]
		out[i] = fn
	}
	return out
}
