package interop_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/interop"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

// The test binary plays the server or the client process when asked, so
// that the same binary runs here and in the rxe guest (no Go toolchain
// there to build the commands).
const envRole = "RDMAGRPC_INTEROP_ROLE"

func TestMain(m *testing.M) {
	switch os.Getenv(envRole) {
	case "server":
		os.Exit(server())
	case "client":
		os.Exit(client(os.Getenv("RDMAGRPC_INTEROP_ADDR")))
	}
	os.Exit(m.Run())
}

func listenAddr() string {
	if a := os.Getenv("RXE_ADDR"); a != "" {
		return net.JoinHostPort(a, "0")
	}
	return "127.0.0.1:0"
}

// server serves until its stdin closes, after printing its address.
func server() int {
	l, err := interop.Listen(context.Background(), listenAddr())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	s := interop.NewServer()
	go s.Serve(l)
	fmt.Println(l.Addr())
	bufio.NewReader(os.Stdin).ReadString('\n')
	s.GracefulStop()
	return 0
}

func client(addr string) int {
	if err := interop.Run(context.Background(), addr, interop.Cases, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// Every applicable interop case, server and client in two processes.
func TestInteropTwoProcesses(t *testing.T) {
	srv := exec.Command(os.Args[0], "-test.run=^$")
	srv.Env = append(os.Environ(), envRole+"=server")
	stdin, err := srv.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := srv.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	defer srv.Process.Kill()
	addr, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("server address: %v", err)
	}
	addr = strings.TrimSpace(addr)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cli := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cli.Env = append(os.Environ(), envRole+"=client", "RDMAGRPC_INTEROP_ADDR="+addr)
	out, err := cli.CombinedOutput()
	passed := map[string]bool{}
	for line := range strings.Lines(string(out)) {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "PASS" {
			passed[f[1]] = true
		}
	}
	for _, c := range interop.Cases {
		if !passed[c.Name] {
			t.Errorf("case %s did not pass", c.Name)
		}
	}
	if err != nil || t.Failed() {
		t.Fatalf("client: %v\n%s", err, out)
	}
	t.Logf("%d of %d interop cases passed across two processes:\n%s", len(passed), len(interop.Cases), out)
	stdin.Close()
	if err := srv.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}
}
