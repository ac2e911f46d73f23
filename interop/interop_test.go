package interop_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/interop"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
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

// envTCP makes the child a plain grpc-go server or client over TCP, one
// that has not adopted rdmagrpc.
const envTCP = "RDMAGRPC_INTEROP_TCP"

// envTLS is "tls" or "mtls" for a child that uses the certificates in
// the directory envPKI names, empty for plaintext.
const envTLS, envPKI = "RDMAGRPC_INTEROP_TLS", "RDMAGRPC_INTEROP_PKI"

func creds(server bool) (credentials.TransportCredentials, error) {
	mode := os.Getenv(envTLS)
	if mode == "" {
		return nil, nil
	}
	p := interop.PKI{Dir: os.Getenv(envPKI)}
	if server {
		return p.ServerCreds(mode == "mtls")
	}
	return p.ClientCreds(mode == "mtls")
}

// server serves until its stdin closes, after printing its address; then
// it prints what each accepted connection ran on.
func server() int {
	listen := func() (net.Listener, error) { return interop.Listen(context.Background(), listenAddr()) }
	if os.Getenv(envTCP) != "" {
		listen = func() (net.Listener, error) { return net.Listen("tcp", listenAddr()) }
	}
	cr, err := creds(true)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	l, err := listen()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rec := interop.Record(l)
	var opts []grpc.ServerOption
	if cr != nil {
		opts = append(opts, grpc.Creds(cr))
	}
	s := interop.NewServer(opts...)
	go s.Serve(rec)
	fmt.Println(l.Addr())
	bufio.NewReader(os.Stdin).ReadString('\n')
	s.GracefulStop()
	rec.Report(os.Stdout)
	return 0
}

