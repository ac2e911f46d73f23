package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

// fakePort writes one device with one port into a sysfs tree at root, as
// the kernel lays it out (rxe's entries).
func fakePort(t *testing.T, root, dev, state, linkLayer, netdev string, mtu int, gids map[string][2]string) {
	t.Helper()
	write := func(path, s string) {
		t.Helper()
		p := filepath.Join(root, path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	d := filepath.Join("class", "infiniband", dev)
	write(filepath.Join(d, "node_type"), "1: CA")
	write(filepath.Join(d, "fw_ver"), "0.0.0")
	pd := filepath.Join(d, "ports", "1")
	write(filepath.Join(pd, "state"), state)
	write(filepath.Join(pd, "phys_state"), "5: LinkUp")
	write(filepath.Join(pd, "link_layer"), linkLayer)
	write(filepath.Join(pd, "rate"), "10 Gb/sec (1X QDR)")
	write(filepath.Join(pd, "gids", "5"), "0000:0000:0000:0000:0000:0000:0000:0000") // an empty entry
	for idx, g := range gids {
		write(filepath.Join(pd, "gids", idx), g[0])
		write(filepath.Join(pd, "gid_attrs", "types", idx), g[1])
		write(filepath.Join(pd, "gid_attrs", "ndevs", idx), netdev)
	}
	write(filepath.Join("class", "net", netdev, "mtu"), strconv.Itoa(mtu))
}

func doctorDevices(t *testing.T, root string) (string, []string) {
	t.Helper()
	var out strings.Builder
	r := &report{w: &out}
	r.devices(verbs.Sysfs(root), root)
	return out.String(), r.problems
}

// A healthy RoCE port: GIDs listed with their RoCE version and device,
// IPv4-mapped ones shown as IPv4, the path MTU the device allows, and no
// problem.
func TestDoctorHealthyPort(t *testing.T) {
	root := t.TempDir()
	fakePort(t, root, "rxe0", "4: ACTIVE", "Ethernet", "eth0", 1500, map[string][2]string{
		"0": {"fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2"},
		"1": {"0000:0000:0000:0000:0000:ffff:0a00:020f", "RoCE v2"},
		"2": {"0000:0000:0000:0000:0000:ffff:0a00:020f", "IB/RoCE v1"},
	})
	out, problems := doctorDevices(t, root)
	for _, want := range []string{
		"rxe0  node type 1: CA",
		"port 1  4: ACTIVE  5: LinkUp  link layer Ethernet",
		"network device eth0  MTU 1500  (RoCE path MTU up to 1024)",
		"GID 0   fe80::5054:ff:fe12:3456",
		"GID 1   10.0.2.15                                RoCE v2",
		"GID 2   10.0.2.15                                IB/RoCE v1",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "GID 5") {
		t.Errorf("the empty GID entry is listed:\n%s", out)
	}
	if len(problems) != 0 {
		t.Errorf("problems on a healthy port: %q", problems)
	}
}

// The mistakes of the field, each named with its fix: a port that is not
// ACTIVE, no RoCE v2 GID for IPv4 (only v1), an MTU too small for RoCE.
func TestDoctorFindsProblems(t *testing.T) {
	root := t.TempDir()
	fakePort(t, root, "mlx5_0", "1: DOWN", "Ethernet", "ens1", 576, map[string][2]string{
		"0": {"0000:0000:0000:0000:0000:ffff:c0a8:0001", "IB/RoCE v1"},
	})
	_, problems := doctorDevices(t, root)
	all := strings.Join(problems, "\n")
	for _, want := range []string{
		"mlx5_0 port 1 is 1: DOWN, not ACTIVE",
		"mlx5_0 port 1 has no RoCE v2 GID for an IPv4 address",
		"ens1 has MTU 576, too small",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("problems lack %q:\n%s", want, all)
		}
	}
	if len(problems) != 3 {
		t.Errorf("%d problems, want 3:\n%s", len(problems), all)
	}
}

func TestDoctorNoDevice(t *testing.T) {
	out, problems := doctorDevices(t, t.TempDir())
	if !strings.Contains(out, "none") || len(problems) != 1 || !strings.Contains(problems[0], "rdma link add") {
		t.Errorf("no device: output %q, problems %q", out, problems)
	}
}

// The whole command on this machine: every section is printed and the
// exit status says whether a problem was found.
func TestDoctorCommand(t *testing.T) {
	var out, errs strings.Builder
	code := runDoctor([]string{"--sysfs", t.TempDir()}, &out, &errs)
	for _, want := range []string{"RDMA devices", "memlock (ulimit -l)", "providers (in conn's order of choice):", "shm    device", "settings:", "problems ("} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if code != 1 {
		t.Errorf("exit status %d with no RDMA device, want 1", code)
	}
}

// --connect dials an rdmagrpc listener without fall-back and says what
// the connection runs on, --loopback one of its own; a dial to nothing is
// a problem, named.
func TestDoctorConnect(t *testing.T) {
	l, err := conn.Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	var out, errs strings.Builder
	runDoctor([]string{"--sysfs", t.TempDir(), "--connect", l.Addr().String()}, &out, &errs)
	if !strings.Contains(out.String(), "connected in") || !strings.Contains(out.String(), "over shm") {
		t.Errorf("--connect to an rdmagrpc listener:\n%s", out.String())
	}
	out.Reset()
	runDoctor([]string{"--sysfs", t.TempDir(), "--loopback"}, &out, &errs)
	if !strings.Contains(out.String(), "loopback, listening on 127.0.0.1:") || !strings.Contains(out.String(), "over shm") {
		t.Errorf("--loopback without an RDMA device:\n%s", out.String())
	}
	addr := l.Addr().String()
	l.Close()
	out.Reset()
	runDoctor([]string{"--sysfs", t.TempDir(), "--connect", addr, "--timeout", "2s"}, &out, &errs)
	if !strings.Contains(out.String(), "dial "+addr+" failed") {
		t.Errorf("--connect to nothing:\n%s", out.String())
	}
}
