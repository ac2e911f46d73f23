package conn

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/internal/testutil"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// leaks wraps shm for the leak checks alone, so that its live counts are
// this file's connections only.
var leaks = wrapShm("conn-leaks")

// wrapShm registers a fault wrapper of shm under name: a provider whose
// live counts (PD, CQ, QP, MR) are those of its own connections.
func wrapShm(name string) *fault.Injector {
	shm, err := transport.Get("shm")
	if err != nil {
		panic(err)
	}
	inj := fault.Wrap(shm, name)
	transport.Register(inj)
	return inj
}

// waitLingering waits until no closed connection is still delivering
// in the background (Close, SetLinger).
func waitLingering(t *testing.T) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, "closed connections to stop lingering", func() (bool, string) {
		n := lingering.Load()
		return n == 0, fmt.Sprintf("%d lingering", n)
	})
}

// noLeaks checks, once every connection of the test is closed, that
// nothing of them is left: no PD, CQ, QP or memory region, no registered
// byte charged to the budget, no goroutine.
func noLeaks(t *testing.T, budget *bufpool.Budget, goroutines goleak.Option) {
	t.Helper()
	// A closed connection may still be delivering in the background
	// (SetLinger): wait for every teardown.
	deadline := time.Now().Add(5 * time.Second)
	// Kits of closed connections are kept for the next ones: they are
	// closed here, and again while teardowns still run.
	for ReleaseKits(); (!leaks.Live().Zero() || budget.Used() != 0 || lingering.Load() != 0) && time.Now().Before(deadline); ReleaseKits() {
		time.Sleep(5 * time.Millisecond)
	}
	if l := leaks.Live(); !l.Zero() {
		t.Errorf("left open after Close: %+v", l)
	}
	if n := budget.Used(); n != 0 {
		t.Errorf("%d registered bytes still charged to the budget", n)
	}
	goleak.VerifyNone(t, goroutines)
}

