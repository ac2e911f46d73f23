package transporttest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The peer agent runs peer halves on another host: the suite (Run with
// Harness.PeerAgent) connects to it over TCP once per case, and the
// agent starts the case's peer half in a child process, exactly as
// CrossProcess does locally, relaying the child's stdin and stdout over
// that connection. A child per case keeps the cases independent and lets
// PeerKilledFlushes kill its peer for real.
//
// The first line on a connection says what it is for:
//
//	hello                           → the agent answers agentHello
//	quit                            → the agent answers "quit" and stops
//	peer CASE PROVIDER DEVICE ADDR  → (each %q-quoted) run that peer half
//
// After a peer half's process ended, the agent sends one last line,
// agentExit followed by the exit code and the quoted tail of its stderr,
// and half-closes. Control messages are lower-case words written by the
// cases, so they never begin with '#'.
const (
	agentHello = "transporttest-agent 1"
	agentExit  = "#transporttest-exit"
	agentQuit  = "quit"

	// agentStderrTail bounds what of a peer's stderr travels back.
	agentStderrTail = 8 << 10
	// agentLinger: how long the agent waits, after its last line, for
	// the suite to close the connection before closing it itself.
	agentLinger = 30 * time.Second
)

// ServeAgent serves peer halves to a suite running on another host until
// that suite sends quit (StopAgent), or ctx ends. The test binary's
// TestMain must call MaybeRunPeer: each peer half is that binary
// re-executed. logf (t.Logf, say) hears one line per case. It returns nil
// after quit, else why it stopped.
func ServeAgent(ctx context.Context, l net.Listener, logf func(format string, args ...any)) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	errQuit := errors.New("transporttest: agent told to quit")
	var wg sync.WaitGroup
	wg.Go(func() { // the listener's owner: Accept below ends when it closes
		<-ctx.Done()
		l.Close()
	})
	for {
		c, err := l.Accept()
		if err != nil {
			cancel(nil)
			wg.Wait()
			if errors.Is(context.Cause(ctx), errQuit) {
				return nil
			}
			if ctx.Err() != nil {
				return fmt.Errorf("transporttest: agent stopped before quit: %w", context.Cause(ctx))
			}
			return fmt.Errorf("transporttest: agent accept: %w", err)
		}
		wg.Go(func() {
			defer c.Close()
			if serveAgentConn(ctx, c, logf) {
				cancel(errQuit)
			}
		})
	}
}

// serveAgentConn handles one connection; it reports whether it was quit.
func serveAgentConn(ctx context.Context, c net.Conn, logf func(string, ...any)) bool {
	br := bufio.NewReader(c)
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	head, err := br.ReadString('\n')
	if err != nil {
		logf("transporttest agent: %v sent no request: %v", c.RemoteAddr(), err)
		return false
	}
	c.SetReadDeadline(time.Time{})
	head = strings.TrimSpace(head)
	switch {
	case head == "hello":
		fmt.Fprintln(c, agentHello)
		return false
	case head == agentQuit:
		fmt.Fprintln(c, agentQuit)
		return true
	case strings.HasPrefix(head, "peer "):
		var name, provider, device, addr string
		if _, err := fmt.Sscanf(head, "peer %q %q %q %q", &name, &provider, &device, &addr); err != nil {
			fmt.Fprintf(c, "%s 2 %q\n", agentExit, "bad peer request: "+err.Error())
			return false
		}
		start := time.Now()
		code, stderr := runAgentPeer(ctx, c, br, name, provider, device, addr)
		logf("transporttest agent: peer half %s for %v exited %d after %v", name, c.RemoteAddr(), code, time.Since(start).Round(time.Millisecond))
		if code != 0 && stderr != "" {
			logf("transporttest agent: %s stderr:\n%s", name, stderr)
		}
		return false
	default:
		fmt.Fprintf(c, "%s 2 %q\n", agentExit, "unknown request "+strconv.Quote(head))
		return false
	}
}

