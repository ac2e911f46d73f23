package shm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sock is a connection's unix socket as a QP uses it: messages with
// descriptors, written whole (SOCK_SEQPACKET), read only when the socket
// poller says there is one.
type sock interface {
	// send writes one message without waiting. A peer whose queue is
	// full has stopped reading: the socket is shut down (the socket
	// poller then hangs the QP up) and errPeerStalled returned. Nothing
	// may wait on a peer: sends come from the socket poller, which
	// serves every connection of the process, and from under locks of
	// a connection that Close takes.
	send(b []byte, fds ...int) error
	// recv reads one message without waiting (unix.EAGAIN: none).
	recv(buf, oob []byte) (n, oobn, flags int, err error)
	// control runs f with the descriptor, which stays open meanwhile.
	control(f func(fd int)) error
	close() error
}

// rawSock is a socket the dialer made itself: it is never registered
// with Go's netpoller, only with the socket poller's epoll set. A socket
// of Go's net cost each set-up an epoll registration of its own, two
// more system calls for its addresses and the poll descriptor's objects:
// a sixth of the dialer's CPU in a loop of set-ups.
type rawSock struct {
	// mu: RLock for each system call on fd, Lock to close it, so that
	// a call never reaches a descriptor number reused meanwhile.
	mu sync.RWMutex
	fd int // -1 once closed
}

// dialSock connects a non-blocking SOCK_SEQPACKET socket to name. As
// for Go's net, a listener whose backlog is full fails it (EAGAIN).
func dialSock(name string) (*rawSock, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	sa := &unix.SockaddrUnix{Name: name}
	for {
		err = unix.Connect(fd, sa)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		unix.Close(fd)
		return nil, &net.OpError{Op: "dial", Net: "unixpacket", Addr: &net.UnixAddr{Name: name, Net: "unixpacket"}, Err: os.NewSyscallError("connect", err)}
	}
	return &rawSock{fd: fd}, nil
}

func (s *rawSock) send(b []byte, fds ...int) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.fd < 0 {
		return net.ErrClosed
	}
	return sendNow(s.fd, b, fds)
}

// errPeerStalled is what a send to a peer that stopped reading returns.
var errPeerStalled = errors.New("shm: the peer stopped reading its socket (its queue is full): connection cut off")

// sendNow writes one message to fd without waiting; a full queue shuts
// the socket down (see sock.send). A connection's messages are a few
// control words, one memory reply per request and one wake-up per
// arming: a peer that reads keeps its queue nearly empty, and one that
// lets it fill (hundreds of messages) is not reading at all.
func sendNow(fd int, b []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	for {
		err := unix.Sendmsg(fd, b, oob, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
		switch err {
		case nil:
			return nil
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			unix.Shutdown(fd, unix.SHUT_RDWR)
			return errPeerStalled
		}
		return os.NewSyscallError("sendmsg", err)
	}
}

func (s *rawSock) recv(buf, oob []byte) (n, oobn, flags int, err error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.fd < 0 {
		return 0, 0, 0, net.ErrClosed
	}
	return recvmsg(s.fd, buf, oob)
}

// recvmsg reads one message without waiting, as unix.Recvmsg does but
// with no allocation: the sender's address (there is none on a connected
// socket) is not asked for. Every wake-up a peer sends is read with it.
func recvmsg(fd int, buf, oob []byte) (n, oobn, flags int, err error) {
	var iov unix.Iovec
	var msg unix.Msghdr
	if len(buf) > 0 {
		iov.Base = &buf[0]
		iov.SetLen(len(buf))
		msg.Iov, msg.Iovlen = &iov, 1
	}
	if len(oob) > 0 {
		msg.Control = &oob[0]
		msg.SetControllen(len(oob))
	}
	r, _, errno := unix.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
	if errno != 0 {
		return 0, 0, 0, errno
	}
	return int(r), int(msg.Controllen), int(msg.Flags), nil
}

func (s *rawSock) control(f func(fd int)) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.fd < 0 {
		return net.ErrClosed
	}
	f(s.fd)
	return nil
}

// peerCred is the SO_PEERCRED of s's peer, fixed at connect.
func peerCred(s sock) (*unix.Ucred, error) {
	var cred *unix.Ucred
	var err error
	if cerr := s.control(func(fd int) { cred, err = unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED) }); cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, os.NewSyscallError("getsockopt SO_PEERCRED", err)
	}
	return cred, nil
}

func (s *rawSock) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fd < 0 {
		return net.ErrClosed
	}
	err := unix.Close(s.fd)
	s.fd = -1
	return err
}

// recvMsg reads one message from s without waiting (unix.EAGAIN: none
// yet), as readMsg does from a socket of Go's net.
func recvMsg(s *rawSock, buf, oob []byte) ([]byte, []int, error) {
	n, oobn, flags, err := s.recv(buf, oob)
	return takeMsg(buf, oob, n, oobn, flags, err)
}

// toNet hands s's descriptor over to a socket of Go's net, for reads that
// wait with a deadline; s is closed.
func (s *rawSock) toNet() (*net.UnixConn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fd < 0 {
		return nil, net.ErrClosed
	}
	f := os.NewFile(uintptr(s.fd), "shm-socket")
	c, err := net.FileConn(f) // a dup of its own
	f.Close()
	s.fd = -1
	if err != nil {
		return nil, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("shm: socket is a %T", c)
	}
	return uc, nil
}

// fromNet takes c's socket back out of Go's netpoller, as a rawSock: a
// live QP's socket is waited for by the socket poller alone. Registered
// in the netpoller (edge triggered, for reading and writing), each
// wake-up the peer sends and each one of ours it reads would also wake
// the netpoller's thread, for nothing: a context switch per message on
// a busy host. c is closed; on an error (out of descriptors) c is left
// as it was, still usable as a netSock.
func fromNet(c *net.UnixConn) (*rawSock, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	nfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) {
		// The copy shares the open file (and its O_NONBLOCK); closing c
		// unregisters the file from the netpoller, not the copy's from
		// anything.
		nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, os.NewSyscallError("fcntl F_DUPFD_CLOEXEC", derr)
	}
	c.Close()
	return &rawSock{fd: nfd}, nil
}

// netSock is a socket of Go's net: a listener's whose request had to be
// waited for.
type netSock struct {
	c  *net.UnixConn
	rc syscall.RawConn
}

func (s *netSock) send(b []byte, fds ...int) error {
	var err error
	if cerr := s.rc.Write(func(fd uintptr) bool {
		err = sendNow(int(fd), b, fds)
		return true // never wait in Go's netpoller either
	}); cerr != nil {
		return cerr
	}
	return err
}

func (s *netSock) recv(buf, oob []byte) (n, oobn, flags int, err error) {
	rerr := s.rc.Read(func(fd uintptr) bool {
		n, oobn, flags, err = recvmsg(int(fd), buf, oob)
		return true // never wait here: the poller waits for every socket
	})
	if rerr != nil {
		err = rerr
	}
	return n, oobn, flags, err
}

func (s *netSock) control(f func(fd int)) error {
	return s.rc.Control(func(fd uintptr) { f(int(fd)) })
}

func (s *netSock) close() error { return s.c.Close() }
