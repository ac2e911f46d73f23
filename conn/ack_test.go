package conn

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// streamSizes cross every threshold of the default options: small
// messages, then one above the threshold (the enlargement), then the
// large ring, rendezvous and small again.
var streamSizes = []int{1, 100, 900, 1024, 64 << 10, 7, 5000, 33 << 10, 200 << 10, 1025, 128<<10 + 1, 3}

// stream writes messages of the given sizes on w while r reads them all,
// and reports whether r read exactly what w wrote (a SHA-256 of each
// side's stream): nothing lost, nothing duplicated, nothing reordered.
func stream(w, r *rdmaConn, sizes []int) error {
	sent := sha256.New()
	total := 0
	var msgs [][]byte
	for _, n := range sizes {
		m := random(n)
		msgs = append(msgs, m)
		sent.Write(m)
		total += n
	}
	got := make(chan []byte, 1)
	rerr := make(chan error, 1)
	go func() {
		h := sha256.New()
		_, err := io.CopyN(h, r, int64(total))
		rerr <- err
		got <- h.Sum(nil)
	}()
	for _, m := range msgs {
		if _, err := w.Write(m); err != nil {
			return fmt.Errorf("write %d bytes: %w", len(m), err)
		}
	}
	if err := <-rerr; err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(<-got, sent.Sum(nil)) {
		return errors.New("the stream read differs from the stream written")
	}
	return nil
}

// A lost acknowledgement, as one can be lost on a reliable connection:
// never sent (the peer's enlargement server is muted, then answers only
// the request the test lets it). The writer times out, asks again, and
// enlarges on the answer it gets; if none comes it goes on with the small
// buffers; a late answer is then ignored. The stream is intact each time.
func TestAckLost(t *testing.T) {
	for _, tc := range []struct {
		name     string
		answerAt uint32 // the request answered (0: none before the write gives up)
		late     bool   // answer the last request after the writer gave up
		phase    string
	}{
		{"first lost", 2, false, "large"},
		{"two lost", 3, false, "large"},
		{"all lost", 0, false, phaseNames[phaseTimedOut]},
		{"all lost, answered late", 0, true, phaseNames[phaseTimedOut]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const retries = 2
			a, b := conns(t, WithAckTimeout(100*time.Millisecond, retries))
			b.mu.Lock()
			b.enl.serving = true // muted
			b.mu.Unlock()
			reqs := func() uint32 { b.mu.Lock(); defer b.mu.Unlock(); return b.enl.reqIn }
			answer := func() {
				b.mu.Lock()
				b.wg.Add(1)
				go b.serveEnlarge(time.Now())
				b.mu.Unlock()
			}
			errc := make(chan error, 1)
			go func() { errc <- stream(a, b, streamSizes) }()
			if tc.answerAt > 0 {
				testutil.Eventually(t, 10*time.Second, "reqs() >= tc.answerAt", testutil.Bool(func() bool { return reqs() >= tc.answerAt }))
				answer()
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			if tc.late {
				answer()
				testutil.Eventually(t, 10*time.Second, "a.Stats().StaleRecords >= 1", testutil.Bool(func() bool { return a.Stats().StaleRecords >= 1 }))
			}
			// The phase is read before any later write: once the back-off
			// ends (1 s, which a slow guest can spend on one stream) the
			// next write rightly asks again.
			sa := a.Stats()
			n := reqs()
			wantReqs := tc.answerAt
			if wantReqs == 0 {
				wantReqs = 1 + retries
			}
			// With none answered, a stream that outlasts the back-off asks
			// again, and gives up again after as many requests.
			again := tc.answerAt == 0 && n > wantReqs && n%wantReqs == 0
			if sa.SendPhase != tc.phase || (n != wantReqs && !again) {
				t.Fatalf("writer in phase %q after %d requests, want %q after %d", sa.SendPhase, n, tc.phase, wantReqs)
			}
			if tc.late {
				if err := stream(a, b, streamSizes); err != nil {
					t.Fatalf("after a late answer: %v", err)
				}
			}
			if tc.phase == "large" && sa.LastEnlargeDuration < time.Duration(wantReqs-1)*100*time.Millisecond {
				t.Fatalf("enlarged after %v, before %d time-outs", sa.LastEnlargeDuration, wantReqs-1)
			}
			t.Logf("%d requests, phase %s, %d stale answers ignored, %d data messages in the small ring",
				reqs(), sa.SendPhase, sa.StaleRecords, b.Stats().SmallDataIn)
		})
	}
}

// A corrupt acknowledgement (a flipped byte anywhere: the head flag, the
// fields, the key, the checksum, the tail flag) counts as not received:
// the writer times out and asks again; every ack corrupt leaves it on the
// small buffers. The stream is intact each time.
func TestAckCorrupt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		offset int
		every  bool
		typ    byte
	}{
		{"head flag", 0, false, recAck},
		{"type", 4, false, recAck},
		{"sequence", 5 + 3, false, recAck},
		{"address", 9 + 7, false, recAck},
		{"wrong key", 17 + 3, false, recAck},
		{"slot size", 21 + 2, false, recAck},
		{"checksum", 41, false, recAck},
		{"head without tail", 45, false, recAck},
		{"bad tail", -1, false, recAck},
		{"every ack", -1, true, recAck},
		{"request", 21 + 2, false, recRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rule := fault.Rule{Op: fault.OpPostSend, Action: fault.ActCorrupt, Offset: tc.offset, Match: isRecord(tc.typ), Nth: 1}
			if tc.every {
				rule.Nth = 0
			}
			h := faults.MustAdd(rule)
			defer h.Remove()
			a, b := conns(t, WithProvider(faults.Name()), WithAckTimeout(100*time.Millisecond, 2))
			if err := stream(a, b, streamSizes); err != nil {
				t.Fatal(err)
			}
			sa, sb := a.Stats(), b.Stats()
			bad, phase := sa.BadRecords, "large"
			if tc.typ == recRequest {
				bad = sb.BadRecords
			}
			wantBad := 1
			if tc.every {
				wantBad, phase = 3, phaseNames[phaseTimedOut]
			}
			if int(h.Fired()) != wantBad || bad != wantBad || sa.SendPhase != phase {
				t.Fatalf("corrupted %d, %d bad records seen, phase %q; want %d, %d, %q", h.Fired(), bad, sa.SendPhase, wantBad, wantBad, phase)
			}
		})
	}
}
