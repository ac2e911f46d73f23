package shm

import (
	"bytes"
	"testing"

	"golang.org/x/sys/unix"
)

// recvmsg reads what was sent, with its descriptors, and allocates
// nothing: the socket poller reads every wake-up with it.
func TestRecvmsgReadsWithoutAllocating(t *testing.T) {
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sp[0])
	defer unix.Close(sp[1])
	buf, oob := make([]byte, maxMsg), make([]byte, unix.CmsgSpace(4*infoFDs))
	if _, _, _, err := recvmsg(sp[1], buf, oob); err != unix.EAGAIN {
		t.Fatalf("empty socket: %v, want EAGAIN", err)
	}
	if err := unix.Sendmsg(sp[0], []byte("hello"), unix.UnixRights(sp[0]), nil, 0); err != nil {
		t.Fatal(err)
	}
	n, oobn, flags, err := recvmsg(sp[1], buf, oob)
	if err != nil || !bytes.Equal(buf[:n], []byte("hello")) || flags&unix.MSG_CTRUNC != 0 {
		t.Fatalf("read %q, flags %#x, %v", buf[:n], flags, err)
	}
	fds := parseRights(oob[:oobn])
	closeFDs(fds)
	if len(fds) != 1 {
		t.Fatalf("%d descriptors, want 1", len(fds))
	}
	msg := []byte{msgWake}
	allocs := testing.AllocsPerRun(100, func() {
		if err := unix.Sendmsg(sp[0], msg, nil, nil, 0); err != nil {
			t.Fatal(err)
		}
		if n, _, _, err := recvmsg(sp[1], buf, oob); n != 1 || err != nil {
			t.Fatalf("read %d bytes, %v", n, err)
		}
	})
	if allocs > 0 {
		t.Fatalf("%.1f allocations per message", allocs)
	}
}
