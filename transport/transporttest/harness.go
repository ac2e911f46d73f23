package transporttest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Harness describes the provider under test.
type Harness struct {
	Provider   string // registered provider name
	Device     string // device name; "" for the default
	ListenAddr string // where the local half listens, e.g. "127.0.0.1:0"
	// CrossProcess runs every peer half in a child process (the test
	// binary re-executed; its TestMain must call MaybeRunPeer).
	CrossProcess bool
	// PeerAgent, when set, is the TCP address of a ServeAgent on another
	// host: every peer half runs there, in its own process, and the
	// control channel is a TCP connection. ListenAddr must then be an
	// address that host can reach. Implies the cross-process cases.
	PeerAgent string
}

// crossProcess reports whether peer halves run in a process of their own.
func (h Harness) crossProcess() bool { return h.CrossProcess || h.PeerAgent != "" }

// agentBoot is how long Run waits for a peer agent to answer: the other
// host may be a guest still booting under emulation.
const agentBoot = 2 * time.Minute

const (
	envPeer     = "TRANSPORTTEST_PEER"
	envProvider = "TRANSPORTTEST_PROVIDER"
	envDevice   = "TRANSPORTTEST_DEVICE"
	envAddr     = "TRANSPORTTEST_ADDR"

	caseTimeout = 60 * time.Second
	bye         = "bye"
)

// errPeerDone is returned by ctl.recv once the other half has finished.
var errPeerDone = errors.New("transporttest: the other half finished")

// ctl is one end of the control channel between the two halves.
type ctl struct {
	send func(string) error
	in   <-chan string
	done <-chan struct{} // the other half has finished
}

func (c *ctl) sendf(format string, args ...any) error { return c.send(fmt.Sprintf(format, args...)) }

func (c *ctl) recv(ctx context.Context) (string, error) {
	select {
	case m, ok := <-c.in:
		if !ok {
			return "", errPeerDone
		}
		return m, nil
	case <-c.done:
		select { // a message sent just before finishing still counts
		case m, ok := <-c.in:
			if ok {
				return m, nil
			}
		default:
		}
		return "", errPeerDone
	case <-ctx.Done():
		return "", fmt.Errorf("transporttest: waiting for the other half: %w", ctx.Err())
	}
}

// expect receives one message and checks its first word.
func (c *ctl) expect(ctx context.Context, word string) ([]string, error) {
	m, err := c.recv(ctx)
	if err != nil {
		return nil, err
	}
	f := strings.Fields(m)
	if len(f) == 0 || f[0] != word {
		return nil, fmt.Errorf("transporttest: control message %q, want %q", m, word)
	}
	return f[1:], nil
}

// Peer is what a peer half gets: its own device and the listener's address.
type peer struct {
	dev  transport.Device
	addr string
	ctl  *ctl
}

