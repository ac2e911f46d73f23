package conn

import (
	"bytes"
	"io"
	"testing"
	"time"
)

// After a Write whose data the peer must still fetch (a rendezvous
// message), Close blocked 2 s and the peer, reading later, lost the data
// ("peer closed the connection", 0 of 2 MiB). As with TCP, Close now
// returns at once and the data is delivered, then io.EOF.
func TestCloseDeliversInBackground(t *testing.T) {
	a, b := conns(t)
	data := random(2 << 20)
	if _, err := a.Write(data); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Errorf("Close took %v with the peer not reading", d)
	}
	if lingering.Load() == 0 {
		t.Error("nothing lingers although the peer has not fetched the message")
	}
	start = time.Now()
	if _, err := a.Write([]byte("x")); err == nil || time.Since(start) > 100*time.Millisecond {
		t.Errorf("Write after Close: %v after %v, want an error at once", err, time.Since(start))
	}
	time.Sleep(2500 * time.Millisecond) // the peer reads later
	got, err := io.ReadAll(b)
	if err != nil {
		t.Fatalf("peer read %d of %d bytes: %v", len(got), len(data), err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("peer read %d bytes, not the %d written", len(got), len(data))
	}
	b.Close()
	waitLingering(t)
}

// SetLinger(0) discards what the peer has not fetched; SetLinger(n > 0)
// makes Close wait for it at most n seconds.
func TestSetLinger(t *testing.T) {
	t.Run("0", func(t *testing.T) {
		a, b := conns(t)
		a.Write(random(2 << 20))
		a.SetLinger(0)
		start := time.Now()
		a.Close()
		if d := time.Since(start); d > 500*time.Millisecond {
			t.Errorf("Close took %v", d)
		}
		if _, err := io.ReadAll(b); err == nil {
			t.Error("the peer read the whole message after SetLinger(0) and Close")
		}
	})
	t.Run("1", func(t *testing.T) {
		a, b := conns(t)
		a.Write(random(2 << 20))
		a.SetLinger(1)
		go func() {
			time.Sleep(300 * time.Millisecond) // the peer fetches late: Close waits for it
			io.Copy(io.Discard, b)
		}()
		start := time.Now()
		a.Close()
		if d := time.Since(start); d < 250*time.Millisecond || d > 900*time.Millisecond {
			t.Errorf("Close took %v; the peer fetched the message after 300 ms", d)
		}
	})
	a, _ := conns(t)
	a.Close()
	if err := a.SetLinger(1); err == nil {
		t.Error("SetLinger on a closed connection succeeded")
	}
	waitLingering(t)
}
