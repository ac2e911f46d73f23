package conn

import (
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// Close while a Read is copying out of a ring slot or a rendezvous
// destination (on a), and while Writes go on (on b, closed after a):
// Close must not free memory under a reader, nor under a Write that began
// after Close's drain (copying from or into unmapped memory crashes the
// process; both did). grpc-go does exactly this: its reader goroutine is
// always in Read, and its writer may be in Write, when the transport
// closes.
func TestCloseDuringRead(t *testing.T) {
	rounds := 40
	if testing.Short() {
		rounds = 10
	}
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"rings", []Option{WithRendezvousThreshold(-1)}},
		{"rendezvous", []Option{WithRendezvousThreshold(64 << 10)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := random(1 << 20)
			for i := range rounds {
				a, b := conns(t, tc.opts...)
				var wg sync.WaitGroup
				wg.Go(func() {
					for {
						if _, err := b.Write(msg); err != nil {
							return
						}
					}
				})
				rerr := make(chan error, 1)
				go func() {
					buf := make([]byte, 1<<20) // long copies: a wide window
					for {
						if _, err := a.Read(buf); err != nil {
							rerr <- err
							return
						}
					}
				}()
				time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond) // a random moment of the read
				a.Close()
				select {
				case err := <-rerr:
					if !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.EOF) {
						t.Errorf("round %d: read after Close: %v, want net.ErrClosed", i, err)
					}
				case <-time.After(5 * time.Second):
					t.Fatalf("round %d: Read still blocked 5 s after Close", i)
				}
				b.Close()
				wg.Wait()
			}
		})
	}
}

// TestCloseWhileReaderRegisters: Close lands while a reader is getting
// the registered destination of a rendezvous read, with c.mu let go. The
// reader then asks for the data and must still see Close's broadcast,
// not sleep on the channel made after it (found in the rxe guest, where
// ibv_reg_mr is slow enough to open that window).
func TestCloseWhileReaderRegisters(t *testing.T) {
	const chunk = 512 << 10 // a size nothing but the rendezvous destination has
	a, b := conns(t, WithProvider(faults.Name()), WithRendezvousThreshold(64<<10), WithRendezvousChunk(chunk))
	inGet := make(chan struct{})
	closing := make(chan struct{})
	var once sync.Once
	var hold *fault.Handle
	h := faults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActCount, MinLen: chunk, MaxLen: chunk,
		Match: func(ev *fault.Event) bool {
			if ev.Access&transport.AccessRemoteWrite == 0 {
				return false
			}
			once.Do(func() {
				// Nothing but Close may wake the reader: hold a's
				// completions (the flush after Disconnect among them),
				// as a slow verbs poller did.
				hold = faults.MustAdd(fault.Rule{Op: fault.OpCompletion, Action: fault.ActDelay, Delay: time.Hour, QPNum: a.qp.Num()})
				close(inGet)
				<-closing
				// Close has set closed and broadcast; it now waits for
				// the read lock this reader holds.
				for {
					a.mu.Lock()
					closed := a.closed
					a.mu.Unlock()
					if closed {
						return
					}
					time.Sleep(time.Millisecond)
				}
			})
			return true
		}})
	defer h.Remove()

	go b.Write(random(1 << 20)) // fails once the conns are closed
	rerr := make(chan error, 1)
	go func() {
		_, err := a.Read(make([]byte, 1<<20))
		rerr <- err
	}()
	select {
	case <-inGet:
	case <-time.After(10 * time.Second):
		t.Fatal("the reader never registered a rendezvous destination")
	}
	// Its completions held, a would deliver in the background until
	// DefaultLinger ran out: tear down at once instead.
	a.SetLinger(0)
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	close(closing)
	select {
	case err := <-rerr:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("read after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Read still blocked 10 s after Close")
	}
	if err := <-closed; err != nil {
		t.Errorf("Close: %v", err)
	}
	hold.Remove()
	b.Close()
}
