package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Connections that opened before the probes were attached send no
// marker. Some can still be found from the outside: an shm connection is
// a SOCK_SEQPACKET unix socket pair, the accepting end named after the
// listener ("@rdmagrpc-shm/IP:port", transport/shm), the dialling end
// unnamed but the peer of one that is. Verbs (rdma_cm) and TCP
// connections leave nothing that tells an rdmagrpc connection from
// another, so they are not found this way.

// shmSockPrefix is transport/shm's listener socket name prefix, as the
// kernel lists abstract names (a leading @).
const shmSockPrefix = "@rdmagrpc-shm/"

// unixSock is one unix socket of the machine.
type unixSock struct {
	Inode, Peer uint32 // Peer: 0 when unknown
	Name        string // abstract names start with @
	Listening   bool
	Connected   bool
}

// shmEnd is one end of an shm connection found among the sockets.
type shmEnd struct {
	PID     int
	Server  bool   // the accepting end
	Addr    string // the listener's host:port
	PeerPID int    // 0: unknown
	Inode   uint32
}

// listUnixSockets lists the machine's unix sockets with their peers
// (sock_diag), or, where sock_diag is not available, /proc/net/unix's
// list, which has no peers.
func listUnixSockets() ([]unixSock, error) {
	if s, err := sockDiagUnix(); err == nil {
		return s, nil
	}
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return parseProcNetUnix(bufio.NewScanner(f))
}

// parseProcNetUnix reads /proc/net/unix: Num RefCount Protocol Flags Type
// St Inode [Path].
func parseProcNetUnix(sc *bufio.Scanner) ([]unixSock, error) {
	var out []unixSock
	sc.Scan() // the header
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 7 {
			continue
		}
		flags, _ := strconv.ParseUint(f[3], 16, 32)
		st, _ := strconv.ParseUint(f[5], 16, 8)
		ino, err := strconv.ParseUint(f[6], 10, 32)
		if err != nil {
			continue
		}
		s := unixSock{Inode: uint32(ino), Listening: flags&0x10000 != 0, Connected: st == 3}
		if len(f) > 7 {
			s.Name = f[7]
		}
		out = append(out, s)
	}
	return out, sc.Err()
}

// sock_diag for AF_UNIX (linux/unix_diag.h).
const (
	udiagShowName = 0x1
	udiagShowPeer = 0x4
	unixDiagName  = 0
	unixDiagPeer  = 2
	tcpListen     = 10 // socket states: TCP_ESTABLISHED 1, TCP_LISTEN 10
	tcpEstab      = 1
)

func sockDiagUnix() ([]unixSock, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	req := make([]byte, 16+24)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:], 1)
	req[16] = unix.AF_UNIX
	binary.NativeEndian.PutUint32(req[20:], 0xffffffff) // every state
	binary.NativeEndian.PutUint32(req[28:], udiagShowName|udiagShowPeer)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, err
	}
	var out []unixSock
	buf := make([]byte, 64<<10)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return nil, err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, err
		}
		for _, m := range msgs {
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				return out, nil
			case unix.NLMSG_ERROR:
				return nil, errors.New("sock_diag: unix sockets not supported here")
			}
			if s, ok := parseUnixDiag(m.Data); ok {
				out = append(out, s)
			}
		}
	}
}

// parseUnixDiag reads one unix_diag_msg and its attributes.
func parseUnixDiag(b []byte) (unixSock, bool) {
	if len(b) < 16 {
		return unixSock{}, false
	}
	s := unixSock{Inode: binary.NativeEndian.Uint32(b[4:]), Listening: b[2] == tcpListen, Connected: b[2] == tcpEstab}
	for a := b[16:]; len(a) >= 4; {
		l := int(binary.NativeEndian.Uint16(a))
		typ := binary.NativeEndian.Uint16(a[2:])
		if l < 4 || l > len(a) {
			break
		}
		data := a[4:l]
		switch typ {
		case unixDiagName:
			name := string(data)
			if strings.HasPrefix(name, "\x00") {
				name = "@" + name[1:]
			}
			s.Name = strings.TrimRight(name, "\x00")
		case unixDiagPeer:
			if len(data) >= 4 {
				s.Peer = binary.NativeEndian.Uint32(data)
			}
		}
		a = a[min((l+3)&^3, len(a)):]
	}
	return s, true
}

