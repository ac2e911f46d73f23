package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
)

// These tests run the real rdmatrace binary as root against goreg
// (bpf/testdata/goreg), a helper that makes a scripted number of calls to
// functions shaped like rdmagrpc's probe points, in package main (hence
// --go-package main).

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: rdmatrace's eBPF probes need root; run `sudo go test ./cmd/rdmatrace/`")
	}
}

func build(t *testing.T) (rdmatrace, goreg string) {
	t.Helper()
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil { // readable by the unprivileged test too
		t.Fatal(err)
	}
	rdmatrace, goreg = filepath.Join(dir, "rdmatrace"), filepath.Join(dir, "goreg")
	for _, c := range [][]string{
		{"go", "build", "-o", rdmatrace, "."},
		{"go", "build", "-o", goreg, "../../bpf/testdata/goreg"},
	} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v\n%s", c, err, out)
		}
	}
	return rdmatrace, goreg
}

// goregProc runs goreg with -repeat: every "go" line runs its script once.
type goregProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

func startGoreg(t *testing.T, bin string, args ...string) *goregProc {
	t.Helper()
	cmd := exec.Command(bin, append(args, "-repeat")...)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	g := &goregProc{cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout)}
	t.Cleanup(func() { stdin.Close(); cmd.Wait() })
	g.expect(t, "ready")
	return g
}

func (g *goregProc) expect(t *testing.T, want string) {
	t.Helper()
	if !g.out.Scan() || g.out.Text() != want {
		t.Fatalf("goreg: got %q, want %q (%v)", g.out.Text(), want, g.out.Err())
	}
}

func (g *goregProc) round(t *testing.T) {
	t.Helper()
	fmt.Fprintln(g.stdin, "go")
	g.expect(t, "done")
}

// tmuxView runs cmdline in a detached tmux session of the given size and
// returns a way to send it keys and to wait for text on its screen.
type tmuxView struct {
	t       *testing.T
	session string
}

func startTmux(t *testing.T, name, cmdline string, width, height int) *tmuxView {
	t.Helper()
	v := &tmuxView{t: t, session: fmt.Sprintf("%s-%d", name, os.Getpid())}
	v.run("new-session", "-d", "-s", v.session, "-x", fmt.Sprint(width), "-y", fmt.Sprint(height), cmdline)
	t.Cleanup(func() { exec.Command("tmux", "kill-session", "-t", v.session).Run() })
	return v
}

func (v *tmuxView) run(args ...string) string {
	v.t.Helper()
	out, err := exec.Command("tmux", args...).CombinedOutput()
	if err != nil {
		v.t.Fatalf("tmux %v: %v\n%s", args, err, out)
	}
	return string(out)
}

func (v *tmuxView) keys(keys ...string) {
	v.run(append([]string{"send-keys", "-t", v.session}, keys...)...)
}

func (v *tmuxView) screen() string { return v.run("capture-pane", "-p", "-t", v.session) }

// has is an Eventually condition: the screen shows every one of subs.
func (v *tmuxView) has(subs ...string) func() (bool, string) {
	return func() (bool, string) {
		s := v.screen()
		for _, sub := range subs {
			if !strings.Contains(s, sub) {
				return false, s
			}
		}
		return true, s
	}
}

// buildStripped builds goreg with -ldflags='-s -w' beside goreg.
func buildStripped(t *testing.T, goreg, name string) string {
	t.Helper()
	bin := filepath.Join(filepath.Dir(goreg), name)
	if out, err := exec.Command("go", "build", "-ldflags=-s -w", "-o", bin, "../../bpf/testdata/goreg").CombinedOutput(); err != nil {
		t.Fatalf("build stripped goreg: %v\n%s", err, out)
	}
	return bin
}

