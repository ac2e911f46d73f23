package bpf

import (
	"bufio"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// buildDemo builds cmd/demo, which links the verbs provider and so is a
// cgo program linked by the system linker, with extra go build flags.
func buildDemo(t *testing.T, name string, flags ...string) string {
	t.Helper()
	return buildCgo(t, "../cmd/demo", name, flags...)
}

// buildCgo builds the program pkg, which must link the verbs provider
// (a cgo program), with extra go build flags.
func buildCgo(t *testing.T, pkg, name string, flags ...string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), name)
	args := append(append([]string{"build", "-o", bin}, flags...), pkg)
	cmd := exec.Command("go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	out, err := exec.Command("go", "version", "-m", bin).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "CGO_ENABLED=1") {
		t.Fatalf("go version -m %s: not a cgo build (%v)\n%s", bin, err, out)
	}
	return bin
}

// runDemo runs the demo over shm, without its OpenTelemetry files, and
// returns its output and exit status.
func runDemo(t *testing.T, bin string, started func(pid int)) (string, int) {
	t.Helper()
	cmd := exec.Command(bin, "-otel", "")
	cmd.Env = append(os.Environ(), "RDMAGRPC_PROVIDER=shm")
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	if started != nil {
		started(cmd.Process.Pid)
	}
	code := exitCode(t, bin, cmd.Wait()) // before out is read: Wait copies the last output
	return out.String(), code
}

// exitCode is the status of bin's process from its Wait's err.
func exitCode(t *testing.T, bin string, err error) int {
	t.Helper()
	if err == nil {
		return 0
	}
	ee, ok := err.(*exec.ExitError)
	if !ok {
		t.Fatalf("%s: %v", bin, err)
	}
	return ee.ExitCode()
}

var (
	demoNumber = regexp.MustCompile(`[0-9][0-9.]*(µs|ms|ns|s)?`)
	demoSpace  = regexp.MustCompile(`\s+`)
)

// demoShape is the demo's output with what varies from run to run left
// out: numbers (latencies, ports, byte counts) and the order of lines.
func demoShape(out string) []string {
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		l = demoSpace.ReplaceAllString(demoNumber.ReplaceAllString(l, "N"), " ")
		lines = append(lines, strings.TrimSpace(l))
	}
	slices.Sort(lines)
	return lines
}

// The demo built as services ship it, stripped cgo (-ldflags='-s -w'),
// traced from outside while it runs, behaves as it does untraced, and the
// tracer counts the same registrations and enlargements in it as in the
// unstripped build, which it locates through the symbol table.
func TestTraceStrippedCgoDemo(t *testing.T) {
	requireRoot(t)
	if testing.Short() {
		t.Skip("builds and runs the demo twice")
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("skipping: building the cgo demo needs gcc")
	}
	builds := []struct {
		name  string
		flags []string
	}{
		{"unstripped", nil},
		{"stripped", []string{"-ldflags=-s -w"}},
	}
	got := map[string]traceCounts{}
	for _, b := range builds {
		bin := buildDemo(t, "demo-"+b.name, b.flags...)
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatal(err)
		}
		stripped := f.Section(".symtab") == nil
		f.Close()
		if stripped != (b.flags != nil) {
			t.Fatalf("%s: symbol table present = %v", b.name, !stripped)
		}

		plain, plainCode := runDemo(t, bin, nil)

		tr, err := Open(Options{})
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
		attached, err := tr.AttachGoFuncs(bin, KnownGoFuncs)
		if err != nil || len(attached) != len(KnownGoFuncs) {
			tr.Close()
			t.Fatalf("%s: AttachGoFuncs: %v, %v", b.name, attached, err)
		}
		var pid int
		traced, tracedCode := runDemo(t, bin, func(p int) { pid = p })
		evs := drain(t, tr)
		tr.Close()

		if tracedCode != plainCode || plainCode != 0 {
			t.Errorf("%s: exit status %d traced, %d untraced; want 0", b.name, tracedCode, plainCode)
		}
		if p, q := demoShape(plain), demoShape(traced); !slices.Equal(p, q) {
			t.Errorf("%s: output differs when traced.\nuntraced:\n%s\ntraced:\n%s", b.name, plain, traced)
		}
		c := countTraced(evs, pid)
		t.Logf("%s: %+v; traced output:\n%s", b.name, c, traced)
		// The demo's own eBPF view of itself must agree with ours.
		own := fmt.Sprintf("registrations %d (%d bytes, 0 failed)", c.regs, c.regBytes)
		if !strings.Contains(traced, own) {
			t.Errorf("%s: the tracer saw %q; the demo's own view differs", b.name, own)
		}
		got[b.name] = c
	}
	u, s := got["unstripped"], got["stripped"]
	if u.regs == 0 || u.enlargements != 4 || s != u {
		t.Errorf("stripped build: %+v, unstripped %+v; want equal, with registrations and 4 enlargement events (each side enlarges and serves)", s, u)
	}
}