// MaybeRunPeer turns this process into a peer half when the suite started
// it as one, and exits; otherwise it returns at once. Call it first thing
// in TestMain.
func MaybeRunPeer() {
	name := os.Getenv(envPeer)
	if name == "" {
		return
	}
	c := findCase(name)
	if c == nil || c.peer == nil {
		fmt.Fprintf(os.Stderr, "transporttest: no peer half named %q\n", name)
		os.Exit(2)
	}
	in := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			in <- sc.Text()
		}
		close(in)
	}()
	var mu sync.Mutex
	send := func(m string) error {
		mu.Lock()
		defer mu.Unlock()
		_, err := fmt.Fprintln(os.Stdout, m)
		return err
	}
	err := runPeer(c, os.Getenv(envProvider), os.Getenv(envDevice), os.Getenv(envAddr), &ctl{send: send, in: in, done: make(chan struct{})})
	if err != nil {
		fmt.Fprintf(os.Stderr, "transporttest: peer %s: %v\n", name, err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runPeer(c *testCase, provider, device, addr string, k *ctl) error {
	p, err := transport.Get(provider)
	if err != nil {
		return err
	}
	dev, err := p.Open(device)
	if err != nil {
		return fmt.Errorf("open %s device %q: %w", provider, device, err)
	}
	defer dev.Close()
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	return c.peer(ctx, &peer{dev: dev, addr: addr, ctl: k})
}

// startPeer runs the peer half of c and returns the local end of the
// control channel and a function waiting for the peer's result.
func startPeer(t *testing.T, h Harness, c *testCase, addr string) (*ctl, func() error) {
	t.Helper()
	if h.PeerAgent != "" {
		return startAgentPeer(t, h, c, addr)
	}
	if !h.CrossProcess {
		toPeer, toLocal := make(chan string, 64), make(chan string, 64)
		localDone, peerDone := make(chan struct{}), make(chan struct{})
		res := make(chan error, 1)
		go func() {
			defer close(peerDone)
			res <- runPeer(c, h.Provider, h.Device, addr, &ctl{
				send: func(m string) error { toLocal <- m; return nil },
				in:   toPeer, done: localDone,
			})
		}()
		local := &ctl{send: func(m string) error { toPeer <- m; return nil }, in: toLocal, done: peerDone}
		return local, func() error {
			defer close(localDone)
			select {
			case err := <-res:
				return err
			case <-time.After(caseTimeout):
				return errors.New("peer half did not finish")
			}
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envPeer+"="+c.name, envProvider+"="+h.Provider, envDevice+"="+h.Device, envAddr+"="+addr)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start peer process: %v", err)
	}
	in, done := make(chan string, 64), make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			in <- sc.Text()
		}
		close(in)
	}()
	var mu sync.Mutex
	local := &ctl{send: func(m string) error {
		mu.Lock()
		defer mu.Unlock()
		_, err := io.WriteString(stdin, m+"\n")
		return err
	}, in: in, done: done}
	return local, func() error {
		wait := make(chan error, 1)
		go func() { <-done; wait <- cmd.Wait() }()
		select {
		case err := <-wait:
			stdin.Close()
			if err != nil && !c.peerExits {
				return fmt.Errorf("peer process: %v\n%s", err, stderr.String())
			}
			return nil
		case <-time.After(caseTimeout):
			cmd.Process.Kill()
			<-wait
			return fmt.Errorf("peer process did not finish\n%s", stderr.String())
		}
	}
}

// Run runs the whole suite against h.
func Run(t *testing.T, h Harness) {
	p, err := transport.Get(h.Provider)
	if err != nil {
		t.Fatal(err)
	}
	probe, err := p.Open(h.Device)
	if errors.Is(err, transport.ErrUnavailable) {
		t.Skipf("provider %s unavailable here: %v", h.Provider, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	probe.Close()
	if h.PeerAgent != "" {
		if err := waitAgent(h.PeerAgent, agentBoot); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.crossOnly && !h.crossProcess() {
				t.Skip("needs the peer in another process")
			}
			dev, err := p.Open(h.Device)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { dev.Close() })
			e := &env{t: t, dev: dev, h: h}
			if c.peer == nil {
				c.local(t, e)
				return
			}
			l, err := dev.Listen(h.ListenAddr)
			if err != nil {
				t.Fatalf("listen on %s: %v", h.ListenAddr, err)
			}
			t.Cleanup(func() { l.Close() })
			e.l = l
			k, wait := startPeer(t, h, c, l.Addr().String())
			e.ctl = k
			func() {
				defer func() {
					k.send(bye)
					if err := wait(); err != nil {
						t.Errorf("peer half: %v", err)
					}
				}()
				c.local(t, e)
			}()
		})
	}
}

// env is what a local half gets.
type env struct {
	t   *testing.T
	h   Harness
	dev transport.Device
	l   transport.Listener
	ctl *ctl
}

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout/2)
	e.t.Cleanup(cancel)
	return ctx
}

// expect is ctl.expect that fails the test.
func (e *env) expect(word string) []string {
	e.t.Helper()
	f, err := e.ctl.expect(e.ctx(), word)
	if err != nil {
		e.t.Fatal(err)
	}
	return f
}

func (e *env) send(format string, args ...any) {
	e.t.Helper()
	if err := e.ctl.sendf(format, args...); err != nil {
		e.t.Fatal(err)
	}
}
