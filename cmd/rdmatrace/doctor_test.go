package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/transport"
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

// No RDMA device is a note, not a problem: shm and TCP work without one.
func TestDoctorNoDevice(t *testing.T) {
	var out strings.Builder
	r := &report{w: &out}
	r.devices(verbs.Sysfs(t.TempDir()), "")
	if !strings.Contains(out.String(), "none") || len(r.problems) != 0 || len(r.notes) != 1 || !strings.Contains(r.notes[0], "rdma link add") {
		t.Errorf("no device: output %q, problems %q, notes %q", out.String(), r.problems, r.notes)
	}
}

// Device findings are notes where the service runs on shm anyway.
func TestDoctorProblemsNotesOnShm(t *testing.T) {
	root := t.TempDir()
	fakePort(t, root, "mlx5_0", "1: DOWN", "Ethernet", "ens1", 1500, map[string][2]string{
		"0": {"0000:0000:0000:0000:0000:ffff:c0a8:0001", "RoCE v2"},
	})
	var out strings.Builder
	r := &report{w: &out, provider: "shm"}
	r.devices(verbs.Sysfs(root), root)
	if len(r.problems) != 0 || len(r.notes) != 1 || !strings.Contains(r.notes[0], "not ACTIVE") || !strings.Contains(r.notes[0], "the provider is shm") {
		t.Errorf("a port down where shm is used: problems %q, notes %q", r.problems, r.notes)
	}
}

// The whole command on a host without an RDMA device, where shm is what a
// service uses: every section is printed, no RDMA device is a note, and
// the exit status is 0 (a readiness check passes).
func TestDoctorCommand(t *testing.T) {
	for _, provider := range []string{"shm", "Shm", ""} {
		t.Run("RDMAGRPC_PROVIDER="+provider, func(t *testing.T) {
			t.Setenv("RDMAGRPC_PROVIDER", provider)
			if name, _, err := conn.ProviderChoice(); provider == "" && (err != nil || name != "shm") {
				t.Skipf("a service here would not use shm: %q, %v", name, err)
			}
			var out, errs strings.Builder
			code := runDoctor([]string{"--sysfs", t.TempDir()}, &out, &errs)
			for _, want := range []string{"RDMA devices", "memlock (ulimit -l)", "providers (in conn's order of choice):", "shm    device",
				"settings (RDMAGRPC_*", "provider a service here would use: shm", "notes (", "no RDMA device:", "no problem found"} {
				if !strings.Contains(out.String(), want) {
					t.Errorf("output lacks %q:\n%s", want, out.String())
				}
			}
			if code != 0 {
				t.Errorf("exit status %d with no RDMA device and shm, want 0:\n%s", code, out.String())
			}
		})
	}
}

// A provider that cannot be had fails the check, with the reason: a bad
// value, and a provider named that is not here.
func TestDoctorBadProvider(t *testing.T) {
	t.Setenv("RDMAGRPC_PROVIDER", "bogus")
	t.Setenv("RDMAGRPC_PROVDER", "shm")
	var out, errs strings.Builder
	code := runDoctor([]string{"--sysfs", t.TempDir()}, &out, &errs)
	for _, want := range []string{
		`RDMAGRPC_PROVIDER=bogus  BAD: RDMAGRPC_PROVIDER="bogus": want verbs or shm`,
		"provider a service here would use: none",
		"problems (1):",
		"did you mean RDMAGRPC_PROVIDER?",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if code != 1 {
		t.Errorf("exit status %d with RDMAGRPC_PROVIDER=bogus, want 1", code)
	}
	if _, err := transport.Get("verbs"); err != nil {
		t.Skip("verbs not in this binary")
	}
	if _, _, err := conn.ProviderChoice(); err == nil {
		t.Skip("verbs is usable here")
	}
	t.Setenv("RDMAGRPC_PROVIDER", "VERBS")
	out.Reset()
	code = runDoctor([]string{"--sysfs", t.TempDir()}, &out, &errs)
	if code != 1 || !strings.Contains(out.String(), "problems (1):\n  - Listen and Dial fail here: ") {
		t.Errorf("RDMAGRPC_PROVIDER=VERBS without a usable device: exit %d\n%s", code, out.String())
	}
}

// --json prints one object that parses back, and says what the report
// says.
func TestDoctorJSON(t *testing.T) {
	root := t.TempDir()
	fakePort(t, root, "rxe0", "4: ACTIVE", "Ethernet", "eth0", 1500, map[string][2]string{
		"1": {"0000:0000:0000:0000:0000:ffff:0a00:020f", "RoCE v2"},
	})
	t.Setenv("RDMAGRPC_PROVIDER", "shm")
	t.Setenv("RDMAGRPC_VERBS_TC", "abc")
	var out, errs strings.Builder
	code := runDoctor([]string{"--json", "--sysfs", root}, &out, &errs)
	var j jsonDoctor
	if err := json.Unmarshal([]byte(out.String()), &j); err != nil {
		t.Fatalf("%v:\n%s", err, out.String())
	}
	if code != 1 || j.OK || j.Type != "doctor" || len(j.Problems) != 1 || !strings.Contains(j.Problems[0], `RDMAGRPC_VERBS_TC="abc"`) {
		t.Errorf("exit %d, %+v", code, j)
	}
	if !strings.Contains(j.Provider.Error, "bad setting") || j.Provider.Name != "" {
		t.Errorf("provider: %+v", j.Provider)
	}
	var tc *jsonSetting
	for i := range j.Settings {
		if j.Settings[i].Name == "RDMAGRPC_VERBS_TC" {
			tc = &j.Settings[i]
		}
	}
	if tc == nil || !tc.Set || tc.Value != "abc" || tc.Severity != "error" || tc.Kind != "library" || tc.Meaning == "" {
		t.Errorf("RDMAGRPC_VERBS_TC: %+v", tc)
	}
	if len(j.Devices) != 1 || j.Devices[0].Name != "rxe0" || j.Devices[0].Ports[0].GIDs[0].Addr != "10.0.2.15" {
		t.Errorf("devices: %+v", j.Devices)
	}

	t.Setenv("RDMAGRPC_VERBS_TC", "")
	out.Reset()
	code = runDoctor([]string{"--json", "--sysfs", t.TempDir()}, &out, &errs)
	j = jsonDoctor{}
	if err := json.Unmarshal([]byte(out.String()), &j); err != nil {
		t.Fatalf("%v:\n%s", err, out.String())
	}
	if code != 0 || !j.OK || j.Provider.Name != "shm" || j.Provider.Reason != "RDMAGRPC_PROVIDER" || len(j.Problems) != 0 || len(j.Notes) == 0 || j.Devices == nil {
		t.Errorf("shm on a host without a device: exit %d, %+v", code, j)
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