// traceCounts are what a traced run of a program registered and enlarged.
type traceCounts struct{ regs, regBytes, enlargements int }

// countTraced counts the successful registrations and the enlargements
// of process pid among evs.
func countTraced(evs []Event, pid int) traceCounts {
	var c traceCounts
	for _, ev := range evs {
		if ev.PID != uint32(pid) {
			continue
		}
		switch {
		case ev.Kind == KindRegister && ev.OK:
			c.regs++
			c.regBytes += int(ev.Length)
		case ev.Kind == KindEnlargement:
			c.enlargements++
		}
	}
	return c
}

// The interop server built as shipped, stripped cgo, traced from outside
// while grpc-go's interop client runs cases against it: its output and
// exit status are those of an untraced run, and the tracer counts the
// same registrations and enlargements in it as in the unstripped build.
func TestTraceStrippedCgoInteropServer(t *testing.T) {
	requireRoot(t)
	if testing.Short() {
		t.Skip("builds and runs the interop server four times")
	}
	for _, tool := range []string{"go", "gcc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: building the cgo interop server needs %s", tool)
		}
	}
	client := filepath.Join(t.TempDir(), "interop-client")
	if out, err := exec.Command("go", "build", "-o", client, "../interop/client").CombinedOutput(); err != nil {
		t.Fatalf("build the interop client: %v\n%s", err, out)
	}
	got := map[string]traceCounts{}
	for _, b := range []struct {
		name  string
		flags []string
	}{{"unstripped", nil}, {"stripped", []string{"-ldflags=-s -w"}}} {
		bin := buildCgo(t, "../interop/server", "interop-server-"+b.name, b.flags...)
		plain, plainCode := runInterop(t, bin, client, nil)

		tr, err := Open(Options{})
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
		if attached, err := tr.AttachGoFuncs(bin, KnownGoFuncs); err != nil || len(attached) != len(KnownGoFuncs) {
			tr.Close()
			t.Fatalf("%s: AttachGoFuncs: %v, %v", b.name, attached, err)
		}
		var pid int
		traced, tracedCode := runInterop(t, bin, client, func(p int) { pid = p })
		evs := drain(t, tr)
		tr.Close()

		if tracedCode != plainCode {
			t.Errorf("%s: exit status %d traced, %d untraced", b.name, tracedCode, plainCode)
		}
		if p, q := demoShape(plain), demoShape(traced); !slices.Equal(p, q) {
			t.Errorf("%s: output differs when traced.\nuntraced:\n%s\ntraced:\n%s", b.name, plain, traced)
		}
		c := countTraced(evs, pid)
		t.Logf("%s: %+v", b.name, c)
		got[b.name] = c
	}
	u, s := got["unstripped"], got["stripped"]
	if u.regs == 0 || u.enlargements == 0 || s != u {
		t.Errorf("stripped build: %+v, unstripped %+v; want equal, with registrations and enlargements", s, u)
	}
}

// runInterop starts the interop server bin over shm, runs the interop
// client's cases against it, interrupts the server, and returns the
// server's output and exit status.
func runInterop(t *testing.T, bin, client string, started func(pid int)) (string, int) {
	t.Helper()
	srv := exec.Command(bin, "--port", "0", "--provider", "shm")
	var out strings.Builder
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	srv.Stdout, srv.Stderr = pw, &out
	if err := srv.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	pw.Close()
	if started != nil {
		started(srv.Process.Pid)
	}
	r := bufio.NewReader(pr)
	line, err := r.ReadString('\n')
	if err != nil {
		srv.Process.Kill()
		srv.Wait()
		t.Fatalf("%s printed no address: %v", bin, err)
	}
	out.WriteString(line)
	host, port, _ := strings.Cut(strings.TrimSpace(line), ":")
	cl := exec.Command(client, "--server_host", host, "--server_port", port, "--provider", "shm",
		"--test_case", "large_unary,client_streaming,server_streaming,ping_pong")
	if cout, err := cl.CombinedOutput(); err != nil {
		srv.Process.Kill()
		srv.Wait()
		t.Fatalf("interop client against %s: %v\n%s", bin, err, cout)
	}
	srv.Process.Signal(os.Interrupt)
	rest, _ := io.ReadAll(r)
	out.Write(rest)
	code := exitCode(t, bin, srv.Wait())
	return out.String(), code
}
