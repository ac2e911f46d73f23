package bpf

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// LibibverbsName is the shared object every verbs program loads.
const LibibverbsName = "libibverbs.so.1"

// FindLibibverbs returns the path of libibverbs.so.1. With pid > 0 it is
// the copy that process has mapped (through /proc/pid/root, so a process in
// a container is traced through its own file); otherwise the one the
// dynamic linker would load.
func FindLibibverbs(pid int) (string, error) {
	if pid > 0 {
		return mappedLibrary(pid, LibibverbsName)
	}
	if p := ldconfigPath(LibibverbsName); p != "" {
		return p, nil
	}
	for _, dir := range []string{"/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64", "/usr/local/lib", "/usr/lib"} {
		p := filepath.Join(dir, LibibverbsName)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("bpf: %s not found (install libibverbs1, or pass its path)", LibibverbsName)
}

func mappedLibrary(pid int, name string) (string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return "", fmt.Errorf("bpf: pid %d: %w", pid, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 {
			continue
		}
		path := fields[5]
		if filepath.Base(path) == name || strings.HasPrefix(filepath.Base(path), name+".") {
			return fmt.Sprintf("/proc/%d/root%s", pid, path), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("bpf: read /proc/%d/maps: %w", pid, err)
	}
	return "", fmt.Errorf("bpf: pid %d has not loaded %s: %w", pid, name, errNotMapped)
}

var errNotMapped = errors.New("library not mapped")

// ldconfigPath asks the dynamic linker cache, as the loader would.
func ldconfigPath(name string) string {
	out, err := exec.Command("ldconfig", "-p").Output()
	if err != nil {
		return ""
	}
	for line := range strings.Lines(string(out)) {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, name+" ") || !strings.Contains(line, "x86-64") {
			continue
		}
		if i := strings.Index(line, "=> "); i >= 0 {
			return strings.TrimSpace(line[i+3:])
		}
	}
	return ""
}
