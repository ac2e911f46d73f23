package rxe

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

//go:embed guest/init.sh
var initScript []byte

// formatVersion changes whenever the layout of the built image changes, so
// that old cache entries are not reused.
const formatVersion = "rxe-image-1"

// Image is a built guest: a Debian kernel and a base initramfs with
// busybox, kernel modules and rdma-core. It is immutable and safe for
// concurrent runs.
type Image struct {
	Dir           string   // cache entry holding the files below
	Kernel        string   // vmlinuz
	Initrd        string   // base initramfs (uncompressed newc cpio)
	KernelRelease string   // e.g. 6.1.0-56-amd64
	Packages      []string // name=version of every package the image came from
	Key           string   // cache key: hash of Packages and the harness layout

	// Guest shape, adjustable before the first run.
	MemoryMiB int // per guest; default 2048 (conn.test under the race detector outgrew 1024)
	CPUs      int // per guest; default 2
	// Qemu is the qemu-system-x86_64 binary.
	Qemu string
}

// Option adjusts Build.
type Option func(*buildOpts)

type buildOpts struct {
	log        io.Writer
	installRun bool
}

// WithLog sends progress lines to w.
func WithLog(w io.Writer) Option { return func(o *buildOpts) { o.log = w } }

// WithoutHostInstall stops Build from installing missing host packages.
func WithoutHostInstall() Option { return func(o *buildOpts) { o.installRun = false } }

// DefaultCacheDir is $RDMAGRPC_RXE_CACHE, or rdmagrpc-rxe under the
// system temp dir.
func DefaultCacheDir() string {
	if d := os.Getenv("RDMAGRPC_RXE_CACHE"); d != "" {
		return d
	}
	return filepath.Join(os.TempDir(), "rdmagrpc-rxe")
}

type manifest struct {
	Format        string   `json:"format"`
	KernelRelease string   `json:"kernel_release"`
	Packages      []string `json:"packages"`
	Built         string   `json:"built"`
	Warnings      []string `json:"warnings,omitempty"`
}

// Build returns the guest image for the current Debian package versions,
// building it into cacheDir (DefaultCacheDir when empty) unless a cache
// entry for exactly these versions exists. A cold build downloads the
// packages with apt-get and needs no dpkg lock; a warm one only asks apt
// for the candidate versions.
func Build(ctx context.Context, cacheDir string, opts ...Option) (*Image, error) {
	o := buildOpts{log: io.Discard, installRun: true}
	for _, f := range opts {
		f(&o)
	}
	logf := func(format string, args ...any) { fmt.Fprintf(o.log, "rxe: "+format+"\n", args...) }
	qemu, err := ensureHost(ctx, o.installRun, logf)
	if err != nil {
		return nil, err
	}
	if cacheDir == "" {
		cacheDir = DefaultCacheDir()
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return nil, fmt.Errorf("rxe: cache dir: %w", err)
	}
	unlock, err := lockDir(ctx, cacheDir)
	if err != nil {
		return nil, err
	}
	defer unlock()

	for attempt := 0; ; attempt++ {
		img, stale, err := buildOnce(ctx, cacheDir, qemu, logf)
		if err == nil || !stale || attempt > 2 || os.Geteuid() != 0 {
			return img, err
		}
		// A fresh machine has no package lists; an old one may name
		// versions the mirror no longer has; a download may just fail
		// once (apt retries each file too, aptRetries).
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return nil, err
			case <-time.After(time.Duration(attempt) * 5 * time.Second):
			}
		}
		logf("%v; running apt-get update (attempt %d of 3)", err, attempt+1)
		if uerr := aptUpdate(ctx); uerr != nil {
			return nil, fmt.Errorf("rxe: %w (after: %w)", uerr, err)
		}
	}
}

