package conn

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
)

// The soak (make soak): RDMAGRPC_SOAK=<duration> runs TestSoak, which
// opens connections over shm, two dozen at a time, for that duration, and
// fails if that made fewer than RDMAGRPC_SOAK_CONNS (default 1,000). Each carries messages both ways
// whose sizes cross every threshold (small slots, the enlargement, the
// large ring, rendezvous of one and several chunks), written whole or
// vectored, each with its sequence number, length and CRC-32C; some
// sessions hit read deadlines (and go on), write deadlines (and close),
// or close one side mid-stream. At the end: no corrupt, lost, duplicated
// or reordered message, and nothing left: no PD, CQ, QP or MR, no
// registered byte, no goroutine.

var soakInj = wrapShm("conn-soak")

type soakFigures struct {
	conns, sessions, msgs, bytes          atomic.Int64
	enlargements, rendezvous, fallbacks   atomic.Int64
	closes, readDeadlines, writeDeadlines atomic.Int64
	corrupt                               atomic.Int64
	lingered, tight, shortReads           atomic.Int64
	shrinks                               atomic.Int64
	parks                                 atomic.Int64
}

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// soakData is the random source every message is a slice of.
var soakData = sync.OnceValue(func() []byte { return random(8 << 20) })

// errCorrupt: a message read is not the message written.
var errCorrupt = errors.New("corrupt stream")

const soakHdr = 12 // sequence, length, CRC-32C

// soakSize draws a message size: a third below the threshold, some at
// its edge, the large ring, rendezvous of one chunk and, rarely, several.
func soakSize(rng *rand.Rand) int {
	switch p := rng.IntN(100); {
	case p < 35:
		return 1 + rng.IntN(DefaultSlotSize)
	case p < 45:
		return DefaultSlotSize - 2 + rng.IntN(5)
	case p < 80:
		return DefaultSlotSize + 1 + rng.IntN(DefaultLargeSize*DefaultLargeCount)
	case p < 98:
		return DefaultLargeSize*DefaultLargeCount + 1 + rng.IntN(1<<20)
	default:
		return DefaultRendezvousChunk + 1 + rng.IntN(DefaultRendezvousChunk)
	}
}

// session modes
const (
	soakClean = iota
	soakReadDeadline
	soakWriteDeadline
	soakClose
	// soakCloseAfterWrite: one direction only; its writer closes as soon
	// as its last Write returns, and the reader must still get every
	// message, then io.EOF (Close delivers in the background).
	soakCloseAfterWrite
)

// soakWrite sends n messages on c; deadlines (soakWriteDeadline) may
// stop it with a time-out, a close with an error.
func soakWrite(c *rdmaConn, rng *rand.Rand, n, mode int, f *soakFigures) error {
	hdr := make([]byte, soakHdr)
	for i := range n {
		size := soakSize(rng)
		data := soakData()
		off := rng.IntN(len(data) - size + 1)
		msg := data[off : off+size]
		binary.BigEndian.PutUint32(hdr, uint32(i))
		binary.BigEndian.PutUint32(hdr[4:], uint32(size))
		binary.BigEndian.PutUint32(hdr[8:], crc32.Checksum(msg, crcTable))
		if mode == soakWriteDeadline && i == n/2 {
			c.SetWriteDeadline(time.Now().Add(time.Duration(rng.IntN(2000)) * time.Microsecond))
		}
		var err error
		if rng.IntN(2) == 0 {
			_, err = c.WriteBuffers(net.Buffers{hdr, msg})
		} else if _, err = c.Write(hdr); err == nil {
			_, err = c.Write(msg)
		}
		if err != nil {
			if isTimeout(err) {
				f.writeDeadlines.Add(1)
			}
			return err
		}
	}
	return nil
}

