package conn

import (
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"
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
				time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
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
