package verbs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func TestRegisteredAsVerbs(t *testing.T) {
	p, err := transport.Get("verbs")
	if err != nil {
		t.Fatal(err)
	}
	if p.Name() != "verbs" {
		t.Fatalf("Name() = %q", p.Name())
	}
}

// On a machine without RDMA (the build host) Open must say exactly what
// is missing.
func TestOpenWithoutDeviceIsUnavailable(t *testing.T) {
	if ents, _ := os.ReadDir("/sys/class/infiniband"); len(ents) > 0 {
		t.Skip("this machine has RDMA devices; the no-device error cannot be observed")
	}
	p, _ := transport.Get("verbs")
	d, err := p.Open("")
	if err == nil {
		d.Close()
		t.Fatal("Open succeeded with no RDMA device")
	}
	want := "verbs: no RDMA device (/sys/class/infiniband is empty or missing: no RDMA NIC here and no Soft-RoCE link; " +
		"try `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <ifname>`): transport: provider unavailable"
	if !cgoBuilt {
		want = "verbs: built without cgo (CGO_ENABLED=0): rebuild with cgo and a C compiler to use RDMA: transport: provider unavailable"
	}
	if err.Error() != want {
		t.Fatalf("Open error:\n got %q\nwant %q", err, want)
	}
	if !errors.Is(err, transport.ErrUnavailable) {
		t.Fatalf("Open error %v does not wrap transport.ErrUnavailable", err)
	}
	if got := Devices(); len(got) != 0 {
		t.Fatalf("Devices() = %v, want none", got)
	}
}

// fakeTree points the diagnosis at a temporary /sys and /dev.
func fakeTree(t *testing.T, sysDevs []string, devFiles []string) {
	t.Helper()
	root := t.TempDir()
	oldSys, oldDev := sysfsRoot, devRoot
	t.Cleanup(func() { sysfsRoot, devRoot = oldSys, oldDev })
	sysfsRoot, devRoot = filepath.Join(root, "sys"), filepath.Join(root, "dev")
	for _, d := range sysDevs {
		if err := os.MkdirAll(filepath.Join(sysfsRoot, "class", "infiniband", d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range devFiles {
		p := filepath.Join(devRoot, "infiniband", f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDiagnose(t *testing.T) {
	tests := []struct {
		name     string
		sys, dev []string
		want     string // "" = usable
	}{
		{"no device", nil, nil, "verbs: no RDMA device (SYS/class/infiniband is empty or missing: no RDMA NIC here and no Soft-RoCE link; " +
			"try `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <ifname>`): transport: provider unavailable"},
		{"no uverbs", []string{"rxe0"}, nil,
			"verbs: RDMA device rxe0 present but no DEV/infiniband/uverbs* (kernel module ib_uverbs not loaded): transport: device present but unusable"},
		{"no rdma_cm", []string{"rxe0"}, []string{"uverbs0"},
			"verbs: no rdma_cm: DEV/infiniband/rdma_cm missing (kernel module rdma_ucm not loaded): transport: device present but unusable"},
		{"usable", []string{"rxe0"}, []string{"uverbs0", "rdma_cm"}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fakeTree(t, tc.sys, tc.dev)
			err := diagnose()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("diagnose() = %v, want nil", err)
				}
				return
			}
			want := replaceAll(tc.want, "SYS", sysfsRoot, "DEV", devRoot)
			if err == nil || err.Error() != want {
				t.Fatalf("diagnose():\n got %v\nwant %s", err, want)
			}
			if !errors.Is(err, transport.ErrUnavailable) {
				t.Fatalf("%v does not wrap ErrUnavailable", err)
			}
			// Only the absence of a device may select another provider.
			if got, want := errors.Is(err, transport.ErrUnusable), len(tc.sys) > 0; got != want {
				t.Fatalf("errors.Is(%v, ErrUnusable) = %v, want %v", err, got, want)
			}
		})
	}
}

func TestDiagnosePermission(t *testing.T) {
	if os.Geteuid() == 0 {
		t.Skip("root passes every access check; run as a normal user to see the permission error")
	}
	fakeTree(t, []string{"rxe0"}, []string{"uverbs0", "rdma_cm"})
	if err := os.Chmod(filepath.Join(devRoot, "infiniband", "uverbs0"), 0); err != nil {
		t.Fatal(err)
	}
	err := diagnose()
	want := "verbs: no permission on " + filepath.Join(devRoot, "infiniband", "uverbs0") +
		": permission denied (run as root, or grant the rdma group / a udev rule; containers need the device passed through): transport: device present but unusable"
	if err == nil || err.Error() != want {
		t.Fatalf("diagnose():\n got %v\nwant %s", err, want)
	}
}

func replaceAll(s string, kv ...string) string {
	return strings.NewReplacer(kv...).Replace(s)
}