// The fault matrix, each cell ending with both connections closed and
// nothing left: every phase (small, large, rendezvous), every fault.
func TestFaultMatrixNoLeaks(t *testing.T) {
	type cell struct {
		name  string
		rule  func(writerQP uint32) *fault.Rule
		write int    // bytes written after the rule is armed
		want  string // in the error of the writer or the reader; "" = delivered
		// closeAfterWrite: the writer closes as soon as Write returned;
		// the reader still gets everything (Close delivers in the
		// background).
		closeAfterWrite bool
		// shrink: the writer enlarges and shrinks (idle) before the
		// write; atShrink: the rule is armed between the two, for the
		// shrink record.
		shrink, atShrink bool
		// park: the writer's small direction parks (idle) before the
		// write; atPark: the rule is armed before, for the park message.
		park, atPark bool
	}
	var cells []cell
	for _, ph := range []struct {
		name         string
		n            int
		shrink, park bool
	}{{"small", 200, false, false}, {"large", 100 << 10, false, false}, {"rendezvous", 2 << 20, false, false},
		{"shrunk-then-large", 100 << 10, true, false}, {"parked-then-small", 200, false, true}} {
		cells = append(cells, cell{name: ph.name + "/clean", write: ph.n, shrink: ph.shrink, park: ph.park})
		cells = append(cells, cell{name: ph.name + "/close-after-write", write: ph.n, closeAfterWrite: true, shrink: ph.shrink, park: ph.park})
		cells = append(cells, cell{name: ph.name + "/qp-error", write: ph.n, want: "lost", shrink: ph.shrink, park: ph.park,
			rule: func(qp uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpPostSend, Action: fault.ActQPError, Nth: 2,
					Match: func(ev *fault.Event) bool { return ev.QPNum == qp }}
			}})
		for _, st := range []transport.Status{transport.StatusLocLenErr, transport.StatusLocQPOpErr, transport.StatusLocProtErr,
			transport.StatusWRFlushErr, transport.StatusRemAccessErr, transport.StatusRemOpErr, transport.StatusRetryExcErr,
			transport.StatusRNRRetryExcErr, transport.StatusFatalErr, transport.StatusGeneralErr} {
			cells = append(cells, cell{name: ph.name + "/" + strings.ReplaceAll(st.String(), " ", "-"), write: ph.n, want: st.String(), shrink: ph.shrink, park: ph.park,
				rule: func(qp uint32) *fault.Rule {
					return &fault.Rule{Op: fault.OpCompletion, Action: fault.ActStatus, Status: st, Nth: 2,
						Match: func(ev *fault.Event) bool { return ev.QPNum == qp && ev.WC.Opcode == transport.WCRDMAWrite }}
				}})
		}
	}
	cells = append(cells,
		cell{name: "enlarging/registration-fails", write: 100 << 10,
			rule: func(uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg, MinLen: largeBytes}
			}},
		cell{name: "rendezvous/registration-fails", write: 2 << 20,
			rule: func(uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpRegMR, Action: fault.ActFailReg, MinLen: 1 << 20}
			}},
		// The shrink record itself: its post fails, its completion
		// fails, it is torn on its way (recovered at the next
		// enlargement).
		cell{name: "shrinking/qp-error", write: 100 << 10, want: "lost", shrink: true, atShrink: true,
			rule: func(qp uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpPostSend, Action: fault.ActQPError,
					Match: func(ev *fault.Event) bool { return ev.QPNum == qp && isLargeRecord(recShrink)(ev) }}
			}},
		cell{name: "shrinking/remote-access-error", write: 100 << 10, want: transport.StatusRemAccessErr.String(), shrink: true, atShrink: true,
			rule: func(qp uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpCompletion, Action: fault.ActStatus, Status: transport.StatusRemAccessErr,
					Match: func(ev *fault.Event) bool {
						return ev.QPNum == qp && ev.WC.Opcode == transport.WCRDMAWrite && ev.WC.ID&idRecord != 0
					}}
			}},
		cell{name: "shrinking/record-torn", write: 100 << 10, shrink: true, atShrink: true,
			rule: func(qp uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpPostSend, Action: fault.ActCorrupt, Offset: -1,
					Match: func(ev *fault.Event) bool { return ev.QPNum == qp && isLargeRecord(recShrink)(ev) }}
			}},
		// The park message: its post fails, its completion fails. The
		// writer waits for an answer that cannot come: the connection
		// must fail, not hang.
		cell{name: "parking/qp-error", write: 200, want: "lost", park: true, atPark: true,
			rule: func(qp uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpPostSend, Action: fault.ActQPError,
					Match: func(ev *fault.Event) bool { return ev.QPNum == qp && isPark(ev) }}
			}},
		cell{name: "parking/remote-access-error", write: 200, want: transport.StatusRemAccessErr.String(), park: true, atPark: true,
			rule: func(qp uint32) *fault.Rule {
				return &fault.Rule{Op: fault.OpCompletion, Action: fault.ActStatus, Status: transport.StatusRemAccessErr,
					Match: func(ev *fault.Event) bool { return ev.QPNum == qp && ev.WC.ID == idPark }}
			}},
	)
	// Each cell twice: on a first dial, which negotiates, and on a dial
	// to a listener made known before, which returns before its answer
	// (early_test.go).
	for _, early := range []bool{false, true} {
		for _, tc := range cells {
			name := tc.name
			if early {
				name = "early/" + name
			}
			t.Run(name, func(t *testing.T) {
				goroutines := goleak.IgnoreCurrent()
				budget := bufpool.NewBudget(0)
				opts := []Option{WithProvider(leaks.Name()), WithBudget(budget), WithRendezvousThreshold(1 << 20)}
				if tc.shrink || tc.park {
					opts = append(opts, WithIdleShrink(20*time.Millisecond))
				}
				var a, b *rdmaConn
				if early {
					a, b = earlyConns(t, opts...)
				} else {
					a, b = conns(t, opts...)
				}
				if tc.atPark { // the rule needs the QP's number: now it is known
					h := leaks.MustAdd(*tc.rule(a.qp.Num()))
					defer h.Remove()
				}
				transfer(t, a, b, random(10), writeAll(a)) // connected and working
				if tc.park {
					testutil.Eventually(t, 10*time.Second, "a to park or fail", testutil.Bool(func() bool {
						a.mu.Lock()
						defer a.mu.Unlock()
						return a.st.Parks >= 1 || a.err != nil
					}))
				}
				if tc.shrink {
					transfer(t, a, b, random(100<<10), writeAll(a)) // enlarged
					if tc.atShrink {
						h := leaks.MustAdd(*tc.rule(a.qp.Num()))
						defer h.Remove()
					}
					testutil.Eventually(t, 10*time.Second, "a to shrink or fail", testutil.Bool(func() bool {
						a.mu.Lock()
						defer a.mu.Unlock()
						return a.st.Shrinks == 1 || a.err != nil
					}))
				}
				if tc.rule != nil && !tc.atShrink && !tc.atPark {
					h := leaks.MustAdd(*tc.rule(a.qp.Num()))
					defer h.Remove()
				}
				data := random(tc.write)
				readErr := make(chan error, 1)
				go func() {
					got := make([]byte, len(data))
					_, err := io.ReadFull(b, got)
					if err == nil && string(got) != string(data) {
						err = errors.New("data differs")
					}
					readErr <- err
				}()
				_, werr := a.Write(data)
				if tc.closeAfterWrite {
					a.Close()
				}
				var rerr error
				if tc.want == "" {
					rerr = <-readErr
					if werr != nil || rerr != nil {
						t.Fatalf("write %v, read %v; want the data delivered", werr, rerr)
					}
				} else {
					// The writer fails, at once or at its next operation; the
					// reader fails or times out, never hangs.
					if werr == nil {
						_, werr = a.Write(data[:1])
					}
					for i := 0; werr == nil && i < 100; i++ {
						time.Sleep(10 * time.Millisecond)
						_, werr = a.Write(data[:1])
					}
					if werr == nil || !strings.Contains(werr.Error(), tc.want) {
						t.Fatalf("writer's error %v, want one naming %q", werr, tc.want)
					}
					// The reader gets the data in full (it was delivered
					// before the fault) or an error: never a hang, never
					// wrong bytes.
					b.SetReadDeadline(time.Now().Add(5 * time.Second))
					if rerr = <-readErr; rerr != nil && isTimeout(rerr) {
						t.Fatalf("the reader was not told of the failure: %v", rerr)
					}
				}
				a.Close()
				b.Close()
				noLeaks(t, budget, goroutines)
			})
		}
	}
}

// isPark matches a park message.
func isPark(ev *fault.Event) bool {
	if ev.Send == nil || ev.Send.Opcode != transport.OpWriteWithImm {
		return false
	}
	k, _, _, n := decodeImm(ev.Send.Imm)
	return k == kindCredit && n == lenPark
}
