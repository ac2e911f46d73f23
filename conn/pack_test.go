package conn

import (
	"bytes"
	"io"
	"testing"
	"time"
)

// A reader that reads late makes a writer of small messages run out of
// credits: its writes go on into pending messages, many to a slot, and
// the reader gets every byte in order, with far fewer messages than
// writes. On shm (inline sends) and on shm staging as verbs does.
func TestPackedWrites(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"inline", nil},
		{"staged", []Option{WithProvider(staged.Name())}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, r := conns(t, tc.opts...)
			const n, size = 2000, 64
			data := random(n * size)
			before, msgs := packedWrites.Load(), w.Stats().MessagesOut
			got := make(chan []byte, 1)
			go func() {
				time.Sleep(20 * time.Millisecond) // the writer runs out of credits first
				b := make([]byte, len(data))
				if _, err := io.ReadFull(r, b); err != nil {
					t.Errorf("read: %v", err)
				}
				got <- b
			}()
			for off := 0; off < len(data); off += size {
				if k, err := w.Write(data[off : off+size]); k != size || err != nil {
					t.Fatalf("write at %d: %d, %v", off, k, err)
				}
			}
			if b := <-got; !bytes.Equal(b, data) {
				t.Fatal("data differs")
			}
			packed := packedWrites.Load() - before
			sent := w.Stats().MessagesOut - msgs
			t.Logf("%d writes: %d packed, %d messages", n, packed, sent)
			if packed == 0 || sent >= n/2 {
				t.Fatalf("%d writes: %d packed, %d messages; want most packed, many to a message", n, packed, sent)
			}
			if st := w.Stats(); st.BytesOut < uint64(len(data)) {
				t.Fatalf("BytesOut %d, wrote %d", st.BytesOut, len(data))
			}
		})
	}
}

// fillPending writes small messages to w, whose reader is not reading,
// until one packed and a message is pending; it returns what it wrote.
func fillPending(t *testing.T, w *rdmaConn) []byte {
	t.Helper()
	var wrote []byte
	before := packedWrites.Load()
	for i := 0; packedWrites.Load() == before; i++ {
		if i == 64 {
			t.Fatal("64 small writes to a reader that does not read: none packed")
		}
		b := random(100)
		if _, err := w.Write(b); err != nil {
			t.Fatal(err)
		}
		wrote = append(wrote, b...)
	}
	w.mu.Lock()
	pending := w.pendingLocked()
	w.mu.Unlock()
	if !pending {
		t.Fatal("a packed write and no message pending")
	}
	return wrote
}

// A write too large to pack (it enlarges) waits for the pending message
// and comes after it.
func TestPackedThenLarge(t *testing.T) {
	w, r := conns(t)
	want := fillPending(t, w)
	big := random(256 << 10)
	done := make(chan error, 1)
	go func() { _, err := w.Write(big); done <- err }()
	time.Sleep(10 * time.Millisecond) // the large write waits behind the pending message
	want = append(want, big...)
	b := make([]byte, len(want))
	if _, err := io.ReadFull(r, b); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, want) {
		t.Fatal("data differs")
	}
}

// The end of the stream, from CloseWrite or from Close while a message is
// pending, follows that message.
func TestPackedThenEOF(t *testing.T) {
	for _, closer := range []string{"CloseWrite", "Close"} {
		t.Run(closer, func(t *testing.T) {
			w, r := conns(t)
			want := fillPending(t, w)
			var err error
			if closer == "CloseWrite" {
				err = w.CloseWrite()
			} else {
				err = w.Close()
			}
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(r)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(b, want) {
				t.Fatalf("read %d bytes, wrote %d; a prefix: %v", len(b), len(want), bytes.HasPrefix(want, b))
			}
		})
	}
}