func client(addr string) int {
	cr, err := creds(false)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	run := interop.Run
	if os.Getenv(envTCP) != "" {
		run = func(ctx context.Context, addr string, cases []interop.Case, out io.Writer, cr credentials.TransportCredentials, _ ...conn.Option) error {
			return interop.RunTCP(ctx, addr, cases, out, cr)
		}
	}
	if err := run(context.Background(), addr, interop.Cases, os.Stdout, cr); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// Every applicable interop case, server and client in two processes, in
// plaintext, with TLS and with mutual TLS: rdmagrpc at both ends (over
// RDMA, on the server's side too), a plain grpc-go client over TCP to an
// rdmagrpc server (one address serves both), and an rdmagrpc client to a
// plain grpc-go server (it falls back to TCP, with no time-out).
func TestInteropTwoProcesses(t *testing.T) {
	pki, err := interop.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, sec := range []string{"plaintext", "tls", "mtls"} {
		for _, tc := range []struct {
			name                 string
			tcpServer, tcpClient bool
			provider             string // what the rdmagrpc ends' connections report; "" for a plain end
		}{
			{"rdmagrpc-both", false, false, "rdma"},
			{"tcp-client-to-rdmagrpc-server", false, true, ""},
			{"rdmagrpc-client-to-tcp-server", true, false, "tcp"},
		} {
			t.Run(sec+"/"+tc.name, func(t *testing.T) {
				mode := sec
				if sec == "plaintext" {
					mode = ""
				}
				interopPair(t, tc.tcpServer, tc.tcpClient, tc.provider, envTLS+"="+mode, envPKI+"="+pki.Dir)
			})
		}
	}
}

func interopPair(t *testing.T, tcpServer, tcpClient bool, provider string, env ...string) {
	flag := func(on bool) string {
		if on {
			return envTCP + "=1"
		}
		return envTCP + "="
	}
	srv := exec.Command(os.Args[0], "-test.run=^$")
	srv.Env = append(append(os.Environ(), env...), envRole+"=server", flag(tcpServer))
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
	srvOut := bufio.NewReader(stdout)
	addr, err := srvOut.ReadString('\n')
	if err != nil {
		t.Fatalf("server address: %v", err)
	}
	addr = strings.TrimSpace(addr)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cli := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cli.Env = append(append(os.Environ(), env...), envRole+"=client", "RDMAGRPC_INTEROP_ADDR="+addr, flag(tcpClient))
	start := time.Now()
	out, err := cli.CombinedOutput()
	took := time.Since(start)
	passed := map[string]bool{}
	for line := range strings.Lines(string(out)) {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "PASS" {
			passed[f[1]] = true
		}
	}
	providers := fields(string(out), "PROVIDER")
	switch {
	case provider == "" && len(providers) != 0:
		t.Errorf("a plain TCP client reported rdmagrpc connections %v", providers)
	case provider != "" && len(providers) == 0:
		t.Errorf("the rdmagrpc client reported no connection")
	}
	for _, p := range providers {
		if provider == "rdma" && p == "tcp" || provider == "tcp" && p != "tcp" {
			t.Errorf("client connection over %s, want %s", p, provider)
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
	stdin.Close()
	rest, _ := io.ReadAll(srvOut)
	if err := srv.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}
	served := fields(string(rest), "SERVED")
	if provider == "rdma" {
		if len(served) == 0 {
			t.Errorf("the rdmagrpc server reported no connection")
		}
		for _, p := range served {
			if p == "tcp" {
				t.Errorf("the server served a connection over tcp, want RDMA:\n%s", rest)
			}
		}
	}
	t.Logf("%d of %d interop cases passed across two processes in %v, client connections over %v, server's over %v",
		len(passed), len(interop.Cases), took.Round(time.Millisecond), providers, served)
}

// fields returns the second field of each line of out that starts with
// key.
func fields(out, key string) []string {
	var v []string
	for line := range strings.Lines(out) {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == key {
			v = append(v, f[1])
		}
	}
	return v
}

// TestMixedFleetPair runs in the two-guest mode of tests/rxe
// (TestMixedFleetGuests): guest a has Soft-RoCE, guest b has no RDMA at
// all, as in a fleet that adopts RDMA node by node. Every interop case
// passes between them, over TCP: b's plain and rdmagrpc clients to a's
// rdmagrpc server, and a's rdmagrpc client (verbs) to b's rdmagrpc
// server (shm: no device) and to b's plain server.
func TestMixedFleetPair(t *testing.T) {
	role, self, peer := os.Getenv("RXE_ROLE"), os.Getenv("RXE_ADDR"), os.Getenv("RXE_PEER")
	if role != "a" && role != "b" || os.Getenv("RDMAGRPC_MIXED_FLEET") == "" {
		t.Skip("runs only in tests/rxe's mixed-fleet pair (RXE_ROLE, RDMAGRPC_MIXED_FLEET)")
	}
	const rdmaPort, shmPort, tcpPort, donePort = "7472", "7473", "7474", "7475"
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	serve := func(l net.Listener) {
		s := interop.NewServer()
		go s.Serve(l)
		t.Cleanup(s.Stop)
	}
	listen := func(port string, rdmagrpc bool) {
		addr := net.JoinHostPort(self, port)
		var l net.Listener
		var err error
		if rdmagrpc {
			l, err = interop.Listen(ctx, addr)
		} else {
			l, err = net.Listen("tcp", addr)
		}
		if err != nil {
			t.Fatal(err)
		}
		serve(l)
	}
	done, err := net.Listen("tcp", net.JoinHostPort(self, donePort))
	if err != nil {
		t.Fatal(err)
	}
	defer done.Close()
	type target struct {
		port      string
		tcpClient bool // grpc-go's own TCP dialer, else rdmagrpc's
	}
	var cases []target
	if role == "a" {
		listen(rdmaPort, true)
		cases = []target{{shmPort, false}, {tcpPort, false}}
	} else {
		listen(shmPort, true)
		listen(tcpPort, false)
		cases = []target{{rdmaPort, true}, {rdmaPort, false}}
	}
	waitPort := func(port string) {
		for {
			c, err := net.Dial("tcp", net.JoinHostPort(peer, port))
			if err == nil {
				c.Close()
				return
			}
			if ctx.Err() != nil {
				t.Fatalf("peer %s:%s never listened: %v", peer, port, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	for _, c := range cases {
		addr := net.JoinHostPort(peer, c.port)
		waitPort(c.port)
		var out strings.Builder
		w := io.MultiWriter(&out, os.Stdout)
		if c.tcpClient {
			err = interop.RunTCP(ctx, addr, interop.Cases, w, nil)
		} else {
			err = interop.Run(ctx, addr, interop.Cases, w, nil)
		}
		if err != nil {
			t.Fatalf("%s: %v", addr, err)
		}
		passed, providers := 0, 0
		for line := range strings.Lines(out.String()) {
			f := strings.Fields(line)
			switch {
			case len(f) >= 2 && f[0] == "PASS":
				passed++
			case len(f) >= 2 && f[0] == "PROVIDER":
				providers++
				if f[1] != "tcp" {
					t.Errorf("%s: a connection over %s between a host with RDMA and one without", addr, f[1])
				}
			}
		}
		if passed != len(interop.Cases) || !c.tcpClient && providers == 0 {
			t.Fatalf("%s: %d of %d cases passed, %d connections reported", addr, passed, len(interop.Cases), providers)
		}
		t.Logf("guest %s to %s (tcp client %v): %d interop cases passed", role, addr, c.tcpClient, passed)
	}
	// Serve until the peer is done with our servers too.
	waitPort(donePort)
	c, err := done.Accept()
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}
