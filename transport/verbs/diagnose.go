package verbs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Where the kernel exposes RDMA devices. Variables so that tests can
// point them at a fake tree.
var (
	sysfsRoot = "/sys"
	devRoot   = "/dev"
)

// unavailable builds the error Open returns when verbs cannot work here.
func unavailable(format string, args ...any) error {
	return fmt.Errorf("verbs: %s: %w", fmt.Sprintf(format, args...), transport.ErrUnavailable)
}

// unusable builds the error Open returns when a device is here but cannot
// be used: the caller must not silently pick another provider.
func unusable(format string, args ...any) error {
	return fmt.Errorf("verbs: %s: %w", fmt.Sprintf(format, args...), transport.ErrUnusable)
}

// badSetting is an RDMAGRPC_VERBS_* setting's error (settings): an
// ErrUnusable too, as a device that was configured must not be passed
// over for shm.
func badSetting(err error) error {
	return fmt.Errorf("verbs: %w: %w", err, transport.ErrUnusable)
}

// diagnose checks, before libibverbs is even loaded, that the kernel side
// of RDMA is present and usable, and names the first missing piece. The
// libraries come next (load): a node with no RDMA device is told so, not
// that rdma-core is missing, which it then does not need.
func diagnose() error {
	ibDir := filepath.Join(sysfsRoot, "class", "infiniband")
	devs, err := os.ReadDir(ibDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return unavailable("cannot list RDMA devices in %s: %v", ibDir, err)
	}
	if len(devs) == 0 {
		return unavailable("no RDMA device (%s is empty or missing: no RDMA NIC here and no Soft-RoCE link; "+
			"try `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <ifname>`)", ibDir)
	}
	uverbs, _ := filepath.Glob(filepath.Join(devRoot, "infiniband", "uverbs*"))
	if len(uverbs) == 0 {
		return unusable("RDMA device %s present but no %s (kernel module ib_uverbs not loaded)",
			devs[0].Name(), filepath.Join(devRoot, "infiniband", "uverbs*"))
	}
	slices.Sort(uverbs)
	if err := unix.Access(uverbs[0], unix.R_OK|unix.W_OK); err != nil {
		return unusable("no permission on %s: %v (run as root, or grant the rdma group / a udev rule; "+
			"containers need the device passed through)", uverbs[0], err)
	}
	cm := filepath.Join(devRoot, "infiniband", "rdma_cm")
	if _, err := os.Stat(cm); err != nil {
		return unusable("no rdma_cm: %s missing (kernel module rdma_ucm not loaded)", cm)
	}
	if err := unix.Access(cm, unix.R_OK|unix.W_OK); err != nil {
		return unusable("no permission on %s: %v", cm, err)
	}
	return nil
}

// deviceNames lists the RDMA devices the kernel knows, for messages.
func deviceNames() []string {
	devs, _ := os.ReadDir(filepath.Join(sysfsRoot, "class", "infiniband"))
	names := make([]string, 0, len(devs))
	for _, d := range devs {
		names = append(names, d.Name())
	}
	return names
}