// The live view under tmux: rows appear with exact counts, and the keys
// sort, filter and quit.
func TestLiveViewTmux(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("tmux"); err != nil {
		t.Skip("skipping: tmux is not installed (scripts/deps.sh installs it)")
	}
	rdmatrace, goreg := build(t)
	g := startGoreg(t, goreg, "-g", "2", "-n", "150", "-fail", "2", "-enlarge", "3", "-size", "65536")
	pid := g.cmd.Process.Pid

	cmdline := fmt.Sprintf("%s --pid %d --go-package main --interval 200ms --no-verbs; sleep 30", rdmatrace, pid)
	v := startTmux(t, "rdmatrace-test", cmdline, 150, 45)
	screen, has := v.screen, v.has
	testutil.Eventually(t, 20*time.Second, "the view to start", has("probes: libibverbs 0, Go 3", "no registrations seen yet"))

	g.round(t)
	g.round(t)
	// 2 rounds x 2 goroutines: 600 registrations of 64 KiB, 8 failures,
	// 600 deregistrations, 12 enlargements.
	row := fmt.Sprintf("%7d %-12s", pid, "goreg")
	s := testutil.Eventually(t, 10*time.Second, "the goreg row", func() (bool, string) {
		s := screen()
		for line := range strings.Lines(s) {
			f := strings.Fields(line)
			// PID COMM REG/s REGS FAIL REGD LIVE p50 p99 ENL SHR
			if strings.HasPrefix(line, row) && len(f) == 11 &&
				f[3] == "600" && f[4] == "8" && f[5] == "38M" && f[6] == "0B" && f[9] == "12" && f[10] == "0" {
				return true, s
			}
		}
		return false, s
	})
	t.Logf("screen:\n%s", s)
	if n := strings.Count(s, "1.0K→64K"); n != 8 {
		t.Errorf("%d enlargement lines shown, want the 8 most recent", n)
	}
	if !strings.Contains(s, "registration latency, pid "+fmt.Sprint(pid)+" (goreg): 608 calls") {
		t.Errorf("histogram header missing or wrong count")
	}

	v.keys("s")
	testutil.Eventually(t, 5*time.Second, "sort by regs", has("sort: regs ▼"))
	v.keys("r")
	testutil.Eventually(t, 5*time.Second, "reverse sort", has("sort: regs ▲"))
	v.keys("/", "n", "o", "m", "a", "t", "c", "h", "Enter")
	testutil.Eventually(t, 5*time.Second, "filter hiding the row", has("filter: nomatch", "no registrations seen yet"))
	v.keys("c")
	testutil.Eventually(t, 5*time.Second, "filter cleared", has("filter: (none)", row))
	v.keys("q")
	testutil.Eventually(t, 5*time.Second, "quit", func() (bool, string) {
		s := screen()
		return !strings.Contains(s, "rdmatrace — memory registration"), s
	})
}

// The live view started first, with neither --pid nor --binary: two
// processes started later, one of them stripped, appear with exact
// counts; one that exits is marked, and x hides it.
func TestLiveViewTmuxDiscovers(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("tmux"); err != nil {
		t.Skip("skipping: tmux is not installed (scripts/deps.sh installs it)")
	}
	rdmatrace, goreg := build(t)
	stripped := buildStripped(t, goreg, "goreg-s")
	cmdline := fmt.Sprintf("%s --go-package main --interval 200ms --no-verbs; sleep 30", rdmatrace)
	v := startTmux(t, "rdmatrace-disc", cmdline, 200, 50)
	screen, has := v.screen, v.has
	testutil.Eventually(t, 20*time.Second, "the view to start", has("watching every process: 0 rdmagrpc executables probed"))
	g1 := startGoreg(t, goreg, "-g", "2", "-n", "40", "-enlarge", "1")
	g2 := startGoreg(t, stripped, "-g", "1", "-n", "30", "-fail", "3", "-enlarge", "2")
	testutil.Eventually(t, 5*time.Second, "both found", has("2 rdmagrpc executables probed, 2 processes running them"))
	g1.round(t)
	g2.round(t)
	row := func(pid int, comm string, regs, fails, enl string) func() (bool, string) {
		prefix := fmt.Sprintf("%7d %-12s", pid, comm)
		return func() (bool, string) {
			s := screen()
			for line := range strings.Lines(s) {
				f := strings.Fields(line)
				if strings.HasPrefix(line, prefix) && len(f) == 11 && f[3] == regs && f[4] == fails && f[9] == enl && f[10] == "0" {
					return true, s
				}
			}
			return false, s
		}
	}
	testutil.Eventually(t, 5*time.Second, "goreg's row", row(g1.cmd.Process.Pid, "goreg", "80", "0", "2"))
	s := testutil.Eventually(t, 5*time.Second, "the stripped goreg's row", row(g2.cmd.Process.Pid, "goreg-s", "30", "3", "2"))
	t.Logf("screen:\n%s", s)
	g2.stdin.Close()
	g2.cmd.Wait()
	testutil.Eventually(t, 5*time.Second, "the exited mark", has("goreg-s gone"))
	v.keys("x")
	testutil.Eventually(t, 5*time.Second, "exited rows hidden", func() (bool, string) {
		s := screen()
		return !strings.Contains(s, "goreg-s") && strings.Contains(s, fmt.Sprintf("%7d goreg", g1.cmd.Process.Pid)), s
	})
	v.keys("q")
}

