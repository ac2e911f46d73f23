package rxe

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// hostTools maps each host command the harness runs to its Debian package.
var hostTools = [][2]string{
	{"qemu-system-x86_64", "qemu-system-x86"},
	{"apt-get", "apt"},
	{"apt-cache", "apt"},
	{"dpkg-deb", "dpkg"},
}

// ensureHost checks the host commands and, as root with install allowed,
// installs the missing packages (after apt-get update). It returns the
// path of qemu-system-x86_64.
func ensureHost(ctx context.Context, install bool, logf func(string, ...any)) (string, error) {
	var missing []string
	seen := map[string]bool{}
	for _, t := range hostTools {
		if _, err := exec.LookPath(t[0]); err != nil && !seen[t[1]] {
			seen[t[1]] = true
			missing = append(missing, t[1])
		}
	}
	if len(missing) > 0 {
		if !install || os.Geteuid() != 0 {
			return "", fmt.Errorf("rxe: missing host packages %s (install them, or run as root to let the harness do it)", strings.Join(missing, " "))
		}
		logf("installing host packages: %s", strings.Join(missing, " "))
		if err := aptUpdate(ctx); err != nil {
			return "", fmt.Errorf("rxe: %w", err)
		}
		args := append([]string{"-o", aptRetries, "install", "-y", "-q", "--no-install-recommends"}, missing...)
		cmd := exec.CommandContext(ctx, "apt-get", args...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("rxe: apt-get install %s: %w: %s", strings.Join(missing, " "), err, lastLines(out, 10))
		}
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		return "", fmt.Errorf("rxe: %w", err)
	}
	return qemu, nil
}

// HostReady reports why runs cannot work here, or nil: not root (rxe
// needs module loading only in the guest, but the build installs packages
// and the test tier is defined as root-only) or qemu missing.
func HostReady() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("rxe: the Soft-RoCE tier runs as root (it may install host packages)")
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		if _, aerr := exec.LookPath("apt-get"); aerr != nil {
			return fmt.Errorf("rxe: qemu-system-x86_64 is missing and apt-get is not available to install it")
		}
	}
	return nil
}
