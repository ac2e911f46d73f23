package conn

import (
	"io"
	"os"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/fault"
)

// kitFaults counts the registrations of the provider this tier runs on:
// verbs in the rxe guest, shm elsewhere.
var kitFaults = func() *fault.Injector {
	name := "shm"
	if os.Getenv("RXE_ADDR") != "" {
		name = "verbs"
	}
	p, err := transport.Get(name)
	if err != nil {
		panic(err)
	}
	inj := fault.Wrap(p, "conn-kit-"+name)
	transport.Register(inj)
	return inj
}()

// A connection after the first on a device registers nothing: its PD and
// small rings are a closed connection's (kit.go), on both ends. A dial
// charging another budget makes its own. Dropped kits leave nothing.
func TestDialsReuseKits(t *testing.T) {
	waitLingering(t)
	ReleaseKits()
	regs := kitFaults.MustAdd(fault.Rule{Op: fault.OpRegMR, Action: fault.ActCount})
	defer regs.Remove()
	l, err := Listen(t.Context(), testAddr(), WithProvider(kitFaults.Name()), WithoutTCP())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	roundTrip := func(opts ...Option) {
		t.Helper()
		done := make(chan error, 1)
		go func() {
			s, err := l.Accept()
			if err == nil {
				_, err = io.Copy(s, s) // echo until the client closes
				s.Close()
			}
			done <- err
		}()
		c, err := Dial(t.Context(), l.Addr().String(), append([]Option{WithProvider(kitFaults.Name()), WithoutTCP()}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		msg := []byte("kit")
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != string(msg) {
			t.Fatalf("echo %q, %v", got, err)
		}
		c.Close()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		waitLingering(t) // both ends torn down: their kits are kept
	}
	for range 10 {
		roundTrip()
	}
	if n := regs.Fired(); n != 4 {
		t.Fatalf("10 connections registered %d times, want 4: the first one's two rings on each end", n)
	}
	if live := kitFaults.Live(); live.PDs != 2 || live.QPs != 0 {
		t.Fatalf("after 10 connections, live %+v; want the 2 PDs of the two kits and no QP", live)
	}

	// Another budget: the client's end registers its own rings, the
	// listener's end (the default budget) takes its kit again.
	b := bufpool.NewBudget(0)
	roundTrip(WithBudget(b))
	if n := regs.Fired(); n != 6 {
		t.Fatalf("a dial with a budget of its own: %d registrations in all, want 6", n)
	}

	ReleaseKits()
	if live := kitFaults.Live(); !live.Zero() {
		t.Fatalf("after dropKits, live %+v", live)
	}
	if n := b.Used(); n != 0 {
		t.Fatalf("after dropKits, %d bytes still charged to the budget", n)
	}
}
