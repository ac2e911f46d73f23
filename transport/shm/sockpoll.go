package shm

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// One goroutine per process serves the unix sockets of every connection
// end (wake-ups, memfd requests, error notes, disconnects): an idle
// connection has no goroutine of its own, as a TCP socket has none in Go's
// netpoller. The sockets sit in an epoll instance of ours, level
// triggered, and that instance is itself waited for in Go's netpoller, so
// no OS thread is parked either. The goroutine exits when it serves no
// socket, and the next registration starts it again.
type sockPoller struct {
	mu      sync.Mutex
	file    *os.File // the epoll instance, pollable; never closed
	rc      syscall.RawConn
	epfd    int           // file's descriptor
	qps     map[int32]*qp // by registration id (the epoll event's data)
	nextID  int32
	running bool // a loop goroutine runs (or is about to see it must exit)
}

var sockets sockPoller

// serve has q.readSocket run on the poller goroutine whenever q's socket
// is readable: q's registration is made, or, when await made it, armed
// for good.
func (p *sockPoller) serve(q *qp) error {
	return p.watch(q, unix.EPOLLIN|unix.EPOLLRDHUP)
}

// await has the poller read the next message on q's socket (readSocket
// hands it to q.answer) and then leave the socket alone until serve or
// another await: one shot, so that a socket whose answer waits for its
// reader is not reported again meanwhile.
func (p *sockPoller) await(q *qp) error {
	return p.watch(q, unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLONESHOT)
}

func (p *sockPoller) watch(q *qp, events uint32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if q.sockID != 0 && p.qps[q.sockID] == q {
		ev := unix.EpollEvent{Events: events, Fd: q.sockID}
		if err := unix.EpollCtl(p.epfd, unix.EPOLL_CTL_MOD, q.sockFD, &ev); err != nil {
			return fmt.Errorf("shm: watch connection socket: %w", os.NewSyscallError("epoll_ctl", err))
		}
		return nil
	}
	if p.file == nil {
		fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err != nil {
			return fmt.Errorf("shm: epoll_create1: %w", err)
		}
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
			return fmt.Errorf("shm: epoll: %w", err)
		}
		f := os.NewFile(uintptr(fd), "shm-sockets")
		rc, err := f.SyscallConn()
		if err != nil {
			f.Close()
			return fmt.Errorf("shm: epoll: %w", err)
		}
		p.file, p.rc, p.epfd, p.qps = f, rc, fd, map[int32]*qp{}
	}
	id := p.nextID
	for id == 0 || p.qps[id] != nil { // ids wrap after 2^31 registrations
		id++
		if id < 0 {
			id = 1
		}
	}
	p.nextID = id + 1
	ev := unix.EpollEvent{Events: events, Fd: id}
	var cerr error
	err := q.sock.control(func(fd int) {
		cerr = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, fd, &ev)
		q.sockFD = fd
	})
	if err == nil && cerr != nil {
		err = os.NewSyscallError("epoll_ctl", cerr)
	}
	if err != nil {
		return fmt.Errorf("shm: watch connection socket: %w", err)
	}
	q.sockID = id
	p.qps[id] = q
	if !p.running {
		p.running = true
		p.file.SetReadDeadline(time.Time{})
		go p.loop()
	}
	return nil
}

// remove stops watching q's socket; it must run before the socket is
// closed (a later socket could reuse the descriptor number).
func (p *sockPoller) remove(q *qp) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if q.sockID == 0 || p.qps[q.sockID] != q {
		return
	}
	delete(p.qps, q.sockID)
	q.sockID = 0
	unix.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, q.sockFD, nil)
	if len(p.qps) == 0 && p.running {
		// Wake the goroutine so that it sees it has nothing to serve.
		p.file.SetReadDeadline(aLongTimeAgo)
	}
}

