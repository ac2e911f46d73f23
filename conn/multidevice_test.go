package conn

import (
	"context"
	"net"
	"os"
	"testing"
	"time"
)

// Several RDMA devices: a connection's resources are made on the device
// its route goes through, on both sides. Runs in the rxe tier's
// two-device guest (tests/rxe: rxe0 on RXE_ADDR, rxe1 on RXE_DEV2_ADDR);
// before, a dial to the second device's address failed with "connection
// goes through RDMA device rxe1, not rxe0".
func TestMultiDevice(t *testing.T) {
	addr2 := os.Getenv("RXE_DEV2_ADDR")
	if addr2 == "" {
		t.Skip("needs a guest with two RDMA devices (RXE_DEV2_ADDR; tests/rxe runs it)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := Listen(ctx, ":0") // every device's addresses
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	for _, tc := range []struct{ ip, dev string }{
		{os.Getenv("RXE_ADDR"), "rxe0"},
		{addr2, "rxe1"},
	} {
		t.Run(tc.dev, func(t *testing.T) {
			acc := make(chan net.Conn, 1)
			go func() {
				c, err := l.Accept()
				if err != nil {
					t.Errorf("accept: %v", err)
				}
				acc <- c
			}()
			d, err := Dial(ctx, net.JoinHostPort(tc.ip, port))
			if err != nil {
				t.Fatalf("dial %s: %v", tc.ip, err)
			}
			defer d.Close()
			a := <-acc
			if a == nil {
				t.FailNow()
			}
			defer a.Close()
			for _, c := range []*Conn{d.(*Conn), a.(*Conn)} {
				// A dial to a listener known from the first subtest returns
				// before the listener's answer: Stats says "negotiating"
				// until then.
				if err := c.Handshake(ctx); err != nil {
					t.Fatalf("handshake with %s: %v", tc.ip, err)
				}
				if s := c.Stats(); s.Device != tc.dev {
					t.Errorf("connection to %s lives on %s (provider %s), want %s", tc.ip, s.Device, s.Provider, tc.dev)
				}
			}
			// Rings, an enlargement and a rendezvous, both ways.
			for _, n := range []int{100, 100 << 10, 2 << 20} {
				transfer(t, d.(*Conn), a.(*Conn), random(n), writeAll(d.(*Conn)))
				transfer(t, a.(*Conn), d.(*Conn), random(n), writeAll(a.(*Conn)))
			}
		})
	}
}
