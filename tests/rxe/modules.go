package rxe

import (
	"bytes"
	"debug/elf"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// guestModules are loaded by the guest's init, in dependency order. The
// Debian kernel builds all of them as modules; a busybox init has no udev
// to load them on demand.
var guestModules = []string{"crc32_generic", "dummy", "e1000", "rdma_rxe", "rdma_ucm", "ib_umad", "ib_uverbs"}

// kmod is one kernel module file with what its .modinfo says it needs.
type kmod struct {
	name    string // with underscores, as the kernel names it
	rel     string // path relative to /lib/modules/<release>
	depends []string
	softPre []string
}

func modName(file string) string {
	return strings.ReplaceAll(strings.TrimSuffix(filepath.Base(file), ".ko"), "-", "_")
}

// readModinfo parses the NUL-separated key=value list in .modinfo.
func readModinfo(path string) (deps, softPre []string, err error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, nil, nil
	}
	data, err := sec.Data()
	if err != nil {
		return nil, nil, err
	}
	for _, kv := range bytes.Split(data, []byte{0}) {
		k, v, ok := strings.Cut(string(kv), "=")
		if !ok {
			continue
		}
		switch k {
		case "depends":
			for d := range strings.SplitSeq(v, ",") {
				if d != "" {
					deps = append(deps, strings.ReplaceAll(d, "-", "_"))
				}
			}
		case "softdep":
			// "pre: a b post: c": only pre: entries must load first.
			pre := false
			for w := range strings.FieldsSeq(v) {
				switch w {
				case "pre:":
					pre = true
				case "post:":
					pre = false
				default:
					if pre {
						softPre = append(softPre, strings.ReplaceAll(w, "-", "_"))
					}
				}
			}
		}
	}
	return deps, softPre, nil
}

// moduleClosure finds the wanted modules under modDir (…/lib/modules/<rel>)
// and returns them with their dependencies, each after what it needs.
func moduleClosure(modDir string, wanted []string) ([]kmod, error) {
	index := map[string]string{}
	err := filepath.WalkDir(filepath.Join(modDir, "kernel"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			rel, _ := filepath.Rel(modDir, p)
			index[modName(p)] = rel
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("index modules: %w", err)
	}
	var order []kmod
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string, optional bool) error
	visit = func(name string, optional bool) error {
		switch state[name] {
		case 1:
			return fmt.Errorf("module dependency cycle at %s", name)
		case 2:
			return nil
		}
		rel, ok := index[name]
		if !ok {
			if optional {
				return nil // a soft dependency may be built in
			}
			return fmt.Errorf("module %s not in %s", name, modDir)
		}
		state[name] = 1
		deps, soft, err := readModinfo(filepath.Join(modDir, rel))
		if err != nil {
			return fmt.Errorf("modinfo %s: %w", rel, err)
		}
		for _, s := range soft {
			if err := visit(s, true); err != nil {
				return err
			}
		}
		for _, d := range deps {
			if err := visit(d, false); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, kmod{name: name, rel: rel, depends: deps, softPre: soft})
		return nil
	}
	for _, w := range wanted {
		if err := visit(w, false); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// modulesDep renders modules.dep in depmod's layout (dependencies listed
// so that loading them last-to-first works) for anyone who runs busybox
// modprobe by hand in the guest.
func modulesDep(mods []kmod) []byte {
	byName := map[string]kmod{}
	pos := map[string]int{}
	for i, m := range mods {
		byName[m.name] = m
		pos[m.name] = i
	}
	var b bytes.Buffer
	for _, m := range mods {
		// Transitive dependencies, latest-loaded first.
		seen := map[string]bool{}
		var all []string
		var walk func(string)
		walk = func(n string) {
			for _, d := range byName[n].depends {
				if !seen[d] {
					seen[d] = true
					all = append(all, d)
					walk(d)
				}
			}
		}
		walk(m.name)
		// Sort by load position, descending.
		for i := 1; i < len(all); i++ {
			for j := i; j > 0 && pos[all[j]] > pos[all[j-1]]; j-- {
				all[j], all[j-1] = all[j-1], all[j]
			}
		}
		fmt.Fprintf(&b, "%s:", m.rel)
		for _, d := range all {
			fmt.Fprintf(&b, " %s", byName[d].rel)
		}
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// kernelRelease returns the single <release> under root/lib/modules.
func kernelRelease(root string) (string, error) {
	ents, err := os.ReadDir(filepath.Join(root, "lib", "modules"))
	if err != nil {
		return "", fmt.Errorf("kernel modules: %w", err)
	}
	var rels []string
	for _, e := range ents {
		if e.IsDir() {
			rels = append(rels, e.Name())
		}
	}
	if len(rels) != 1 {
		return "", fmt.Errorf("expected one kernel release in the image package, found %v", rels)
	}
	return rels[0], nil
}