// soakRead reads and checks n messages from c. Read deadlines
// (soakReadDeadline) are set short now and then; a time-out is counted and
// reading goes on where it stopped.
func soakRead(c *rdmaConn, rng *rand.Rand, n, mode int, f *soakFigures) error {
	buf := make([]byte, 2*DefaultRendezvousChunk+soakHdr)
	readFull := func(b []byte) error {
		for got := 0; got < len(b); {
			if mode == soakReadDeadline && rng.IntN(4) == 0 {
				c.SetReadDeadline(time.Now().Add(time.Duration(rng.IntN(500)) * time.Microsecond))
			}
			k, err := c.Read(b[got:])
			got += k
			if isTimeout(err) {
				f.readDeadlines.Add(1)
				c.SetReadDeadline(time.Time{})
				continue
			}
			if err != nil {
				return err
			}
		}
		return nil
	}
	for i := range n {
		if err := readFull(buf[:soakHdr]); err != nil {
			return err
		}
		seq, size, sum := binary.BigEndian.Uint32(buf), binary.BigEndian.Uint32(buf[4:]), binary.BigEndian.Uint32(buf[8:])
		if seq != uint32(i) || int(size) > len(buf) {
			f.corrupt.Add(1)
			return fmt.Errorf("%w: message %d: header says message %d of %d bytes", errCorrupt, i, seq, size)
		}
		if err := readFull(buf[:size]); err != nil {
			return err
		}
		if crc32.Checksum(buf[:size], crcTable) != sum {
			f.corrupt.Add(1)
			return fmt.Errorf("%w: message %d of %d bytes: CRC differs", errCorrupt, i, size)
		}
		f.msgs.Add(1)
		f.bytes.Add(int64(size))
	}
	return nil
}

// soakSession runs one connection's life; its error is about the soak
// itself (a hang, corruption), not the expected failures of its mode.
func soakSession(t *testing.T, seed uint64, f *soakFigures, budget *bufpool.Budget) error {
	rng := rand.New(rand.NewPCG(seed, 1))
	mode := []int{soakClean, soakClean, soakClean, soakClean, soakReadDeadline, soakReadDeadline, soakWriteDeadline, soakClose, soakCloseAfterWrite}[rng.IntN(9)]
	// A sixth of the sessions run under a budget of their own that has
	// room for their rings and 1 MiB: enlargements are refused,
	// rendezvous sources fall back to the rings, readers ask for less or
	// wait. Every message must still arrive whole.
	if rng.IntN(6) == 0 {
		f.tight.Add(1)
		budget = bufpool.NewBudget(4*8<<10 + 1<<20)
		defer func() {
			// Both sides closed: everything comes back, background
			// teardowns included.
			for end := time.Now().Add(10 * time.Second); budget.Used() != 0 && time.Now().Before(end); {
				ReleaseKits() // the kits of its connections charge it too
				time.Sleep(time.Millisecond)
			}
		}()
	}
	opts := []Option{WithProvider(soakInj.Name()), WithBudget(budget)}
	switch rng.IntN(3) {
	case 0:
		opts = append(opts, WithFreeSmallOnEnlarge())
	case 1:
		// Shrinks racing the writes: the idle time is about a message's.
		opts = append(opts, WithIdleShrink(time.Duration(1+rng.IntN(5))*time.Millisecond))
	}
	ca, cb, _, err := pipe(t, opts...)
	if err != nil {
		return err
	}
	f.conns.Add(1)
	a, b := unwrap(t, ca), unwrap(t, cb)
	n := 4 + rng.IntN(16)
	if mode == soakCloseAfterWrite {
		return soakLinger(a, b, rng, n, f, seed)
	}
	type result struct {
		what string
		err  error
	}
	res := make(chan result, 4)
	for _, d := range [][2]*rdmaConn{{a, b}, {b, a}} {
		ws, rs := rng.Uint64(), rng.Uint64()
		go func() { res <- result{"write", soakWrite(d[0], rand.New(rand.NewPCG(ws, 2)), n, mode, f)} }()
		// Both directions draw the same sizes: the reader's generator
		// only draws deadlines.
		go func() { res <- result{"read", soakRead(d[1], rand.New(rand.NewPCG(rs, 3)), n, mode, f)} }()
	}
	closed := false
	if mode == soakClose {
		time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond) // a random moment of the traffic
		victim := []*rdmaConn{a, b}[rng.IntN(2)]
		f.closes.Add(1)
		closed = true
		victim.Close()
	}
	var soakErr error
	watchdog := time.After(30 * time.Second)
	for range 4 {
		select {
		case r := <-res:
			switch {
			case r.err == nil:
			case soakErr != nil || closed && !errors.Is(r.err, errCorrupt):
				// after the failure or the close: whatever it says
			case errors.Is(r.err, errCorrupt) || mode == soakClean || mode == soakReadDeadline:
				soakErr = fmt.Errorf("session %#x (mode %d, %d messages each way): %s: %w", seed, mode, n, r.what, r.err)
				// The peer of a reader that stopped would wait for
				// credits: close both so that everything returns.
				closed = true
				a.Close()
				b.Close()
			case !closed:
				// A write deadline hit: the stream is cut mid-message;
				// close both so that everything returns.
				closed = true
				a.Close()
				b.Close()
			}
		case <-watchdog:
			state := fmt.Sprintf("dialer %p: %s\naccepted %p: %s", a, a.debugState(), b, b.debugState())
			if p := os.Getenv("RDMAGRPC_SOAK_DUMP"); p != "" {
				if fd, err := os.Create(fmt.Sprintf("%s.%x", p, seed)); err == nil {
					pprof.Lookup("goroutine").WriteTo(fd, 2)
					fd.Close()
				}
			}
			a.Close()
			b.Close()
			return fmt.Errorf("session %#x (mode %d, %d messages each way): still running after 30 s\n%s", seed, mode, n, state)
		}
	}
	soakCount(f, a, b)
	a.Close()
	b.Close()
	f.sessions.Add(1)
	return soakErr
}

