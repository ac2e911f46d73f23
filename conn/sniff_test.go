package conn

import (
	"bytes"
	"io"
	"os"
	"testing"
)

// stalled yields b, then fails as a read past its deadline does.
type stalled struct{ r io.Reader }

func (s stalled) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err == io.EOF {
		return n, os.ErrDeadlineExceeded
	}
	return n, err
}

// A client that pauses past the listener's sniff within its first frame
// loses no byte: everything sniff took is handed over for replay.
func TestSniffKeepsPartialFrame(t *testing.T) {
	start := clientStart("shm")
	for _, cut := range []int{len(h2Preface) + 4, len(h2Preface) + 9 + 5, len(start) - 1} {
		read, hello, _, err := sniff(stalled{bytes.NewReader(start[:cut])})
		if err == nil || hello != 0 {
			t.Fatalf("cut at %d: sniff reported hello %#x, err %v; want the time-out", cut, hello, err)
		}
		if !bytes.Equal(read, start[:cut]) {
			t.Errorf("cut at %d: sniff kept %d bytes (%x), want all %d taken", cut, len(read), read, cut)
		}
	}
}