// buildOnce resolves, then reuses or builds the cache entry. stale reports
// an error that apt-get update may cure.
func buildOnce(ctx context.Context, cacheDir, qemu string, logf func(string, ...any)) (_ *Image, stale bool, _ error) {
	pkgs, err := resolveCached(ctx, cacheDir)
	if err != nil {
		return nil, true, fmt.Errorf("rxe: resolve guest packages: %w", err)
	}
	key := cacheKey(pkgs)
	img := &Image{Dir: filepath.Join(cacheDir, key), Key: key, Qemu: qemu, MemoryMiB: 2048, CPUs: 2}
	img.Kernel = filepath.Join(img.Dir, "vmlinuz")
	img.Initrd = filepath.Join(img.Dir, "base.cpio")
	for _, p := range pkgs {
		img.Packages = append(img.Packages, p.Name+"="+p.Version)
	}
	if m, err := readManifest(img.Dir); err == nil {
		img.KernelRelease = m.KernelRelease
		logf("using cached guest %s (kernel %s)", img.Dir, m.KernelRelease)
		return img, false, nil
	}

	start := time.Now()
	logf("building guest image %s from %d Debian packages", key[:12], len(pkgs))
	tmp, err := os.MkdirTemp(cacheDir, "build-")
	if err != nil {
		return nil, false, fmt.Errorf("rxe: %w", err)
	}
	defer os.RemoveAll(tmp)
	m, err := buildImage(ctx, tmp, pkgs, logf)
	if err != nil {
		var de *downloadError
		return nil, errors.As(err, &de), fmt.Errorf("rxe: build guest: %w", err)
	}
	if err := os.Rename(filepath.Join(tmp, "out"), img.Dir); err != nil {
		return nil, false, fmt.Errorf("rxe: publish cache entry: %w", err)
	}
	pruneCache(cacheDir, key, filepath.Base(tmp), logf)
	img.KernelRelease = m.KernelRelease
	logf("built guest in %v (kernel %s, %d notes in %s)", time.Since(start).Round(time.Millisecond),
		m.KernelRelease, len(m.Warnings), filepath.Join(img.Dir, "manifest.json"))
	return img, false, nil
}

func cacheKey(pkgs []pkgVersion) string {
	h := sha256.New()
	fmt.Fprintln(h, formatVersion)
	h.Write(initScript)
	fmt.Fprintln(h, guestModules, rootPackages, requiredPrograms)
	for _, p := range pkgs {
		fmt.Fprintln(h, p.Name, p.Version)
	}
	return hex.EncodeToString(h.Sum(nil))[:24]
}

func readManifest(dir string) (*manifest, error) {
	b, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	if err != nil {
		return nil, err
	}
	var m manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	if m.Format != formatVersion {
		return nil, fmt.Errorf("cache entry has format %q", m.Format)
	}
	for _, f := range []string{"vmlinuz", "base.cpio"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			return nil, err
		}
	}
	return &m, nil
}

// pruneCache removes entries for other package versions and leftovers of
// interrupted builds (the caller holds the lock, so no other build runs),
// so the cache holds one guest.
func pruneCache(cacheDir, keep, building string, logf func(string, ...any)) {
	ents, err := os.ReadDir(cacheDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if !e.IsDir() || e.Name() == keep || e.Name() == building {
			continue
		}
		if err := os.RemoveAll(filepath.Join(cacheDir, e.Name())); err == nil {
			logf("removed old cache entry %s", e.Name())
		}
	}
}

