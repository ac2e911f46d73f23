package shm

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// One socket poller serves every shm connection of a process. A peer
// that stops reading its socket and keeps asking for memory fills its
// queue with the answers; the poller must cut that peer off rather than
// wait for room, or every other connection of the process, and every new
// dial, would wait with it.

const (
	freezeEnv  = "RDMAGRPC_SHM_FREEZE"    // helper mode: "echo" or "flood"
	freezeAddr = "RDMAGRPC_SHM_FREEZE_TO" // flood: the address to dial
)

// freezeHelper runs one of the two processes of TestFrozenPeerIsCutOff.
func freezeHelper(mode string) error {
	p, _ := transport.Get("shm")
	d, err := p.Open("")
	if err != nil {
		return err
	}
	switch mode {
	case "echo":
		return echoMany(d)
	case "flood":
		return flood(d, os.Getenv(freezeAddr))
	}
	return fmt.Errorf("unknown mode %q", mode)
}

// echoMany listens, prints its address, and echoes every message of every
// connection it accepts, each on a goroutine of its own.
func echoMany(d transport.Device) error {
	l, err := d.Listen("127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println(l.Addr().String())
	ctx := context.Background()
	for {
		r, err := l.Accept(ctx)
		if err != nil {
			return err
		}
		e, err := newEcho(d)
		if err != nil {
			return err
		}
		qp, err := r.Accept(ctx, e.cfg(), nil)
		if err != nil {
			return err
		}
		go e.serve(qp)
	}
}

// echoSide is one connection's PD, CQ and memory in the echo process.
type echoSide struct {
	pd  transport.PD
	cq  transport.CQ
	mem []byte
	mr  transport.MR
}

func newEcho(d transport.Device) (*echoSide, error) {
	e := &echoSide{}
	var err error
	if e.pd, err = d.AllocPD(); err != nil {
		return nil, err
	}
	if e.cq, err = d.CreateCQ(16); err != nil {
		return nil, err
	}
	if e.mem, err = d.AllocMemory(1 << 16); err != nil {
		return nil, err
	}
	e.mr, err = e.pd.RegMR(e.mem, transport.AccessLocalWrite)
	return e, err
}

func (e *echoSide) cfg() transport.QPConfig {
	return transport.QPConfig{PD: e.pd, SendCQ: e.cq, RecvCQ: e.cq, MaxSendWR: 8, MaxRecvWR: 4,
		MaxSendSGE: 1, MaxRecvSGE: 1, RNRRetry: 7, MinRNRTimer: time.Millisecond}
}

func (e *echoSide) sge(off, n int) []transport.SGE {
	return []transport.SGE{{Addr: e.mr.Addr() + uint64(off), Length: uint32(n), LKey: e.mr.LKey()}}
}

// serve echoes from the upper half of the memory, so that the receive is
// posted again at once.
func (e *echoSide) serve(qp transport.QP) {
	const slot = 4096
	for i := range 4 {
		qp.PostRecv(transport.RecvWR{ID: uint64(i), SG: e.sge(i*slot, slot)})
	}
	wc := make([]transport.WorkCompletion, 8)
	for {
		n, err := e.cq.Poll(wc)
		if err != nil {
			return
		}
		if n == 0 {
			e.cq.ReqNotify()
			if n, _ = e.cq.Poll(wc); n == 0 {
				if e.cq.Wait(context.Background()) != nil {
					return
				}
				continue
			}
		}
		for _, w := range wc[:n] {
			if w.Status != transport.StatusSuccess {
				return
			}
			if w.Opcode != transport.WCRecv {
				continue
			}
			off := int(w.ID) * slot
			copy(e.mem[32<<10+off:], e.mem[off:off+int(w.ByteLen)])
			qp.PostRecv(transport.RecvWR{ID: w.ID, SG: e.sge(off, slot)})
			qp.PostSend(transport.SendWR{ID: 100, Opcode: transport.OpSendWithImm, Imm: w.ByteLen, Signaled: true,
				SG: e.sge(32<<10+off, int(w.ByteLen))})
		}
	}
}

// flood dials addr, stops reading its socket, and sends memory requests
// until the socket takes no more; it prints FLOODED and how many it sent,
// then waits for its stdin to close.
func flood(d transport.Device, addr string) error {
	e, err := newEcho(d)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tq, err := d.Connect(ctx, addr, e.cfg(), nil)
	if err != nil {
		return err
	}
	q := tq.(*qp)
	sockets.remove(q) // nothing reads this socket any more
	sent := 0
	q.sock.control(func(fd int) {
		// Until the listener has taken no request for a second (its
		// queue stays full: its poller is stuck, or cut us off) or
		// refuses them (cut off).
		for last := time.Now(); time.Since(last) < time.Second; {
			err := unix.Sendmsg(fd, encodeMemReq(uint64(sent+1), 1, 1), nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
			switch err {
			case nil:
				sent++
				last = time.Now()
			case unix.EINTR:
			case unix.EAGAIN:
				time.Sleep(time.Millisecond) // the socket is full: retry shortly
			default:
				return
			}
		}
	})
	fmt.Printf("FLOODED %d\n", sent)
	bufio.NewReader(os.Stdin).ReadString('\n')
	return nil
}

func startFreezeHelper(t *testing.T, mode string, env ...string) (*bufio.Reader, func()) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), freezeEnv+"="+mode), env...)
	out, in := startChild(t, cmd)
	return out, func() { in.Close() }
}

