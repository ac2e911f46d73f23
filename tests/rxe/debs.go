package rxe

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// rootPackages are what the guest is made of. Their shared-library
// dependencies are added by resolvePackages; only files actually reached
// from the binaries we ship end up in the initramfs.
var rootPackages = []string{
	"linux-image-amd64", // metapackage: resolves to the versioned image
	"busybox-static",
	"libibverbs1",
	"librdmacm1",
	"ibverbs-providers",
	"ibverbs-utils",
	"rdmacm-utils",
	"perftest",
	"iproute2", // the rdma(8) tool that creates rxe0
	"libgcc-s1",
}

// pkgVersion is one resolved Debian package.
type pkgVersion struct {
	Name    string `json:"name"`
	Version string `json:"version"`
}

// followDep says whether a dependency is worth downloading: shared
// libraries live in lib* packages (plus zlib1g); everything else a Debian
// package depends on (debconf, adduser, udev, initramfs-tools…) is for
// a full system, not for a busybox initramfs.
func followDep(name string) bool {
	return strings.HasPrefix(name, "lib") || name == "zlib1g" || strings.HasPrefix(name, "linux-image-")
}

func aptCmd(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.Env = append(os.Environ(), "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive")
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// resolvePackages walks Depends/Pre-Depends from rootPackages, keeping
// only library packages, and returns the closure with candidate versions.
func resolvePackages(ctx context.Context) ([]pkgVersion, error) {
	seen := map[string]bool{}
	frontier := append([]string(nil), rootPackages...)
	for _, p := range frontier {
		seen[p] = true
	}
	for len(frontier) > 0 {
		args := append([]string{"depends", "--no-recommends", "--no-suggests", "--no-conflicts",
			"--no-breaks", "--no-replaces", "--no-enhances"}, frontier...)
		out, err := aptCmd(ctx, "apt-cache", args...)
		if err != nil {
			return nil, err
		}
		frontier = nil
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			line := strings.TrimSpace(sc.Text())
			line = strings.TrimPrefix(line, "|")
			var dep string
			switch {
			case strings.HasPrefix(line, "Depends: "):
				dep = strings.TrimPrefix(line, "Depends: ")
			case strings.HasPrefix(line, "PreDepends: "):
				dep = strings.TrimPrefix(line, "PreDepends: ")
			default:
				continue
			}
			// <virtual> packages have no archive of their own.
			if strings.HasPrefix(dep, "<") || seen[dep] || !followDep(dep) {
				continue
			}
			seen[dep] = true
			frontier = append(frontier, dep)
		}
	}
	names := make([]string, 0, len(seen))
	for n := range seen {
		names = append(names, n)
	}
	sort.Strings(names)
	return candidateVersions(ctx, names)
}

// candidateVersions asks apt which version `apt-get download` would fetch.
func candidateVersions(ctx context.Context, names []string) ([]pkgVersion, error) {
	out, err := aptCmd(ctx, "apt-cache", append([]string{"policy"}, names...)...)
	if err != nil {
		return nil, err
	}
	var res []pkgVersion
	cur := ""
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, " ") && strings.HasSuffix(line, ":") {
			cur = strings.TrimSuffix(line, ":")
			continue
		}
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "Candidate: "); ok && cur != "" {
			if v == "(none)" {
				return nil, fmt.Errorf("apt has no candidate for %s (apt-get update needed?)", cur)
			}
			res = append(res, pkgVersion{cur, v})
			cur = ""
		}
	}
	if len(res) != len(names) {
		return nil, fmt.Errorf("apt-cache policy resolved %d of %d packages (apt-get update needed?)", len(res), len(names))
	}
	return res, nil
}

// downloadPackages fetches the exact versions into dir. apt-get download
// needs no dpkg lock; the sandbox option avoids the _apt user, which cannot
// write into a root-owned temp dir.
func downloadPackages(ctx context.Context, dir string, pkgs []pkgVersion) ([]string, error) {
	args := []string{"-q", "-o", "APT::Sandbox::User=root", "-o", aptRetries, "download"}
	for _, p := range pkgs {
		args = append(args, p.Name+"="+p.Version)
	}
	cmd := exec.CommandContext(ctx, "apt-get", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, &downloadError{fmt.Errorf("apt-get download: %w: %s", err, lastLines(out, 10))}
	}
	debs, err := filepath.Glob(filepath.Join(dir, "*.deb"))
	if err != nil {
		return nil, err
	}
	if len(debs) != len(pkgs) {
		return nil, fmt.Errorf("apt-get download: got %d archives for %d packages", len(debs), len(pkgs))
	}
	return debs, nil
}

// extractDebs unpacks every archive into root.
func extractDebs(ctx context.Context, root string, debs []string) error {
	for _, d := range debs {
		cmd := exec.CommandContext(ctx, "dpkg-deb", "-x", d, root)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("dpkg-deb -x %s: %w: %s", filepath.Base(d), err, lastLines(out, 5))
		}
	}
	return nil
}

// aptRetries makes apt retry a failed download itself (a mirror hiccup
// once failed a CI run's first apt-get).
const aptRetries = "Acquire::Retries=3"

// aptUpdate refreshes the package lists; needed on a fresh machine whose
// lists are absent or stale.
func aptUpdate(ctx context.Context) error {
	_, err := aptCmd(ctx, "apt-get", "-o", aptRetries, "update", "-qq")
	return err
}

func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// downloadError marks a failed download, which apt-get update may cure.
type downloadError struct{ err error }

func (e *downloadError) Error() string { return e.err.Error() }
func (e *downloadError) Unwrap() error { return e.err }