// runAgentPeer runs one peer half in a child process wired to c, then
// sends the exit line. It returns the child's exit code and stderr tail.
func runAgentPeer(ctx context.Context, c net.Conn, br *bufio.Reader, name, provider, device, addr string) (int, string) {
	fail := func(err error) (int, string) {
		fmt.Fprintf(c, "%s 2 %q\n", agentExit, err.Error())
		return 2, err.Error()
	}
	if tc := findCase(name); tc == nil || tc.peer == nil {
		return fail(fmt.Errorf("no peer half named %q in %s", name, os.Args[0]))
	}
	cctx, kill := context.WithCancel(ctx)
	defer kill()
	cmd := exec.CommandContext(cctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envPeer+"="+name, envProvider+"="+provider, envDevice+"="+device, envAddr+"="+addr)
	// A killed child's pipes must not hold Wait up.
	cmd.WaitDelay = 5 * time.Second
	stderr := &tailBuffer{max: agentStderrTail}
	cmd.Stderr = stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return fail(fmt.Errorf("peer stdin: %w", err))
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return fail(fmt.Errorf("peer stdout: %w", err))
	}
	if err := cmd.Start(); err != nil {
		return fail(fmt.Errorf("start peer process: %w", err))
	}
	exited := make(chan struct{})
	inDone := make(chan struct{})
	go func() { // suite → child; ends when the suite closes c (or c is closed below)
		defer close(inDone)
		io.Copy(stdin, br)
		stdin.Close()
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			// The suite went away while the peer half still runs: it
			// would wait for messages that never come.
			kill()
		}
		io.Copy(io.Discard, br) // unread data would turn our close into a reset
	}()
	io.Copy(c, stdout) // child → suite, until the child's stdout closes
	werr := cmd.Wait()
	close(exited)
	code := 0
	if werr != nil {
		code = -1
		var ee *exec.ExitError
		if errors.As(werr, &ee) && ee.ExitCode() >= 0 {
			code = ee.ExitCode()
		}
	}
	fmt.Fprintf(c, "%s %d %q\n", agentExit, code, stderr.String())
	if tc, ok := c.(interface{ CloseWrite() error }); ok {
		tc.CloseWrite()
	}
	select {
	case <-inDone:
	case <-time.After(agentLinger):
	case <-ctx.Done():
	}
	c.Close()
	<-inDone
	return code, stderr.String()
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

// StopAgent tells the agent at addr to stop serving.
func StopAgent(addr string) error {
	_, err := agentRequest(addr, agentQuit, 10*time.Second)
	return err
}

// agentRequest sends a one-line request and returns the one-line answer.
func agentRequest(addr, req string, timeout time.Duration) (string, error) {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := fmt.Fprintln(c, req); err != nil {
		return "", err
	}
	ans, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("agent at %s: no answer to %q: %w", addr, req, err)
	}
	return strings.TrimSpace(ans), nil
}

// waitAgent waits until the agent at addr answers, as the other host may
// still be booting.
func waitAgent(addr string, limit time.Duration) error {
	end := time.Now().Add(limit)
	for {
		ans, err := agentRequest(addr, "hello", 5*time.Second)
		if err == nil && ans == agentHello {
			return nil
		}
		if err == nil {
			return fmt.Errorf("transporttest: %s answered %q, not a peer agent (%q)", addr, ans, agentHello)
		}
		if time.Now().After(end) {
			return fmt.Errorf("transporttest: no peer agent at %s after %v: %w", addr, limit, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// startAgentPeer is startPeer for Harness.PeerAgent: the peer half runs
// in a process the agent starts, and the control channel is a TCP
// connection to it.
func startAgentPeer(t *testing.T, h Harness, c *testCase, addr string) (*ctl, func() error) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", h.PeerAgent, 10*time.Second)
	if err != nil {
		t.Fatalf("connect to the peer agent: %v", err)
	}
	if _, err := fmt.Fprintf(conn, "peer %q %q %q %q\n", c.name, h.Provider, h.Device, addr); err != nil {
		conn.Close()
		t.Fatalf("peer agent request: %v", err)
	}
	var (
		in     = make(chan string, 64)
		done   = make(chan struct{})
		quit   = make(chan struct{})
		code   int
		stderr string
		rerr   error
	)
	go func() { // ends at the exit line, at EOF, or when wait closes conn
		defer close(done)
		defer close(in)
		sc := bufio.NewScanner(conn)
		sc.Buffer(make([]byte, 4096), 4*agentStderrTail+1024)
		for sc.Scan() {
			line := sc.Text()
			if rest, ok := strings.CutPrefix(line, agentExit+" "); ok {
				var quoted string
				if _, err := fmt.Sscanf(rest, "%d %q", &code, &quoted); err != nil {
					rerr = fmt.Errorf("bad exit line %q: %w", line, err)
				}
				stderr = quoted
				return
			}
			select {
			case in <- line:
			case <-quit:
				return
			}
		}
		rerr = fmt.Errorf("connection to the peer agent lost before the peer half ended: %v", sc.Err())
	}()
	var mu sync.Mutex
	local := &ctl{send: func(m string) error {
		mu.Lock()
		defer mu.Unlock()
		_, err := io.WriteString(conn, m+"\n")
		return err
	}, in: in, done: done}
	return local, func() error {
		defer conn.Close()
		select {
		case <-done:
		case <-time.After(caseTimeout):
			close(quit)
			conn.Close()
			<-done
			return fmt.Errorf("peer half at %s did not finish", h.PeerAgent)
		}
		if rerr != nil {
			return rerr
		}
		if code != 0 && !c.peerExits {
			return fmt.Errorf("peer process at %s exited %d\n%s", h.PeerAgent, code, stderr)
		}
		return nil
	}
}
