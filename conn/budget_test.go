package conn

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// pipe2 connects a dialer with dopts to a listener with lopts.
func pipe2(t *testing.T, dopts, lopts []Option) (dialed, accepted *rdmaConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := Listen(ctx, testAddr(), lopts...)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ch := make(chan *rdmaConn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			ch <- nil
			return
		}
		ch <- c.(*Conn).rdma
	}()
	d, err := Dial(ctx, l.Addr().String(), dopts...)
	if err != nil {
		t.Fatal(err)
	}
	a := <-ch
	if a == nil {
		d.Close()
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { d.Close(); a.Close() })
	return unwrap(t, d), a
}

// A 1 MiB write to a reader whose budget has room for 512 KiB of
// destination failed the reader's Read and the connection. The reader now
// asks for smaller parts.
func TestRendezvousReaderShortOfBudget(t *testing.T) {
	w, r := pipe2(t, nil, []Option{WithBudget(bufpool.NewBudget(512 << 10))})
	data := random(1 << 20)
	done := make(chan error, 1)
	go func() { _, err := w.Write(data); done <- err }()
	got := make([]byte, len(data))
	if _, err := io.ReadFull(r, got); err != nil {
		t.Fatalf("read under budget pressure: %v", err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("data differs")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s := r.Stats()
	t.Logf("reader: %d short reads, %d overdrafts, %d rendezvous in", s.RendezvousShortReads, s.BudgetOverdrafts, s.RendezvousIn)
	if s.RendezvousIn == 0 || s.RendezvousShortReads == 0 {
		t.Errorf("the transfer did not go by smaller read requests: %+v", s)
	}
}

// With no room at all (here the test holds the rest of the budget; in the
// soak, the peer's own source held it, both ends in one process) the
// reader neither fails nor waits for memory that may never come back: it
// fetches a page at a time, beyond the budget by that page.
func TestRendezvousReaderOverdraft(t *testing.T) {
	budget := bufpool.NewBudget(256<<10 + 8<<10) // the rings (8 KiB), and 256 KiB the test holds
	w, r := pipe2(t, nil, []Option{WithBudget(budget)})
	hog, err := r.pool.Get(bufpool.Owner(1<<40), 256<<10, transport.AccessLocalWrite)
	if err != nil {
		t.Fatalf("hog the budget: %v", err)
	}
	defer hog.Release()
	data := random(1 << 20) // above the rendezvous threshold
	go w.Write(data)
	got := make([]byte, len(data))
	r.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(r, got); err != nil {
		t.Fatalf("read with no room in the budget: %v", err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("data differs")
	}
	s := r.Stats()
	t.Logf("reader: %d short reads, %d of them overdrafts; budget %d of %d", s.RendezvousShortReads, s.BudgetOverdrafts, budget.Used(), budget.Limit())
	if s.BudgetOverdrafts == 0 {
		t.Errorf("no overdraft counted: %+v", s)
	}
	if over := budget.Used() - budget.Limit(); over > int64(bufpool.DefaultMinSize) {
		t.Errorf("the budget is %d bytes over its limit, more than one page", over)
	}
}

// Registered memory cached by an idle connection's pool goes to another
// connection that needs it: before, the second pair's transfer fell back
// to the rings while the first pair sat on 2 MiB it no longer used.
func TestIdlePoolsGiveMemoryBack(t *testing.T) {
	budget := bufpool.NewBudget(4*8<<10 + 2<<20) // four connections' rings, one transfer's source and destination
	opts := []Option{WithBudget(budget)}
	w1, r1 := pipe2(t, opts, opts)
	transfer(t, w1, r1, random(1<<20), writeAll(w1))
	// The writer gives its source back when the reader's writes into it
	// complete, which its completion loop may see after the reader has
	// the data.
	testutil.Eventually(t, 5*time.Second, "the first writer's pool to cache its source", func() (bool, string) {
		s := w1.pool.Stats()
		return s.FreeBytes > 0, fmt.Sprintf("%+v", s)
	})
	w2, r2 := pipe2(t, opts, opts)
	transfer(t, w2, r2, random(1<<20), writeAll(w2))
	ws, rs := w2.Stats(), r2.Stats()
	t.Logf("second pair: writer %d rendezvous, %d fallbacks; reader %d short reads; budget used %d of %d",
		ws.Rendezvous, ws.RendezvousFallbacks, rs.RendezvousShortReads, budget.Used(), budget.Limit())
	if ws.RendezvousFallbacks != 0 || rs.RendezvousShortReads != 0 || ws.Rendezvous == 0 {
		t.Errorf("the second pair did not get the memory the idle pair cached")
	}
}
