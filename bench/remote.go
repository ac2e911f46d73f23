package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// Two hosts (the rxe tier's two guests): a spawner on one starts the
// bench's server children there, for a bench run on the other. Each TCP
// connection to the spawner asks for one child: its environment, a
// KEY=VALUE line each, then an empty line; from then on the connection
// is the child's stdin and stdout, and the spawner closes it once the
// child has exited. A connection that says exitLine instead ends the
// spawner: the bench is over (StopRemote).
const (
	// RemoteEnv names the spawner (host:port) whose host runs the
	// server children: set, spawn starts them there, not here.
	RemoteEnv = "RDMABENCH_REMOTE"
	// tcpHostEnv is the address a child's TCP listener binds, set by the
	// spawner (with HostEnv, rdmagrpc's): its clients are on another
	// host. Apart from HostEnv because a local run with -host keeps TCP
	// on loopback.
	tcpHostEnv = "RDMABENCH_TCP_HOST"
	// remoteWait bounds the wait for the spawner: the two hosts boot at
	// the same time, and either may come up first.
	remoteWait = 2 * time.Minute
	exitLine   = "exit"
)

// Remote reports whether this run's server children run on another host.
func Remote() bool { return os.Getenv(RemoteEnv) != "" }

// Spawn serves children on l until ctx ends or the bench says it is
// over (StopRemote), and closes l: host is the address their listeners
// bind, the one the other host reaches this one at.
func Spawn(ctx context.Context, l net.Listener, host string) error {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		<-ctx.Done()
		l.Close()
	}()
	fmt.Fprintf(os.Stderr, "rdmabench: spawning server children for %s, on %s\n", host, l.Addr())
	var children sync.WaitGroup
	defer children.Wait()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("spawner: %w", err)
		}
		children.Go(func() {
			if err := spawnFor(c, host, stop); err != nil {
				fmt.Fprintln(os.Stderr, "rdmabench: spawner:", err)
			}
		})
	}
}

// StopRemote ends the spawner of this run's server children, if any.
func StopRemote() error {
	addr := os.Getenv(RemoteEnv)
	if addr == "" {
		return nil
	}
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return fmt.Errorf("spawner %s: %w", addr, err)
	}
	defer c.Close()
	_, err = io.WriteString(c, exitLine+"\n")
	return err
}

// spawnFor runs the child c asks for, with c as its stdin and stdout,
// or calls exit if c says exitLine.
func spawnFor(c net.Conn, host string, exit func()) error {
	defer c.Close()
	r := bufio.NewReader(c)
	var env []string
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return fmt.Errorf("child's environment: %w", err)
		}
		if line = strings.TrimSuffix(line, "\n"); line == "" {
			break
		}
		if line == exitLine && env == nil {
			exit()
			return nil
		}
		if !strings.Contains(line, "=") {
			return fmt.Errorf("child's environment: %q is not KEY=VALUE", line)
		}
		env = append(env, line)
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(append(os.Environ(), env...), HostEnv+"="+host, tcpHostEnv+"="+host)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = r, c, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("child %v: %w", env, err)
	}
	return nil
}

// dialSpawner asks the spawner at addr for a child with env, retrying
// until the spawner's host is up.
func dialSpawner(addr string, env []string) (*net.TCPConn, error) {
	deadline := time.Now().Add(remoteWait)
	for {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err == nil {
			_, err = io.WriteString(c, strings.Join(env, "\n")+"\n\n")
			if err == nil {
				return c.(*net.TCPConn), nil
			}
			c.Close()
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("spawner %s: %w", addr, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// remoteChild is the child's end for stop: closing our half ends its
// stdin; it has exited once the spawner closes the connection.
type remoteChild struct{ c *net.TCPConn }

func (r remoteChild) Write(b []byte) (int, error) { return r.c.Write(b) }

func (r remoteChild) Close() error {
	r.c.CloseWrite()
	r.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	_, err := io.Copy(io.Discard, r.c)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		err = fmt.Errorf("the remote child did not exit: %w", err)
	}
	r.c.Close()
	return err
}
