package rxe

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"
)

// GuestBin is where payload files land by default; it heads the guest PATH.
const GuestBin = "/rxe/bin"

// File is a host file or directory to copy into the guest.
type File struct {
	Host  string // host path
	Guest string // absolute guest path; default GuestBin/<base name of Host>
}

// Files turns host paths into Files placed in GuestBin.
func Files(hostPaths ...string) []File {
	fs := make([]File, len(hostPaths))
	for i, p := range hostPaths {
		fs[i] = File{Host: p}
	}
	return fs
}

// Payload is what runs in one guest once rxe0 is ready. The command runs
// in /rxe/work with stdin from /dev/null, stdout and stderr merged.
// The guest environment also holds RXE_DEV (rxe0), RXE_GID_INDEX (1),
// RXE_NETDEV, RXE_ADDR (this guest's IPv4) and RXE_PEER (the other
// guest's IPv4, or this guest's own in a single-guest run).
type Payload struct {
	Files []File
	Args  []string // argv; Args[0] is looked up in PATH (GuestBin first)
	Env   []string // KEY=VALUE, exported before Args run
	// Stream, when set, receives the payload output as it arrives, line
	// by line, in addition to Result.Output.
	Stream io.Writer
}

// Result is the outcome of one guest run.
type Result struct {
	Output   []byte        // what the payload wrote (stdout and stderr)
	ExitCode int           // the payload's exit status (128+N when killed by signal N)
	Duration time.Duration // qemu start to exit: everything a caller waits for
	Boot     time.Duration // qemu start to rxe0 ready
	Run      time.Duration // rxe0 ready to the payload's exit (seen from the host)
	Console  string        // kernel console (ttyS0), for diagnosing a failed run
}

// netConfig is the per-guest network set-up written into run.env.
type netConfig struct {
	netdev, addr, peer, role string
}

func shQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func newNonce() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b) // crypto/rand.Read never fails on Linux
	return hex.EncodeToString(b)
}

// writeRunArchive writes the per-run cpio (appended to the base initramfs):
// the payload files, /rxe/run.env and /rxe/payload.sh.
func writeRunArchive(w io.Writer, p Payload, nc netConfig, nonce string) error {
	if len(p.Args) == 0 {
		return fmt.Errorf("rxe: payload has no command")
	}
	c := newCPIO(w)
	for _, f := range p.Files {
		g := f.Guest
		if g == "" {
			g = path.Join(GuestBin, filepath.Base(f.Host))
		}
		if !path.IsAbs(g) {
			return fmt.Errorf("rxe: guest path %q is not absolute", g)
		}
		// /bin, /lib… are symlinks into /usr in the base archive; naming
		// them as directories here would make the unpacker replace them.
		g = "/" + usrMerged(strings.TrimPrefix(path.Clean(g), "/"))
		st, err := os.Stat(f.Host)
		if err != nil {
			return fmt.Errorf("rxe: payload file: %w", err)
		}
		if st.IsDir() {
			err = c.addTree(g, f.Host)
		} else {
			err = c.addFile(g, f.Host)
		}
		if err != nil {
			return fmt.Errorf("rxe: payload file %s: %w", f.Host, err)
		}
	}
	var env strings.Builder
	fmt.Fprintf(&env, "RXE_NONCE=%s\n", nonce)
	for _, kv := range [][2]string{
		{"RXE_DEV", "rxe0"}, {"RXE_GID_INDEX", "1"}, {"RXE_NETDEV", nc.netdev},
		{"RXE_ADDR", nc.addr}, {"RXE_PEER", nc.peer}, {"RXE_ROLE", nc.role},
	} {
		fmt.Fprintf(&env, "export %s=%s\n", kv[0], shQuote(kv[1]))
	}
	for _, kv := range p.Env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.ContainsAny(k, " \t\n'\"$;=") {
			return fmt.Errorf("rxe: bad environment entry %q", kv)
		}
		fmt.Fprintf(&env, "export %s=%s\n", k, shQuote(v))
	}
	if err := c.addBytes("rxe/run.env", 0o644, []byte(env.String())); err != nil {
		return err
	}
	q := make([]string, len(p.Args))
	for i, a := range p.Args {
		q[i] = shQuote(a)
	}
	script := "exec " + strings.Join(q, " ") + "\n"
	if err := c.addBytes("rxe/payload.sh", 0o755, []byte(script)); err != nil {
		return err
	}
	return c.close()
}