// socketOwners maps socket inodes to the pid holding them (the first
// found: a socket shared by a parent and child is listed once).
func socketOwners(procRoot string) map[uint32]int {
	owners := map[uint32]int{}
	ents, _ := os.ReadDir(procRoot)
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		fds, _ := os.ReadDir(filepath.Join(procRoot, e.Name(), "fd"))
		for _, fd := range fds {
			l, err := os.Readlink(filepath.Join(procRoot, e.Name(), "fd", fd.Name()))
			if err != nil || !strings.HasPrefix(l, "socket:[") {
				continue
			}
			ino, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]"), 10, 32)
			if err == nil {
				if _, ok := owners[uint32(ino)]; !ok {
					owners[uint32(ino)] = pid
				}
			}
		}
	}
	return owners
}

// shmEnds finds the ends of open shm connections: the accepting ends by
// their name, the dialling ends as their peers (when the sockets' peers
// are known). owners maps inodes to pids.
func shmEnds(socks []unixSock, owners map[uint32]int) []shmEnd {
	var out []shmEnd
	for _, s := range socks {
		if !strings.HasPrefix(s.Name, shmSockPrefix) || s.Listening || !s.Connected {
			continue
		}
		addr := strings.TrimPrefix(s.Name, shmSockPrefix)
		pid, ok := owners[s.Inode]
		if !ok {
			continue // held by no process (closing), or one we cannot read
		}
		srv := shmEnd{PID: pid, Server: true, Addr: addr, Inode: s.Inode, PeerPID: owners[s.Peer]}
		out = append(out, srv)
		if s.Peer != 0 {
			if cpid, ok := owners[s.Peer]; ok {
				out = append(out, shmEnd{PID: cpid, Addr: addr, Inode: s.Peer, PeerPID: pid})
			}
		}
	}
	return out
}

// comm is a process's command name, or "?".
func comm(procRoot string, pid int) string {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "comm"))
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}

// startTicks is when pid started, in clock ticks since boot (field 22
// of /proc/PID/stat), or 0.
func startTicks(procRoot string, pid string) uint64 {
	b, err := os.ReadFile(filepath.Join(procRoot, pid, "stat"))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:]) // comm may hold spaces
	if len(f) < 20 {
		return 0
	}
	v, _ := strconv.ParseUint(f[19], 10, 64)
	return v
}

// startedBefore reports whether pid started before this process did:
// then connections it opened before rdmatrace's probes may be missing
// from the counts.
func startedBefore(pid uint32) bool {
	t := startTicks("/proc", strconv.Itoa(int(pid)))
	self := startTicks("/proc", "self")
	return t != 0 && self != 0 && t < self
}

// discovery finds the shm connection ends that were open when rdmatrace
// started and still are: those send no marker, and counting only these
// (not every end the scan sees) keeps an end seen opening from being
// counted twice.
type discovery struct {
	procRoot string
	pid      int             // only this process's ends; 0: every process's
	initial  map[uint32]bool // socket inodes of the ends open at start
}

// newDiscovery notes the shm ends open now, of pid (0: of every process).
func newDiscovery(pid int) *discovery {
	d := &discovery{procRoot: "/proc", pid: pid, initial: map[uint32]bool{}}
	socks, err := listUnixSockets()
	if err != nil {
		return d
	}
	for _, e := range shmEnds(socks, socketOwners(d.procRoot)) {
		if d.pid == 0 || e.PID == d.pid {
			d.initial[e.Inode] = true
		}
	}
	return d
}

// found is pid → provider → ends open since before start.
func (d *discovery) found() map[uint32]map[string]int {
	out := map[uint32]map[string]int{}
	if d == nil || len(d.initial) == 0 {
		return out
	}
	socks, err := listUnixSockets()
	if err != nil {
		return out
	}
	for _, e := range shmEnds(socks, socketOwners(d.procRoot)) {
		if !d.initial[e.Inode] {
			continue
		}
		if out[uint32(e.PID)] == nil {
			out[uint32(e.PID)] = map[string]int{}
		}
		out[uint32(e.PID)][provShm]++
	}
	return out
}

func commOf(pid uint32) string { return comm("/proc", int(pid)) }
