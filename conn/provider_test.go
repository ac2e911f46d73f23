package conn

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// A verbs device that is here but cannot be opened is an error the user
// sees; only the absence of RDMA selects shm.
func TestProviderChoiceBrokenDevice(t *testing.T) {
	if _, err := transport.Get("verbs"); err != nil {
		t.Skipf("verbs not registered: %v", err)
	}
	t.Setenv("RDMAGRPC_PROVIDER", "")
	for _, tc := range []struct {
		name    string
		verbs   error
		wantErr bool
	}{
		{"no device", fmt.Errorf("verbs: no RDMA device: %w", transport.ErrUnavailable), false},
		{"permission denied", fmt.Errorf("verbs: no permission on /dev/infiniband/uverbs0: %w", transport.ErrUnusable), true},
		{"memlock", errors.New("verbs: ibv_reg_mr: cannot allocate memory"), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			real := openDevice
			t.Cleanup(func() { openDevice = real })
			openDevice = func(name string) (transport.Device, error) {
				if name == "verbs" {
					return nil, tc.verbs
				}
				return real(name)
			}
			l, err := Listen(context.Background(), "127.0.0.1:0")
			if !tc.wantErr {
				if err != nil {
					t.Fatalf("Listen with %v: %v, want shm", tc.verbs, err)
				}
				l.Close()
				return
			}
			if err == nil {
				l.Close()
				t.Fatalf("Listen chose another provider although verbs failed with %v", tc.verbs)
			}
			if !strings.Contains(err.Error(), tc.verbs.Error()) || !strings.Contains(err.Error(), "RDMAGRPC_PROVIDER=shm") {
				t.Fatalf("Listen error %q does not carry the device's error and the way out", err)
			}
		})
	}
}

// A program that did not import transport/verbs is told so, not that
// the host has no RDMA device.
func TestProviderReasonWithoutVerbs(t *testing.T) {
	t.Setenv("RDMAGRPC_PROVIDER", "")
	real := verbsLinked
	t.Cleanup(func() { verbsLinked = real })
	verbsLinked = func() bool { return false }
	l, err := Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := Dial(context.Background(), l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.(*Conn).Handshake(context.Background()); err != nil {
		t.Fatal(err)
	}
	s := c.(*Conn).Stats()
	if s.Provider != "shm" || !strings.Contains(s.ProviderReason, "no RDMA provider in this program") || !strings.Contains(s.ProviderReason, "transport/verbs") {
		t.Fatalf("provider %q, reason %q: want shm, and that transport/verbs was not imported", s.Provider, s.ProviderReason)
	}
}

// Over shm a connection lives on the device of its peer process (shm's
// per-peer isolation), on both ends.
func TestShmConnectionOnPeerDevice(t *testing.T) {
	a, b := conns(t, WithProvider("shm"))
	for _, c := range []*rdmaConn{a, b} {
		if d := c.Stats().Device; !strings.HasPrefix(d, "shm0/pid") {
			t.Errorf("connection on device %q, want the peer process's (shm0/pid…)", d)
		}
	}
}

// The opened marker sums the reason up for rdmatrace, from the phrases
// the per-connection choice words it with.
func TestReasonCode(t *testing.T) {
	pinned, free := &options{pinned: true}, &options{}
	for _, c := range []struct {
		why  string
		o    *options
		want uint32
	}{
		{"option", pinned, reasonPinned},
		{"the server is on this host " + whySameKernel + ": shared memory", free, reasonSameHost},
		{"the client is on this host " + whySameKernel + ": shared memory", free, reasonSameHost},
		{"RDMA device found; the server is on " + whyOtherHost, free, reasonOtherHost},
		{"RDMA device found", free, reasonDefault},
	} {
		if got := reasonCode(c.why, c.o); got != c.want {
			t.Errorf("reasonCode(%q) = %d, want %d", c.why, got, c.want)
		}
	}
}
