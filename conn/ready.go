package conn

import (
	"io"
	"os"
	"syscall"
	"time"

	"google.golang.org/grpc/mem"
)

// An idle gRPC connection should not pin a read buffer. grpc-go's framer
// reads through a 32 KiB bufio.Reader per connection, held for the
// connection's life, unless the net.Conn can say when it is readable:
// then it takes a buffer from a pool only when data is there, and gives
// it back once the framer has consumed it. It asks a net.Conn for that by
// this method (grpc-go's transport/readyreader.Reader; its own net.TCPConn
// support reads through syscall.RawConn the same way). Measured here: an
// idle gRPC connection over rdmagrpc held 32 KiB more per end than one
// over TCP, which grpc-go already serves this way.

// The method grpc-go looks for (its package is internal: the interface is
// restated here so that a change of its shape fails the build).
var _ interface {
	ReadOnReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error)
} = (*Conn)(nil)

// ReadOnReady: see Conn.ReadOnReady.
func (c *rdmaConn) ReadOnReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error) {
	c.rmu.Lock()
	c.awaitReadable()
	return c.readReady(bufSize, pool)
}

// awaitReadable returns once a read would not block. An idle gRPC
// connection's reader sleeps here, under grpc-go's framer: the frames it
// sleeps in are kept small (no deferred call, no timer, the reading in
// readReady) because the GC halves a sleeping goroutine's stack only while
// less than a quarter of it is in use, 800 bytes of guard counted, and
// grpc-go's frames alone take most of that quarter of 8 KiB. With
// waitLocked's frame the reader slept with 2,088 bytes counted, over the
// 2,048 that let an 8 KiB stack shrink: an idle client end held about 3
// KiB more stack than over TCP.
//
//go:noinline
func (c *rdmaConn) awaitReadable() {
	c.mu.Lock()
	for !c.closed && !expired(c.rdl) && len(c.recvQ) == 0 && !c.eofIn && c.err == nil {
		if !c.rdl.IsZero() {
			c.waitLocked(c.changed, c.rdl)
			continue
		}
		// waitLocked's frame, sized for its timer, is one too many.
		ch := c.changed
		if c.pollInstead(ch, time.Time{}) {
			continue
		}
		c.markWaiting()
		c.mu.Unlock()
		<-ch
		c.pl.flags.And(^uint32(plFlagWaiting))
		c.mu.Lock()
	}
	c.mu.Unlock()
}

// readReady reads what awaitReadable waited for; c.rmu is held on entry
// and released on return.
//
//go:noinline
func (c *rdmaConn) readReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error) {
	defer c.rmu.Unlock()
	return readInto(bufSize, pool, c.readRLocked)
}

// readInto reads with read into a buffer from pool until it has bytes or
// an error.
func readInto(bufSize int, pool mem.BufferPool, read func([]byte) (int, error)) (*[]byte, int, error) {
	buf := pool.Get(bufSize)
	for {
		n, err := read(*buf)
		switch {
		case n > 0:
			return buf, n, err
		case err != nil:
			pool.Put(buf)
			return nil, 0, err
		}
	}
}

func (c *tcpConn) ReadOnReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error) {
	r, err := c.readTarget()
	switch {
	case err != nil:
		return nil, 0, err
	case r != nil:
		return r.ReadOnReady(bufSize, pool)
	}
	t := c
	t.rmu.Lock()
	replay := len(t.replay) > 0
	t.rmu.Unlock()
	sc, ok := t.nc.(syscall.Conn)
	if replay || !ok {
		return readInto(bufSize, pool, t.read)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return readInto(bufSize, pool, t.read)
	}
	var (
		buf  *[]byte
		n    int
		rerr error
	)
	// The buffer is taken when the socket is readable and given back if
	// the read would block after all.
	err = raw.Read(func(fd uintptr) bool {
		buf = pool.Get(bufSize)
		n, rerr = syscall.Read(int(fd), *buf)
		if rerr != nil {
			pool.Put(buf)
			buf = nil
			return rerr != syscall.EAGAIN
		}
		return true
	})
	switch {
	case err != nil:
		if buf != nil {
			pool.Put(buf)
		}
		return nil, 0, c.opErr("read", err)
	case rerr != nil:
		return nil, 0, c.opErr("read", os.NewSyscallError("read", rerr))
	case n == 0:
		pool.Put(buf)
		return nil, 0, io.EOF
	}
	return buf, n, nil
}
