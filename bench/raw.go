package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"
)

// rawThroughput writes size-byte buffers into one end of a fresh
// connection of t for d, and returns the bytes per second the other end
// read, from the first write to the last byte read (every byte counted
// has arrived: the writer half-closes and the reader reads to EOF).
func rawThroughput(ctx context.Context, t network, size int, d time.Duration) (float64, error) {
	w, r, err := pipe(ctx, t)
	if err != nil {
		return 0, fmt.Errorf("%s: raw pipe: %w", t.name, err)
	}
	defer w.Close()
	defer r.Close()
	type result struct {
		n   int64
		end time.Time
		err error
	}
	done := make(chan result, 1)
	go func() {
		buf := make([]byte, size)
		var n int64
		for {
			k, err := r.Read(buf)
			n += int64(k)
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = nil
				}
				done <- result{n, time.Now(), err}
				return
			}
		}
	}()
	msg := make([]byte, size)
	for i := range msg {
		msg[i] = byte(i)
	}
	start := time.Now()
	for i := 0; i < 2 || time.Since(start) < d; i++ {
		if _, err := w.Write(msg); err != nil {
			return 0, fmt.Errorf("%s: raw write: %w", t.name, err)
		}
	}
	if err := w.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		return 0, fmt.Errorf("%s: close write: %w", t.name, err)
	}
	res := <-done
	if res.err != nil {
		return 0, fmt.Errorf("%s: raw read: %w", t.name, res.err)
	}
	return float64(res.n) / res.end.Sub(start).Seconds(), nil
}

// memcpyBandwidth copies size bytes between two buffers for d and returns
// bytes copied per second: the ceiling of anything that copies data once.
func memcpyBandwidth(size int, d time.Duration) float64 {
	src, dst := make([]byte, size), make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault the pages in
	var n int64
	start := time.Now()
	for n < 2*int64(size) || time.Since(start) < d {
		copy(dst, src)
		n += int64(size)
	}
	return float64(n) / time.Since(start).Seconds()
}
