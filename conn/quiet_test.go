package conn

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A library must not write to its program's output: a service importing
// conn (and the verbs provider) prints nothing, not even the provider it
// chose, unless RDMAGRPC_LOG or SetLogger asks.
func TestQuietByDefault(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool here (the rxe guest) to build the test program")
	}
	bin := filepath.Join(t.TempDir(), "quiet")
	if out, err := exec.Command(gobin, "build", "-o", bin, "./testdata/quiet").CombinedOutput(); err != nil {
		t.Fatalf("go build ./testdata/quiet: %v\n%s", err, out)
	}
	run := func(env ...string) (stdout, stderr string) {
		var o, e bytes.Buffer
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), "RDMAGRPC_LOG=", "RDMAGRPC_PROVIDER=")
		cmd.Env = append(cmd.Env, env...)
		cmd.Stdout, cmd.Stderr = &o, &e
		if err := cmd.Run(); err != nil {
			t.Fatalf("quiet %v: %v\nstdout: %s\nstderr: %s", env, err, o.String(), e.String())
		}
		return o.String(), e.String()
	}
	if o, e := run(); o != "" || e != "" {
		t.Fatalf("a program importing conn printed, unasked:\nstdout: %q\nstderr: %q", o, e)
	}
	o, e := run("RDMAGRPC_LOG=debug")
	if o != "" || !strings.Contains(e, "transport provider chosen") || !strings.Contains(e, "why=") {
		t.Fatalf("RDMAGRPC_LOG=debug: want the provider choice on stderr only\nstdout: %q\nstderr: %q", o, e)
	}
	t.Logf("with RDMAGRPC_LOG=debug: %s", strings.TrimSpace(e))
}

// WithLogger gets the choice at debug level, and Stats says it too.
func TestProviderChoiceReported(t *testing.T) {
	var buf bytes.Buffer
	lg := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", WithProvider("shm"), WithLogger(lg))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Close()
		}
	}()
	c, err := Dial(ctx, l.Addr().String(), WithProvider("shm"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !strings.Contains(buf.String(), "level=DEBUG") || !strings.Contains(buf.String(), "provider=shm why=option") {
		t.Fatalf("WithLogger got %q", buf.String())
	}
	if err := c.(*Conn).Handshake(ctx); err != nil {
		t.Fatal(err)
	}
	s := c.(*Conn).Stats()
	if s.Provider != "shm" || s.ProviderReason != "option" {
		t.Fatalf("Stats: provider %q, reason %q; want shm, option", s.Provider, s.ProviderReason)
	}
}

// conn depends on no provider: a program that imports none gets
// ErrNoProvider from Listen and Dial, naming the imports it lacks.
func TestNoProviderImported(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool here (the rxe guest) to build the test program")
	}
	list, err := exec.Command(gobin, "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, p := range strings.Fields(string(list)) {
		if strings.HasPrefix(p, "github.com/rdmagrpc/rdmagrpc/transport/") {
			t.Errorf("conn depends on the provider package %s", p)
		}
	}
	out, err := exec.Command(gobin, "run", "./testdata/noprovider").CombinedOutput()
	if err != nil {
		t.Fatalf("a program with no provider: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), `import _ "github.com/rdmagrpc/rdmagrpc/transport/shm"`) {
		t.Fatalf("the error does not name the import:\n%s", out)
	}
}
