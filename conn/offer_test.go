package conn

import (
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// playVerbs makes this process's "verbs" an RDMA provider of another
// family than shm where there is no device (an shm device under that name:
// it connects processes of this host, but the negotiation takes it for a
// provider that reaches other hosts). Where verbs is real (the rxe guest)
// it is left as it is. The provider is then chosen, not pinned.
func playVerbs(t *testing.T) {
	t.Setenv("RDMAGRPC_PROVIDER", "")
	if _, err := device("verbs"); err == nil {
		return
	}
	realOpen, realLinked := openDevice, verbsLinked
	t.Cleanup(func() { openDevice, verbsLinked = realOpen, realLinked })
	verbsLinked = func() bool { return true }
	openDevice = func(name string) (transport.Device, error) {
		if name == "verbs" {
			return realOpen(otherFamily{}.Name())
		}
		return realOpen(name)
	}
}

// echoOnce serves one connection of l: it echoes 5 bytes and returns the
// connection.
func echoOnce(t *testing.T, l net.Listener) <-chan *Conn {
	got := make(chan *Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(got)
			return
		}
		b := make([]byte, 5)
		if _, err := io.ReadFull(c, b); err == nil {
			c.Write(b)
		}
		got <- c.(*Conn)
	}()
	return got
}

func roundTrip(t *testing.T, c net.Conn) {
	t.Helper()
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 5)
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "hello" {
		t.Fatalf("echo: %q, %v", b, err)
	}
}

// A listener whose provider reaches other hosts serves the processes of
// its own kernel over shm, and any other client over its own provider;
// each end says why.
func TestOneListenerChoosesPerConnection(t *testing.T) {
	playVerbs(t)
	l, err := Listen(t.Context(), testAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.(*Listener).name != "verbs" || l.(*Listener).local == nil {
		t.Fatalf("listener on %q, shm side %v: want verbs with shm beside it", l.(*Listener).name, l.(*Listener).local)
	}
	for _, tc := range []struct {
		name        string
		otherHost   bool
		opts        []Option
		provider    string
		why, srvWhy string
	}{
		{"same host", false, nil, "shm", "same kernel", "same kernel"},
		{"another host", true, nil, "verbs", "another host", ""},
		{"pinned", false, []Option{WithProvider("verbs")}, "verbs", "option", ""},
		{"shm client of the same host", false, []Option{WithProvider("shm")}, "shm", "option", "same kernel"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ForgetServers()
			if tc.otherHost {
				real := clientHost
				t.Cleanup(func() { clientHost = real })
				clientHost = func() uint64 { return hostID() ^ 0x5a5a }
			}
			got := echoOnce(t, l)
			c, err := Dial(t.Context(), l.Addr().String(), tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			roundTrip(t, c)
			wantProvider(t, "client", c.(*Conn), tc.provider, tc.why)
			s := <-got
			if s == nil {
				t.Fatal("no connection accepted")
			}
			defer s.Close()
			wantProvider(t, "server", s, tc.provider, tc.srvWhy)
		})
	}
	// A dialer's peer check that refuses the shm listener moves it to
	// the next offer: verbs where it is real (the rxe guest); here,
	// where "verbs" is shm under another name, the check refuses that
	// too, and the connection stays on TCP.
	t.Run("peer check refuses shm", func(t *testing.T) {
		ForgetServers()
		want := "tcp"
		if _, err := device("verbs"); err == nil {
			want = "verbs"
		}
		refuse := WithPeerCheck(func(pid, uid, gid int) error { return errors.New("not this one") })
		got := echoOnce(t, l)
		c, err := Dial(t.Context(), l.Addr().String(), refuse)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		wantProvider(t, "client", c.(*Conn), want, "")
		if want == "verbs" {
			roundTrip(t, c)
			if s := <-got; s != nil {
				s.Close()
			}
		}
	})
	// A shm client of another host is offered nothing: stays TCP.
	t.Run("shm client of another host", func(t *testing.T) {
		ForgetServers()
		real := clientHost
		t.Cleanup(func() { clientHost = real })
		clientHost = func() uint64 { return hostID() ^ 0x5a5a }
		c, err := Dial(t.Context(), l.Addr().String(), WithProvider("shm"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		wantProvider(t, "client", c.(*Conn), "tcp", "another host")
	})
}

// A dialer never takes an shm offer from a listener of another kernel,
// whatever the listener says.
func TestShmOfferFromAnotherKernelIsSkipped(t *testing.T) {
	o := defaults()
	o.providerWhy = "RDMA device found"
	other := hostID() ^ 1
	offers, skipped, err := offersFrom(verdictOffers, encodeOffers(other, []uint32{shmCode, providerCode("verbs")}, []string{"127.0.0.1:1", "127.0.0.1:2"}), &o, "verbs")
	if err != nil {
		t.Fatal(err)
	}
	if len(offers) != 1 || offers[0].provider != "verbs" || !strings.Contains(skipped, "another kernel") {
		t.Fatalf("offers %+v, skipped %q: want verbs only, shm skipped", offers, skipped)
	}
	offers, _, _ = offersFrom(verdictOffers, encodeOffers(hostID(), []uint32{shmCode, providerCode("verbs")}, []string{"127.0.0.1:1", "127.0.0.1:2"}), &o, "verbs")
	if len(offers) != 2 || offers[0].provider != "shm" {
		t.Fatalf("offers %+v from this kernel: want shm, then verbs", offers)
	}
	o.pinned = true
	offers, _, _ = offersFrom(verdictOffers, encodeOffers(hostID(), []uint32{shmCode, providerCode("verbs")}, []string{"127.0.0.1:1", "127.0.0.1:2"}), &o, "verbs")
	if len(offers) != 1 || offers[0].provider != "verbs" {
		t.Fatalf("offers %+v to a pinned client: want verbs only", offers)
	}
}

// Malformed offers are an error, never a panic or a dial somewhere.
func TestDecodeOffersMalformed(t *testing.T) {
	good := encodeOffers(7, []uint32{1, 2}, []string{"a:1", "b:2"})
	for i := range len(good) {
		if _, _, _, err := decodeOffers(good[:i]); err == nil && i != 0 {
			t.Errorf("%d of %d bytes decoded without error", i, len(good))
		}
	}
	if _, _, _, err := decodeOffers(good + "x"); err == nil {
		t.Error("trailing byte accepted")
	}
	if _, _, _, err := decodeOffers(encodeOffers(7, make([]uint32, maxOffers+1), make([]string, maxOffers+1))); err == nil {
		t.Error("too many offers accepted")
	}
}

// The host id is this kernel's, the same in every process of it.
func TestHostIDIsBootID(t *testing.T) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		t.Skipf("no boot_id: %v", err)
	}
	if hostID() == 0 || len(strings.TrimSpace(string(b))) != 36 {
		t.Fatalf("host id %#x from boot_id %q", hostID(), b)
	}
}
