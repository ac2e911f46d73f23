package conn_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/interop"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

// clientOnce is the client process of TestShmAcrossNetworkNamespaces: two
// RPCs to addr, then the provider its connection used and why, on stdout.
func clientOnce(addr string) int {
	var last *conn.Conn
	dialer := conn.Dialer()
	cc, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
			c, err := dialer(ctx, a)
			if err == nil {
				last = c.(*conn.Conn)
			}
			return c, err
		}),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tc := testgrpc.NewTestServiceClient(cc)
	interop.DoEmptyUnaryCall(ctx, tc)
	interop.DoLargeUnaryCall(ctx, tc)
	s := last.Stats()
	fmt.Printf("PROVIDER %s %s\n", s.Provider, s.ProviderReason)
	return 0
}

// netnsPair makes two network namespaces joined by a veth pair, with
// addresses 10.77.<n>.1 and .2, and removes them at the end of the test.
func netnsPair(t *testing.T, n int) (a, b, addrA string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skipf("needs iproute2's ip: %v", err)
	}
	a, b = fmt.Sprintf("rdg%da%d", os.Getpid(), n), fmt.Sprintf("rdg%db%d", os.Getpid(), n)
	va, vb := fmt.Sprintf("rdga%d_%d", n, os.Getpid()%10000), fmt.Sprintf("rdgb%d_%d", n, os.Getpid()%10000)
	ipA, ipB := fmt.Sprintf("10.77.%d.1", n), fmt.Sprintf("10.77.%d.2", n)
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	if out, err := exec.Command("ip", "netns", "add", a).CombinedOutput(); err != nil {
		t.Skipf("cannot create a network namespace here: ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", a).Run() })
	run("netns", "add", b)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", b).Run() })
	if out, err := exec.Command("ip", "link", "add", va, "type", "veth", "peer", "name", vb).CombinedOutput(); err != nil {
		t.Skipf("cannot create a veth pair here (no veth driver?): %v: %s", err, out)
	}
	run("link", "set", va, "netns", a)
	run("link", "set", vb, "netns", b)
	run("-n", a, "addr", "add", ipA+"/24", "dev", va)
	run("-n", b, "addr", "add", ipB+"/24", "dev", vb)
	for _, ns := range []string{a, b} {
		run("-n", ns, "link", "set", "lo", "up")
	}
	run("-n", a, "link", "set", va, "up")
	run("-n", b, "link", "set", vb, "up")
	return a, b, ipA
}

// Two processes of one host in two network namespaces (two pods of one
// node): with a socket directory both mount they use shm, whose abstract
// socket the other namespace cannot see; without it they stay on TCP, every
// RPC intact both times.
func TestShmAcrossNetworkNamespaces(t *testing.T) {
	t.Setenv("RDMAGRPC_PROVIDER", "shm") // the same on every host, RDMA device or not
	for i, tc := range []struct {
		name, dir, provider, why string
	}{
		{"socket directory", t.TempDir(), "shm", "RDMAGRPC_PROVIDER"},
		{"none", "", "tcp", "not an address of this host"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b, ip := netnsPair(t, i+1)
			env := append(os.Environ(), "RDMAGRPC_SHM_DIR="+tc.dir)
			srv := exec.Command("ip", "netns", "exec", a, os.Args[0], "-test.run=^$")
			srv.Env = append(env, envServer+"=1", envServerAddr+"="+net.JoinHostPort(ip, "0"))
			addr, stop := serverChild(t, srv)
			cli := exec.Command("ip", "netns", "exec", b, os.Args[0], "-test.run=^$")
			cli.Env = append(env, envClient+"="+addr)
			out, err := cli.CombinedOutput()
			if err != nil {
				t.Fatalf("client process: %v\n%s", err, out)
			}
			var got string
			for line := range strings.Lines(string(out)) {
				if p, ok := strings.CutPrefix(line, "PROVIDER "); ok {
					got = strings.TrimSpace(p)
				}
			}
			if !strings.HasPrefix(got, tc.provider+" ") || !strings.Contains(got, tc.why) {
				t.Errorf("client in another namespace: %q, want %s (%s)\n%s", got, tc.provider, tc.why, out)
			}
			stop()
		})
	}
}
