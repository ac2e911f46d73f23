package conn

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// TestManyBusyConns: eight connections of one process pair move data at
// once, every byte checked. Over verbs (the rxe tier) their QPs share
// the device's CQs and receive pool and hold sends beyond the device's
// queue: the contention one connection never meets. A connection that
// stalls (a lost wake-up leaves its peer's credits unread) fails at the
// deadline, naming itself. The wake-up that eight such connections once
// lost is pinned by transport/verbs' TestVerbsStashWakesArmedView; this
// test, under -race, did not lose it in four runs without that fix.
func TestManyBusyConns(t *testing.T) {
	const conns, rounds, perConn, chunk = 8, 3, 4 << 20, 32 << 10
	if testing.Short() {
		t.Skip("moves 96 MiB")
	}
	for round := range rounds {
		type pair struct{ w, r net.Conn }
		pairs := make([]pair, conns)
		for i := range pairs {
			w, r, stop, err := pipe(t)
			if err != nil {
				t.Fatalf("round %d, connection %d: %v", round, i, err)
			}
			t.Cleanup(stop) // at the latest; a round that ends closes its own
			pairs[i] = pair{w, r}
		}
		deadline := time.Now().Add(2 * time.Minute)
		var wg sync.WaitGroup
		errs := make(chan error, 2*conns)
		for i, p := range pairs {
			p.w.SetDeadline(deadline)
			p.r.SetDeadline(deadline)
			wg.Go(func() {
				msg := make([]byte, chunk)
				for off := 0; off < perConn; off += chunk {
					for j := range msg {
						msg[j] = byte(off + j + i)
					}
					if _, err := p.w.Write(msg); err != nil {
						errs <- fmt.Errorf("round %d, connection %d: write at %d: %w", round, i, off, err)
						return
					}
				}
			})
			wg.Go(func() {
				buf := make([]byte, chunk)
				for off := 0; off < perConn; {
					n, err := p.r.Read(buf)
					for j := range buf[:n] {
						if buf[j] != byte(off+j+i) {
							errs <- fmt.Errorf("round %d, connection %d: byte %d is %d, want %d", round, i, off+j, buf[j], byte(off+j+i))
							return
						}
					}
					off += n
					if err != nil && (off < perConn || !errors.Is(err, io.EOF)) {
						errs <- fmt.Errorf("round %d, connection %d: read at %d of %d: %w", round, i, off, perConn, err)
						return
					}
				}
			})
		}
		wg.Wait()
		for _, p := range pairs {
			p.w.Close()
			p.r.Close()
		}
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if t.Failed() {
			return
		}
	}
}