func soakCount(f *soakFigures, cs ...*rdmaConn) {
	for _, c := range cs {
		s := c.Stats()
		f.enlargements.Add(int64(s.Enlargements))
		f.shrinks.Add(int64(s.Shrinks))
		f.parks.Add(int64(s.Parks))
		f.rendezvous.Add(int64(s.Rendezvous))
		f.fallbacks.Add(int64(s.RendezvousFallbacks))
		f.shortReads.Add(int64(s.RendezvousShortReads))
	}
}

// soakLinger: a writes n messages and closes at once; b, reading, gets
// them all, then io.EOF.
func soakLinger(a, b *rdmaConn, rng *rand.Rand, n int, f *soakFigures, seed uint64) error {
	ws, rs := rng.Uint64(), rng.Uint64()
	done := make(chan error, 1)
	go func() {
		err := soakRead(b, rand.New(rand.NewPCG(rs, 3)), n, soakClean, f)
		if err == nil {
			if k, eof := b.Read(make([]byte, 1)); k != 0 || eof != io.EOF {
				err = fmt.Errorf("after the last message: %d bytes, %v; want io.EOF", k, eof)
			}
		}
		done <- err
	}()
	var err error
	if err = soakWrite(a, rand.New(rand.NewPCG(ws, 2)), n, soakClean, f); err == nil {
		soakCount(f, a)
		a.Close()
		f.lingered.Add(1)
	}
	select {
	case rerr := <-done:
		if err == nil {
			err = rerr
		}
	case <-time.After(30 * time.Second):
		err = fmt.Errorf("still reading after 30 s\nwriter: %s\nreader: %s", a.debugState(), b.debugState())
	}
	soakCount(f, b)
	a.Close()
	b.Close()
	f.sessions.Add(1)
	if err != nil {
		if errors.Is(err, errCorrupt) {
			f.corrupt.Add(1)
		}
		return fmt.Errorf("session %#x (close after write, %d messages): %w", seed, n, err)
	}
	return nil
}

