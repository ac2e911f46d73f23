package rxe

import (
	"bufio"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"
)

// cpioWriter writes the "newc" (SVR4, no CRC) format, the only one the
// kernel's initramfs unpacker reads. Writing it here rather than calling
// cpio(1) keeps the per-run archive cheap and the host dependency list short.
type cpioWriter struct {
	w    *bufio.Writer
	off  int64
	ino  uint32
	dirs map[string]bool
}

func newCPIO(w io.Writer) *cpioWriter {
	return &cpioWriter{w: bufio.NewWriterSize(w, 1<<20), ino: 1, dirs: map[string]bool{"": true, ".": true, "/": true}}
}

func (c *cpioWriter) pad4() error {
	if n := (4 - c.off%4) % 4; n > 0 {
		if _, err := c.w.Write(make([]byte, n)); err != nil {
			return err
		}
		c.off += n
	}
	return nil
}

func (c *cpioWriter) header(name string, mode uint32, size int64) error {
	return c.headerDev(name, mode, size, 0, 0)
}

func (c *cpioWriter) headerDev(name string, mode uint32, size int64, rmajor, rminor uint32) error {
	c.ino++
	nlink := 1
	if mode&0o170000 == 0o040000 {
		nlink = 2
	}
	h := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, nlink, 0, size, 0, 0, rmajor, rminor, len(name)+1, 0)
	if _, err := io.WriteString(c.w, h); err != nil {
		return err
	}
	if _, err := io.WriteString(c.w, name+"\x00"); err != nil {
		return err
	}
	c.off += int64(len(h) + len(name) + 1)
	return c.pad4()
}

// mkdirAll emits directory entries for every missing parent of name, so
// the archive never relies on the unpacker creating them.
func (c *cpioWriter) mkdirAll(dir string) error {
	dir = strings.Trim(path.Clean(dir), "/")
	if c.dirs[dir] {
		return nil
	}
	if err := c.mkdirAll(path.Dir(dir)); err != nil {
		return err
	}
	c.dirs[dir] = true
	return c.header(dir, 0o040755, 0)
}

// addBytes adds a regular file with the given content and permission bits.
func (c *cpioWriter) addBytes(name string, perm fs.FileMode, data []byte) error {
	name = strings.Trim(path.Clean(name), "/")
	if err := c.mkdirAll(path.Dir(name)); err != nil {
		return err
	}
	if err := c.header(name, 0o100000|uint32(perm.Perm()), int64(len(data))); err != nil {
		return err
	}
	if _, err := c.w.Write(data); err != nil {
		return err
	}
	c.off += int64(len(data))
	return c.pad4()
}

// addFile copies a host file into the archive, keeping its permission bits.
func (c *cpioWriter) addFile(name, hostPath string) error {
	f, err := os.Open(hostPath)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("cpio: %s is not a regular file", hostPath)
	}
	name = strings.Trim(path.Clean(name), "/")
	if err := c.mkdirAll(path.Dir(name)); err != nil {
		return err
	}
	if err := c.header(name, 0o100000|uint32(st.Mode().Perm()), st.Size()); err != nil {
		return err
	}
	n, err := io.Copy(c.w, f)
	if err != nil {
		return fmt.Errorf("cpio: copy %s: %w", hostPath, err)
	}
	if n != st.Size() {
		return fmt.Errorf("cpio: %s changed size while copying", hostPath)
	}
	c.off += n
	return c.pad4()
}

// addTree copies a host directory recursively under name.
func (c *cpioWriter) addTree(name, hostDir string) error {
	var files []string
	err := fs.WalkDir(os.DirFS(hostDir), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("cpio: walk %s: %w", hostDir, err)
	}
	sort.Strings(files)
	for _, p := range files {
		if err := c.addFile(path.Join(name, p), path.Join(hostDir, p)); err != nil {
			return err
		}
	}
	return nil
}

// addSymlink adds a symbolic link name -> target.
func (c *cpioWriter) addSymlink(name, target string) error {
	name = strings.Trim(path.Clean(name), "/")
	if err := c.mkdirAll(path.Dir(name)); err != nil {
		return err
	}
	c.dirs[name] = true // a link to a directory stands for it
	if err := c.header(name, 0o120777, int64(len(target))); err != nil {
		return err
	}
	if _, err := io.WriteString(c.w, target); err != nil {
		return err
	}
	c.off += int64(len(target))
	return c.pad4()
}

// addCharDev adds a character device node.
func (c *cpioWriter) addCharDev(name string, perm fs.FileMode, major, minor uint32) error {
	name = strings.Trim(path.Clean(name), "/")
	if err := c.mkdirAll(path.Dir(name)); err != nil {
		return err
	}
	return c.headerDev(name, 0o020000|uint32(perm.Perm()), 0, major, minor)
}

// close writes the trailer and flushes.
func (c *cpioWriter) close() error {
	if err := c.header("TRAILER!!!", 0, 0); err != nil {
		return err
	}
	return c.w.Flush()
}