// lockDir serialises builds in one cache dir across processes.
func lockDir(ctx context.Context, dir string) (func(), error) {
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("rxe: lock cache: %w", err)
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("rxe: lock cache: %w", err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("rxe: waiting for another build in %s: %w", dir, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// buildImage downloads and unpacks the packages under tmp and writes
// tmp/out/{vmlinuz,base.cpio,manifest.json}.
func buildImage(ctx context.Context, tmp string, pkgs []pkgVersion, logf func(string, ...any)) (*manifest, error) {
	debDir := filepath.Join(tmp, "debs")
	root := filepath.Join(tmp, "root")
	out := filepath.Join(tmp, "out")
	for _, d := range []string{debDir, root, out} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	t0 := time.Now()
	debs, err := downloadPackages(ctx, debDir, pkgs)
	if err != nil {
		return nil, err
	}
	logf("downloaded %d packages in %v", len(debs), time.Since(t0).Round(time.Millisecond))
	t0 = time.Now()
	if err := extractDebs(ctx, root, debs); err != nil {
		return nil, err
	}
	logf("unpacked in %v", time.Since(t0).Round(time.Millisecond))

	rel, err := kernelRelease(root)
	if err != nil {
		return nil, err
	}
	if err := copyFile(filepath.Join(out, "vmlinuz"), filepath.Join(root, "boot", "vmlinuz-"+rel)); err != nil {
		return nil, fmt.Errorf("kernel: %w", err)
	}
	modDir := filepath.Join(root, "lib", "modules", rel)
	mods, err := moduleClosure(modDir, guestModules)
	if err != nil {
		return nil, err
	}

	t := guestTree{}
	for _, d := range []string{"bin", "sbin", "usr/bin", "usr/sbin"} {
		if err := t.addDir(root, d, true); err != nil {
			return nil, err
		}
	}
	for _, d := range []string{"lib/" + multiarch, "usr/lib/" + multiarch, "lib64", "usr/lib64",
		"usr/lib/" + multiarch + "/libibverbs", "etc/libibverbs.d"} {
		if err := t.addDir(root, d, false); err != nil {
			return nil, err
		}
	}
	var order []string
	for _, m := range mods {
		t[path.Join("usr/lib/modules", rel, m.rel)] = &entry{host: filepath.Join(modDir, m.rel), perm: 0o644}
		order = append(order, m.rel)
	}
	t[path.Join("usr/lib/modules", rel, "modules.dep")] = &entry{data: modulesDep(mods), perm: 0o644}
	t["etc/rxe/modules"] = &entry{data: []byte(strings.Join(order, "\n") + "\n"), perm: 0o644}
	t["init"] = &entry{data: initScript, perm: 0o755}
	t["etc/passwd"] = &entry{data: []byte("root:x:0:0:root:/root:/bin/sh\n"), perm: 0o644}
	t["etc/group"] = &entry{data: []byte("root:x:0:\n"), perm: 0o644}
	t["etc/hosts"] = &entry{data: []byte("127.0.0.1\tlocalhost\n::1\tlocalhost\n"), perm: 0o644}
	t["usr/bin/sh"] = &entry{link: "busybox"}
	// The kernel opens /dev/console for init before devtmpfs is mounted.
	t["dev/console"] = &entry{dev: [2]uint32{5, 1}, perm: 0o600}
	// The kernel runs /sbin/modprobe for request_module().
	t["usr/sbin/modprobe"] = &entry{link: "../bin/busybox"}
	for _, top := range []string{"bin", "sbin", "lib", "lib64"} {
		t[top] = &entry{link: "usr/" + top, isDir: true}
	}
	warnings, err := t.prune()
	if err != nil {
		return nil, err
	}
	for _, w := range warnings {
		logf("note: %s", w)
	}
	if err := writeTree(filepath.Join(out, "base.cpio"), t); err != nil {
		return nil, err
	}
	m := &manifest{Format: formatVersion, KernelRelease: rel, Built: time.Now().UTC().Format(time.RFC3339), Warnings: warnings}
	for _, p := range pkgs {
		m.Packages = append(m.Packages, p.Name+"="+p.Version)
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(out, "manifest.json"), b, 0o644); err != nil {
		return nil, err
	}
	return m, nil
}

// writeTree writes the guest tree as a newc archive; the top-level /usr
// symlinks go first so that nothing creates those names as directories.
func writeTree(file string, t guestTree) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	defer f.Close()
	c := newCPIO(f)
	names := make([]string, 0, len(t))
	for n := range t {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool {
		ti, tj := !strings.Contains(names[i], "/"), !strings.Contains(names[j], "/")
		if ti != tj {
			return ti
		}
		return names[i] < names[j]
	})
	for _, n := range names {
		e := t[n]
		switch {
		case e.dev != [2]uint32{}:
			err = c.addCharDev(n, e.perm, e.dev[0], e.dev[1])
		case e.link != "":
			err = c.addSymlink(n, e.link)
		case e.data != nil:
			err = c.addBytes(n, e.perm, e.data)
		default:
			err = c.addFile(n, e.host)
		}
		if err != nil {
			return fmt.Errorf("initramfs %s: %w", n, err)
		}
	}
	if err := c.close(); err != nil {
		return err
	}
	return f.Close()
}

func copyFile(dst, src string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