// --json --duration: one line per call, then exact per-process totals.
func TestJSONExactCounts(t *testing.T) {
	requireRoot(t)
	rdmatrace, goreg := build(t)
	g := startGoreg(t, goreg, "-g", "3", "-n", "70", "-fail", "4", "-enlarge", "2")

	cmd := exec.Command(rdmatrace, "--json", "--duration", "4s", "--pid", fmt.Sprint(g.cmd.Process.Pid), "--go-package", "main", "--no-verbs")
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Start the calls only once the probes are in.
	var log strings.Builder
	for sc := bufio.NewScanner(stderr); sc.Scan(); {
		log.WriteString(sc.Text() + "\n")
		if strings.HasPrefix(sc.Text(), "rdmatrace: attached ") {
			break
		}
	}
	if !strings.Contains(log.String(), "rdmatrace: attached ") {
		cmd.Wait()
		t.Fatalf("rdmatrace did not attach:\n%s", log.String())
	}
	g.round(t)
	io.Copy(&log, stderr) // until rdmatrace exits; Wait must come after the last read
	if err := cmd.Wait(); err != nil {
		t.Fatalf("rdmatrace: %v\n%s", err, log.String())
	}
	counts := map[string]int{}
	var sum jsonSummary
	var tot jsonTotals
	for line := range strings.Lines(stdout.String()) {
		var ev jsonEvent
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("bad line %q: %v", line, err)
		}
		switch ev.Type {
		case "event":
			counts[fmt.Sprintf("%s ok=%v", ev.Kind, ev.OK)]++
		case "summary":
			json.Unmarshal([]byte(line), &sum)
		case "totals":
			json.Unmarshal([]byte(line), &tot)
		}
	}
	want := map[string]int{"reg ok=true": 210, "reg ok=false": 12, "dereg ok=true": 210, "enlarge ok=true": 6}
	for k, v := range want {
		if counts[k] != v {
			t.Errorf("%s: %d events, want %d (all: %v)", k, counts[k], v, counts)
		}
	}
	if sum.Regs != 210 || sum.RegFails != 12 || sum.Deregs != 210 || sum.Enlargements != 6 || sum.Registered != 210*4096 || sum.Live != 0 {
		t.Errorf("summary %+v", sum)
	}
	if tot.Events != 438 || tot.Lost != 0 {
		t.Errorf("totals %+v", tot)
	}
}

func TestNotRootMessage(t *testing.T) {
	requireRoot(t) // to drop privileges we need them first
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("skipping: setpriv not installed")
	}
	rdmatrace, _ := build(t)
	out, err := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", rdmatrace, "--duration", "1s").CombinedOutput()
	if err == nil {
		t.Fatalf("unprivileged rdmatrace succeeded:\n%s", out)
	}
	if !strings.Contains(string(out), "rdmatrace needs root") {
		t.Fatalf("unprivileged output:\n%s", out)
	}
}

