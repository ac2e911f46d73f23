package rxe

import (
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// requiredPrograms must be present and loadable in the guest or the build
// fails; every other program from the packages is kept only if its shared
// libraries resolve.
var requiredPrograms = []string{
	"busybox", "ip", "rdma", "ibv_devices", "ibv_devinfo", "ibv_rc_pingpong",
	"rping", "ib_write_lat",
}

const multiarch = "x86_64-linux-gnu"

// entry is one file of the guest tree.
type entry struct {
	host   string    // copy from this host file, or
	data   []byte    // write this content, or
	link   string    // make a symlink to this target, or
	dev    [2]uint32 // make a character device (major, minor) when set
	perm   fs.FileMode
	isProg bool
	isDir  bool // a symlink standing for a directory: not checked as a file
}

// guestTree maps a guest path (no leading slash, merged-/usr layout) to
// its content.
type guestTree map[string]*entry

// usrMerged maps a Debian package path onto the merged-/usr layout the
// guest uses (/bin, /sbin, /lib, /lib64 are symlinks into /usr).
func usrMerged(p string) string {
	for _, top := range []string{"bin", "sbin", "lib", "lib64"} {
		if p == top || strings.HasPrefix(p, top+"/") {
			return "usr/" + p
		}
	}
	return p
}

// addDir copies the direct children of root/dir (files and symlinks, not
// subdirectories) into the tree.
func (t guestTree) addDir(root, dir string, prog bool) error {
	ents, err := os.ReadDir(filepath.Join(root, dir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range ents {
		hp := filepath.Join(root, dir, e.Name())
		gp := usrMerged(path.Join(dir, e.Name()))
		if _, dup := t[gp]; dup {
			continue
		}
		switch {
		case e.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(hp)
			if err != nil {
				return err
			}
			t[gp] = &entry{link: target, isProg: prog}
		case e.Type().IsRegular():
			st, err := e.Info()
			if err != nil {
				return err
			}
			t[gp] = &entry{host: hp, perm: st.Mode().Perm(), isProg: prog}
		}
	}
	return nil
}

// resolve follows symlinks inside the guest tree to a regular file entry.
func (t guestTree) resolve(gp string) (string, *entry) {
	for range 16 {
		e, ok := t[gp]
		if !ok {
			// A parent may be one of the top-level /usr symlinks.
			gp2 := usrMerged(gp)
			if e, ok = t[gp2]; !ok {
				return gp, nil
			}
			gp = gp2
		}
		if e.link == "" {
			return gp, e
		}
		if path.IsAbs(e.link) {
			gp = usrMerged(strings.TrimPrefix(path.Clean(e.link), "/"))
		} else {
			gp = usrMerged(path.Clean(path.Join(path.Dir(gp), e.link)))
		}
	}
	return gp, nil
}

var libDirs = []string{"usr/lib/" + multiarch, "usr/lib64", "usr/lib"}

// neededLibs returns the DT_NEEDED sonames of an ELF file and whether it
// is ELF at all.
func neededLibs(hostPath string) ([]string, bool, error) {
	magic := make([]byte, 4)
	fh, err := os.Open(hostPath)
	if err != nil {
		return nil, false, err
	}
	n, _ := fh.Read(magic)
	fh.Close()
	if n < 4 || string(magic) != elf.ELFMAG {
		return nil, false, nil // a script or data file
	}
	f, err := elf.Open(hostPath)
	if err != nil {
		return nil, true, err
	}
	defer f.Close()
	libs, err := f.ImportedLibraries()
	if err != nil {
		return nil, true, err
	}
	return libs, true, nil
}

// prune drops programs whose libraries do not resolve inside the tree, and
// fails if a required program is missing or broken. It returns warnings.
func (t guestTree) prune() ([]string, error) {
	var warn []string
	missing := func(gp string) ([]string, error) {
		_, e := t.resolve(gp)
		if e == nil {
			return nil, fmt.Errorf("%s: dangling symlink", gp)
		}
		if e.host == "" {
			return nil, nil
		}
		libs, isELF, err := neededLibs(e.host)
		if err != nil || !isELF {
			return nil, err
		}
		var miss []string
		for _, l := range libs {
			found := false
			for _, d := range libDirs {
				if _, le := t.resolve(path.Join(d, l)); le != nil {
					found = true
					break
				}
			}
			if !found {
				miss = append(miss, l)
			}
		}
		return miss, nil
	}
	names := make([]string, 0, len(t))
	for gp := range t {
		names = append(names, gp)
	}
	sort.Strings(names)
	progs := map[string]bool{}
	for _, gp := range names {
		e := t[gp]
		if e.isDir {
			continue
		}
		miss, err := missing(gp)
		if err == nil && len(miss) > 0 {
			err = fmt.Errorf("missing %s", strings.Join(miss, ", "))
		}
		if err != nil {
			if e.isProg {
				delete(t, gp)
				warn = append(warn, fmt.Sprintf("dropped %s: %v", gp, err))
				continue
			}
			warn = append(warn, fmt.Sprintf("library %s: %v", gp, err))
		}
		if e.isProg {
			progs[path.Base(gp)] = true
		}
	}
	for _, r := range requiredPrograms {
		if !progs[r] {
			return warn, fmt.Errorf("required program %s is missing or cannot load its libraries (%s)", r, strings.Join(warn, "; "))
		}
	}
	return warn, nil
}
