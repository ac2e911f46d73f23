package conn

import (
	"errors"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/mem"
)

// countingPool counts the buffers out of it.
type countingPool struct {
	mem.BufferPool
	out atomic.Int64
}

func (p *countingPool) Get(n int) *[]byte { p.out.Add(1); return p.BufferPool.Get(n) }
func (p *countingPool) Put(b *[]byte)     { p.out.Add(-1); p.BufferPool.Put(b) }

// A reader waiting on an idle connection holds no buffer; data is read
// into one from the pool; a deadline or EOF gives none.
func TestReadOnReady(t *testing.T) {
	for _, tc := range []struct {
		name string
		pair func(t *testing.T) (w, r net.Conn)
	}{
		{"rdma", func(t *testing.T) (net.Conn, net.Conn) { a, b := conns(t); return wrapRDMA(a), wrapRDMA(b) }},
		{"tcp", func(t *testing.T) (net.Conn, net.Conn) {
			// A plain client accepted on a listener's TCP side.
			l, err := Listen(t.Context(), testAddr())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			w, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { w.Close() })
			if _, err := w.Write([]byte(h2Preface + "\x00\x00\x00\x04\x00\x00\x00\x00\x00")); err != nil {
				t.Fatal(err)
			}
			r, err := l.Accept()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { r.Close() })
			// What the negotiation read comes first.
			if b, n, err := r.(*Conn).ReadOnReady(1024, mem.DefaultBufferPool()); err != nil || n != len(h2Preface)+9 {
				t.Fatalf("the replayed preface: %d, %v", n, err)
			} else {
				mem.DefaultBufferPool().Put(b)
			}
			return w, r
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, r := tc.pair(t)
			rc := r.(*Conn)
			pool := &countingPool{BufferPool: mem.DefaultBufferPool()}
			got := make(chan int64, 1)
			go func() {
				// Fixed: the reader must be asleep in ReadOnReady, a
				// state it does not show.
				time.Sleep(50 * time.Millisecond)
				got <- pool.out.Load() // while the reader waits
				w.Write([]byte("hello"))
			}()
			b, n, err := rc.ReadOnReady(32<<10, pool)
			if err != nil || string((*b)[:n]) != "hello" {
				t.Fatalf("ReadOnReady: %q, %v", (*b)[:n], err)
			}
			if out := <-got; out != 0 {
				t.Fatalf("%d buffers out while waiting for data, want 0", out)
			}
			pool.Put(b)
			rc.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
			if b, _, err := rc.ReadOnReady(32<<10, pool); b != nil || !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("ReadOnReady past the deadline: %v, %v", b, err)
			}
			rc.SetReadDeadline(time.Time{})
			w.Close()
			if b, _, err := rc.ReadOnReady(32<<10, pool); b != nil || err == nil {
				t.Fatalf("ReadOnReady after the peer closed: %v, %v", b, err)
			}
			if out := pool.out.Load(); out != 0 {
				t.Fatalf("%d buffers not given back", out)
			}
		})
	}
}
