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
	start := clientStart("verbs", []string{"shm"}, 0x0123456789abcdef)
	for _, cut := range []int{len(h2Preface) + 4, len(h2Preface) + 9 + 5, len(start) - 1} {
		read, h, err := sniff(stalled{bytes.NewReader(start[:cut])})
		if err == nil || h.magic != 0 {
			t.Fatalf("cut at %d: sniff reported %+v, err %v; want the time-out", cut, h, err)
		}
		if !bytes.Equal(read, start[:cut]) {
			t.Errorf("cut at %d: sniff kept %d bytes (%x), want all %d taken", cut, len(read), read, cut)
		}
	}
}