func TestSoak(t *testing.T) {
	d, err := time.ParseDuration(os.Getenv("RDMAGRPC_SOAK"))
	if err != nil {
		t.Skip("set RDMAGRPC_SOAK to a duration (make soak)")
	}
	target := 1000
	if s := os.Getenv("RDMAGRPC_SOAK_CONNS"); s != "" {
		if target, err = strconv.Atoi(s); err != nil {
			t.Fatal(err)
		}
	}
	const workers = 24
	goroutines := goleak.IgnoreCurrent()
	budget := bufpool.NewBudget(0)
	var f soakFigures
	start := time.Now()
	deadline := start.Add(d)
	var next atomic.Int64
	var mu sync.Mutex
	var failures []error
	var wg sync.WaitGroup
	base := rand.Uint64()
	for range workers {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				i := next.Add(1)
				if err := soakSession(t, base+uint64(i), &f, budget); err != nil {
					mu.Lock()
					failures = append(failures, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	for !soakInj.Live().Zero() && time.Since(start) < elapsed+10*time.Second {
		ReleaseKits()
		time.Sleep(10 * time.Millisecond)
	}
	live, used := soakInj.Live(), budget.Used()
	leaked := 0
	if !live.Zero() {
		leaked++
		t.Errorf("left open: %+v", live)
	}
	if used != 0 {
		leaked++
		t.Errorf("%d registered bytes still charged", used)
	}
	if err := goleak.Find(goroutines); err != nil {
		leaked++
		t.Errorf("goroutines left: %v", err)
	}
	t.Logf("soak: %v, seed base %#x: conns=%d sessions=%d messages=%d bytes=%d enlargements=%d shrinks=%d parks=%d rendezvous=%d fallbacks=%d short-reads=%d tight-budget-sessions=%d closes=%d closes-after-write=%d read-deadline-hits=%d write-deadline-hits=%d corruption=%d leaks=%d failures=%d",
		elapsed.Round(time.Millisecond), base, f.conns.Load(), f.sessions.Load(), f.msgs.Load(), f.bytes.Load(), f.enlargements.Load(), f.shrinks.Load(), f.parks.Load(), f.rendezvous.Load(), f.fallbacks.Load(),
		f.shortReads.Load(), f.tight.Load(), f.closes.Load(), f.lingered.Load(), f.readDeadlines.Load(), f.writeDeadlines.Load(), f.corrupt.Load(), leaked, len(failures))
	for i, err := range failures {
		if i == 20 {
			t.Errorf("... and %d more", len(failures)-20)
			break
		}
		t.Error(err)
	}
	if f.corrupt.Load() != 0 {
		t.Errorf("%d corrupt messages", f.corrupt.Load())
	}
	if n := f.conns.Load(); n < int64(target) {
		t.Errorf("%d connections in %v, want %d: raise RDMAGRPC_SOAK", n, d, target)
	}
}

// debugState is what a stuck session reports of each side.
func (c *rdmaConn) debugState() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprintf("sending=%d phase=%s waiting=%v reqSeq=%d reqIn=%d serving=%v err=%v closed=%v eofIn=%v recordOut=%v ctlPending=%d creditOut=%v\n"+
		"  tx small {msgs %d credits %d seq %d done %d} tx large {count %d msgs %d credits %d seq %d done %d}\n"+
		"  rx small {arrived %d released %d freed %d urgent %v buf %v} rx large {arrived %d released %d freed %d urgent %v buf %v}\n"+
		"  recvQ %d readOff %d rdv out %d serving %v in %d req %+v",
		c.sending, phaseNames[c.enl.phase], c.enl.waiting, c.enl.reqSeq, c.enl.reqIn, c.enl.serving, c.err, c.closed, c.eofIn, c.recordOut, c.ctlPending, c.creditOut,
		c.tx[small].msgs, c.tx[small].credits, c.tx[small].seq, c.tx[small].done,
		c.tx[large].count, c.tx[large].msgs, c.tx[large].credits, c.tx[large].seq, c.tx[large].done,
		c.rx[small].arrived, c.rx[small].released, c.rx[small].freed, c.rx[small].urgent, c.rx[small].buf != nil,
		c.rx[large].arrived, c.rx[large].released, c.rx[large].freed, c.rx[large].urgent, c.rx[large].buf != nil,
		len(c.recvQ), c.readOff, len(c.rdv.out), c.rdv.serving, len(c.rdv.in), c.rdv.req)
}
