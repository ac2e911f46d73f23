package shm

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/internal/settings"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A socket directory (settings.ShmDir) carries shm's set-up across network
// namespaces. Abstract unix sockets belong to a network namespace, as TCP
// ports do, so two pods of one node (each its own namespace) cannot reach
// each other's listener by name, although they share the kernel, and so
// memory. A directory that both mount (a hostPath or a shared emptyDir
// volume) holds a filesystem socket per listener address beside the
// abstract one: <dir>/<ip>:<port>. A dialer looks there only for an
// address that is not of its own namespace (Connect refuses such an
// address otherwise), and applies to the process that answers the same
// peer check as to an abstract listener; the listener checks its dialers
// as always. A socket file is a kernel object of the host that bound it,
// so a directory shared with another host (NFS) reaches nobody there.

// sockDir is the socket directory, "" when none is set.
func sockDir() (string, error) {
	dir, ok := settings.Get(settings.ShmDir)
	if !ok || dir == "" {
		return "", nil
	}
	if err := settings.CheckShmDir(dir); err != nil {
		return "", err
	}
	return dir, nil
}

// dirName is the socket file of ip:port in dir.
func dirName(dir string, ip netip.Addr, port int) string {
	return filepath.Join(dir, net.JoinHostPort(ip.String(), strconv.Itoa(port)))
}

// listenDir binds the listener's sockets in the socket directory: one for
// its address, or, for a wildcard listener, one per address of this
// network namespace (loopback and link-local excepted: a dialer of another
// namespace cannot mean those).
func (l *listener) listenDir(dir string) error {
	ips := []netip.Addr{l.addr.IP}
	if l.addr.IP.IsUnspecified() {
		ips = ips[:0]
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return fmt.Errorf("shm: socket directory: this host's addresses: %w", err)
		}
		for _, a := range addrs {
			p, ok := a.(*net.IPNet)
			if !ok {
				continue
			}
			ip, ok := netip.AddrFromSlice(p.IP)
			if ip = ip.Unmap(); ok && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
				ips = append(ips, ip)
			}
		}
	}
	if l.addr.IP.IsLoopback() {
		return nil
	}
	for _, ip := range ips {
		path := dirName(dir, ip, l.addr.Port)
		f, err := listenPath(path)
		if err != nil {
			l.closeDir()
			return fmt.Errorf("shm: socket directory: %w", err)
		}
		l.dirSocks = append(l.dirSocks, f)
	}
	return nil
}

// closeDir closes and removes the listener's sockets in the directory.
func (l *listener) closeDir() {
	for _, f := range l.dirSocks {
		os.Remove(f.Name())
		f.Close()
	}
	l.dirSocks = nil
}

// listenPath binds a listening socket at path. A socket file left there
// by a listener that is gone (a crash leaves it) is replaced when it is
// this user's; a live listener's, or another user's, is an error.
func listenPath(path string) (*os.File, error) {
	if len(path) >= len(unix.RawSockaddrUnix{}.Path) {
		return nil, fmt.Errorf("%s: a unix socket path has at most %d bytes", path, len(unix.RawSockaddrUnix{}.Path)-1)
	}
	f, err := listenSock(path)
	if errors.Is(err, syscall.EADDRINUSE) {
		var st unix.Stat_t
		if serr := unix.Lstat(path, &st); serr != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK || int(st.Uid) != os.Geteuid() {
			return nil, fmt.Errorf("%s: %w (not a socket of this user's to replace)", path, err)
		}
		if c, derr := dialSock(path); derr == nil {
			c.close()
			return nil, fmt.Errorf("%s: %w (a listener is there)", path, err)
		} else if !errors.Is(derr, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("%s: %w", path, derr)
		}
		os.Remove(path)
		f, err = listenSock(path)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	// As open as an abstract name: who may connect is decided by the peer
	// checks (SO_PEERCRED) on both ends, and first by the directory's
	// own permissions.
	if err := os.Chmod(path, 0o666); err != nil {
		os.Remove(path)
		f.Close()
		return nil, err
	}
	return f, nil
}

// dialDir connects to the listener of ip:port through the socket
// directory, if its process passes check.
func dialDir(dir string, ip netip.Addr, port int, check func(pid, uid, gid int) error) (*rawSock, *unix.Ucred, error) {
	path := dirName(dir, ip, port)
	c, err := dialSock(path)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, nil, fmt.Errorf("%w: nothing listens at %s", transport.ErrConnRefused, path)
		}
		return nil, nil, err
	}
	cred, err := peerCred(c)
	if err == nil {
		err = checkListener(cred, check)
	}
	if err != nil {
		c.close()
		return nil, nil, fmt.Errorf("%w: %s: %v", transport.ErrListenerRefused, strings.TrimPrefix(path, "@"), err)
	}
	return c, cred, nil
}