func TestHelp(t *testing.T) {
	var b bytes.Buffer
	_, err := parseFlags([]string{"--help"}, &b)
	if err == nil {
		t.Fatal("--help did not stop")
	}
	for _, want := range []string{"--pid", "--binary", "--json", "--duration", "libibverbs.so.1", "Keys in the live view", "sudo rdmatrace"} {
		if !strings.Contains(strings.ReplaceAll(b.String(), "  -", "  --"), want) {
			t.Errorf("help lacks %q", want)
		}
	}
}

// Started first, with neither --pid nor --binary, rdmatrace finds the
// rdmagrpc processes that start after it, a stripped one (-ldflags='-s
// -w') among them, and counts each exactly.
func TestDiscoversNewProcesses(t *testing.T) {
	requireRoot(t)
	rdmatrace, goreg := build(t)
	stripped := buildStripped(t, goreg, "goreg-stripped")
	cmd := exec.Command(rdmatrace, "--json", "--duration", "6s", "--go-package", "main", "--no-verbs")
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 100)
	go func() {
		defer close(lines)
		for sc := bufio.NewScanner(stderr); sc.Scan(); {
			lines <- sc.Text()
		}
	}()
	var log strings.Builder
	wait := func(what func(string) bool) {
		t.Helper()
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					cmd.Wait()
					t.Fatalf("rdmatrace ended:\n%s", log.String())
				}
				log.WriteString(l + "\n")
				if what(l) {
					return
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("rdmatrace said nothing expected:\n%s", log.String())
			}
		}
	}
	wait(func(l string) bool { return strings.HasPrefix(l, "rdmatrace: attached") })
	// All start after rdmatrace: it must find them by itself. The third
	// runs in a mount namespace of its own, from a file rdmatrace's
	// namespace cannot see (a tmpfs mounted there), as in a container.
	g1 := startGoreg(t, goreg, "-g", "2", "-n", "30", "-enlarge", "1")
	g2 := startGoreg(t, stripped, "-g", "3", "-n", "20", "-fail", "2", "-enlarge", "2")
	procs := []*goregProc{g1, g2}
	var g3 *goregProc
	if _, err := exec.LookPath("unshare"); err == nil {
		hidden := t.TempDir()
		script := fmt.Sprintf(`mount -t tmpfs none %s && cp %s %s/app && exec %s/app "$@"`, hidden, goreg, hidden, hidden)
		g3 = startGoreg(t, "unshare", "-m", "sh", "-c", script, "sh", "-n", "15", "-enlarge", "3")
		procs = append(procs, g3)
	} else {
		t.Log("unshare(1) missing: the other mount namespace is not tried")
	}
	for _, g := range procs {
		pid := fmt.Sprintf("(pid %d)", g.cmd.Process.Pid)
		wait(func(l string) bool { return strings.Contains(l, "attached") && strings.HasSuffix(l, pid) })
	}
	for _, g := range procs {
		g.round(t)
	}
	for range lines {
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("rdmatrace: %v\n%s", err, log.String())
	}
	sums := map[uint32]jsonSummary{}
	for line := range strings.Lines(stdout.String()) {
		var s jsonSummary
		if json.Unmarshal([]byte(line), &s) == nil && s.Type == "summary" {
			sums[s.PID] = s
		}
	}
	for _, c := range []struct {
		g                         *goregProc
		regs, fails, enlargements uint64
	}{{g1, 60, 0, 2}, {g2, 60, 6, 6}, {g3, 15, 0, 3}} {
		if c.g == nil {
			continue
		}
		s := sums[uint32(c.g.cmd.Process.Pid)]
		// goreg's markers: outcome 1 (enlarged) on distinct connection ids.
		if s.Regs != c.regs || s.RegFails != c.fails || s.Deregs != c.regs || s.Enlargements != c.enlargements || s.LargeSend != int(c.enlargements) {
			t.Errorf("pid %d: %+v; want %d regs, %d failures, %d deregs, %d enlargements", c.g.cmd.Process.Pid, s, c.regs, c.fails, c.regs, c.enlargements)
		}
	}
	t.Logf("rdmatrace's messages:\n%s", log.String())
}