// startChild starts cmd with pipes to its stdin and from its stdout; the
// child is killed and waited for when the test ends.
func startChild(t *testing.T, cmd *exec.Cmd) (*bufio.Reader, io.WriteCloser) {
	t.Helper()
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Process.Kill(); cmd.Wait() })
	return bufio.NewReader(out), in
}

// echoConn is one of this process's connections to the echo process.
type echoConn struct {
	*echoSide
	qp transport.QP
}

func (c *echoConn) roundTrip(ctx context.Context, msg string) error {
	if _, err := c.qp.PostRecv(transport.RecvWR{ID: 1, SG: c.sge(8192, 4096)}); err != nil {
		return err
	}
	copy(c.mem, msg)
	if _, err := c.qp.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpSend, SG: c.sge(0, len(msg)), Signaled: true}); err != nil {
		return err
	}
	wc := make([]transport.WorkCompletion, 4)
	check := func(n int) error {
		for _, w := range wc[:n] {
			if w.Status != transport.StatusSuccess {
				return fmt.Errorf("completion %+v", w)
			}
			if w.Opcode == transport.WCRecv && string(c.mem[8192:8192+w.ByteLen]) != msg {
				return fmt.Errorf("echo %q, want %q", c.mem[8192:8192+w.ByteLen], msg)
			}
		}
		return nil
	}
	for got := 0; got < 2; {
		n, err := c.cq.Poll(wc)
		if err != nil {
			return err
		}
		if n == 0 {
			// Sleep on the CQ: its wake-up comes through the socket
			// poller, which is what this test watches. What landed
			// before the arming is polled once more first.
			c.cq.ReqNotify()
			if n, err = c.cq.Poll(wc); err != nil {
				return err
			}
			if n == 0 {
				if err := c.cq.Wait(ctx); err != nil {
					return err
				}
				continue
			}
		}
		if err := check(n); err != nil {
			return err
		}
		got += n
	}
	return nil
}

func TestFrozenPeerIsCutOff(t *testing.T) {
	const others = 100
	p, _ := transport.Get("shm")
	d, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	echo, _ := startFreezeHelper(t, "echo")
	line, err := echo.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	echoAddr := strings.TrimSpace(line)
	dialEcho := func(ctx context.Context) (*echoConn, error) {
		e, err := newEcho(d)
		if err != nil {
			return nil, err
		}
		q, err := d.Connect(ctx, echoAddr, e.cfg(), nil)
		if err != nil {
			return nil, err
		}
		return &echoConn{echoSide: e, qp: q}, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conns := make([]*echoConn, others)
	for i := range conns {
		if conns[i], err = dialEcho(ctx); err != nil {
			t.Fatal(err)
		}
		defer conns[i].qp.Close()
		if err := conns[i].roundTrip(ctx, "warm"); err != nil {
			t.Fatal(err)
		}
	}

	// The frozen peer dials this process and floods it.
	l, err := d.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fl, stopFlood := startFreezeHelper(t, "flood", freezeAddr+"="+l.Addr().String())
	r, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fe, err := newEcho(d)
	if err != nil {
		t.Fatal(err)
	}
	frozen, err := r.Accept(ctx, fe.cfg(), nil)
	if err != nil {
		t.Fatal(err)
	}
	line, err = fl.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "FLOODED") {
		t.Fatalf("flood: %q %v", line, err)
	}
	t.Logf("the frozen peer sent %s", strings.TrimSpace(strings.TrimPrefix(line, "FLOODED ")))
	defer stopFlood()

	select {
	case <-frozen.Disconnected():
	case <-time.After(5 * time.Second):
		t.Fatal("the peer that stopped reading was not cut off")
	}

	// Everyone else goes on: every connection moves data, and a new dial
	// succeeds within a second.
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, others)
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			octx, ocancel := context.WithTimeout(ctx, 5*time.Second)
			defer ocancel()
			if err := c.roundTrip(octx, fmt.Sprintf("after the freeze %d", i)); err != nil {
				errs <- fmt.Errorf("connection %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d connections echoed in %v with the frozen peer cut off", others, time.Since(start))
	dctx, dcancel := context.WithTimeout(ctx, time.Second)
	defer dcancel()
	nc, err := dialEcho(dctx)
	if err != nil {
		t.Fatalf("a new dial with a frozen peer: %v", err)
	}
	defer nc.qp.Close()
	if err := nc.roundTrip(dctx, "new"); err != nil {
		t.Fatal(err)
	}

	start = time.Now()
	frozen.Close()
	if d := time.Since(start); d > time.Second {
		t.Fatalf("closing the frozen peer's connection took %v", d)
	}
}