// loop is the poller goroutine: wait for readable sockets, serve each
// until it would block, exit when nothing is registered.
func (p *sockPoller) loop() {
	evs := make([]unix.EpollEvent, 128)
	buf := make([]byte, maxMsg)
	oob := make([]byte, unix.CmsgSpace(4*infoFDs))
	for {
		var n int
		err := p.rc.Read(func(fd uintptr) bool {
			var werr error
			n, werr = unix.EpollWait(int(fd), evs, 0)
			if werr != nil {
				n = 0
				return werr != unix.EAGAIN // EINTR: look again at once
			}
			return n > 0
		})
		if err != nil {
			p.mu.Lock()
			if len(p.qps) == 0 {
				p.running = false
				p.mu.Unlock()
				return
			}
			if errors.Is(err, os.ErrDeadlineExceeded) {
				p.file.SetReadDeadline(time.Time{})
				p.mu.Unlock()
				continue
			}
			p.mu.Unlock()
			// The epoll file itself failed: nothing can be served. Not
			// expected; say so rather than spin.
			fmt.Fprintf(os.Stderr, "shm: socket poller: %v\n", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		for i := range n {
			id := evs[i].Fd
			p.mu.Lock()
			q := p.qps[id]
			p.mu.Unlock()
			if q != nil {
				q.readSocket(buf, oob)
			}
		}
	}
}

// readSocket serves every message waiting on q's socket; on end of file
// or an error the peer is gone. While a dialer waits for the answer, it
// hands over the one message instead (await).
func (q *qp) readSocket(buf, oob []byte) {
	for {
		n, oobn, flags, err := q.sock.recv(buf, oob)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			if w := q.answer.Load(); w != nil {
				// Reported with nothing to read: armed once more, or
				// the waiter would hear nothing until its deadline.
				w.rearm(q)
			}
			return
		}
		if w := q.answer.Load(); w != nil {
			b, fds, err := takeMsg(buf, oob, n, oobn, flags, err)
			w.hand(sockMsg{b: bytes.Clone(b), fds: fds, err: err}) // buf is the poller's
			return
		}
		var fds []int
		if err == nil && oobn > 0 {
			fds = parseRights(oob[:oobn])
		}
		if err != nil || n == 0 {
			closeFDs(fds)
			q.hangup()
			return
		}
		if !q.serveMsg(buf[:n], fds) {
			return
		}
	}
}

// sockMsg is a message read for a waiter (awaitAccept).
type sockMsg struct {
	b   []byte
	fds []int
	err error
}

// answerWait is a dialer's wait for the listener's answer (awaitAccept):
// the socket poller reads the message, the dialer takes it.
type answerWait struct {
	ready chan struct{} // a message is there, or an early dial's end came
	mu    sync.Mutex
	msg   sockMsg
	has   bool
	left  bool // the dialer stopped waiting: what comes is dropped
	done  bool // the dialer has its answer (finish)
}

func newAnswerWait() *answerWait { return &answerWait{ready: make(chan struct{}, 1)} }

// hand keeps m for the dialer and tells it. It never blocks the poller:
// the socket is armed for one message at a time (await).
func (w *answerWait) hand(m sockMsg) {
	w.mu.Lock()
	if w.left || w.has {
		closeFDs(m.fds)
	} else {
		w.msg, w.has = m, true
	}
	w.mu.Unlock()
	select {
	case w.ready <- struct{}{}:
	default:
	}
}

// take returns the message handed over, if there is one.
func (w *answerWait) take() (sockMsg, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	m, ok := w.msg, w.has
	w.msg, w.has = sockMsg{}, false
	return m, ok
}

// rearm arms q's socket for the answer again, unless the dialer stopped
// waiting or has it (finish): then serve or leave decides.
func (w *answerWait) rearm(q *qp) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.left && !w.done {
		sockets.await(q)
	}
}

// finish marks the answer taken for good, before serve arms the socket:
// a rearm cannot come after it.
func (w *answerWait) finish() {
	w.mu.Lock()
	w.done = true
	w.mu.Unlock()
}

// leave drops the message handed over and any to come.
func (w *answerWait) leave() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.left = true
	closeFDs(w.msg.fds)
	w.msg, w.has = sockMsg{}, false
}
