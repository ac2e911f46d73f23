package shm

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// 192.0.2.1 (TEST-NET-1) is nobody's address: shm must neither listen on
// it, as TCP cannot bind it, nor dial it and reach a local process that
// named its socket after it.
func TestForeignAddresses(t *testing.T) {
	p, err := transport.Get("shm")
	if err != nil {
		t.Fatal(err)
	}
	d, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	const foreign = "192.0.2.1:7000"
	if _, terr := net.Listen("tcp", foreign); !errors.Is(terr, syscall.EADDRNOTAVAIL) {
		t.Skipf("this host can bind %s over TCP (%v): not a foreign address here", foreign, terr)
	}
	if l, err := d.Listen(foreign); err == nil {
		l.Close()
		t.Fatalf("Listen(%s) succeeded", foreign)
	} else if !errors.Is(err, syscall.EADDRNOTAVAIL) {
		t.Fatalf("Listen(%s) = %v, want EADDRNOTAVAIL as TCP", foreign, err)
	}

	// A local process that bypasses Listen and names an abstract socket
	// after the foreign address is not reached.
	ul, err := listenUnix(sockName(netip.MustParseAddr("192.0.2.1"), 7000))
	if err != nil {
		t.Fatal(err)
	}
	defer ul.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		if c, err := ul.Accept(); err == nil {
			c.Close()
			accepted <- struct{}{}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if q, err := d.Connect(ctx, foreign, transport.QPConfig{}, nil); err == nil {
		q.Close()
		t.Fatalf("Connect(%s) succeeded", foreign)
	} else if !errors.Is(err, syscall.EADDRNOTAVAIL) {
		t.Fatalf("Connect(%s) = %v, want EADDRNOTAVAIL", foreign, err)
	}
	select {
	case <-accepted:
		t.Fatal("the dial reached the local socket named after the foreign address")
	case <-time.After(50 * time.Millisecond):
	}
}

func TestLocalAddresses(t *testing.T) {
	for _, s := range []string{"127.0.0.1", "127.0.0.2", "::1", "0.0.0.0"} {
		if !isLocal(netip.MustParseAddr(s)) {
			t.Errorf("isLocal(%s) = false", s)
		}
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			ip, _ := netip.AddrFromSlice(n.IP)
			ip = ip.Unmap()
			if ip.Is6() && ip.IsLinkLocalUnicast() {
				continue // needs its zone
			}
			if !isLocal(ip) {
				t.Errorf("isLocal(%v) = false for an address of an interface", ip)
			}
		}
	}
	for _, s := range []string{"192.0.2.1", "2001:db8::1", "fe80::1%no-such-if0"} {
		if isLocal(netip.MustParseAddr(s)) {
			t.Errorf("isLocal(%s) = true", s)
		}
	}
}

// listenUnix listens on name with Go's net, for tests that play a
// listener.
func listenUnix(name string) (*net.UnixListener, error) {
	return net.ListenUnix("unixpacket", &net.UnixAddr{Name: name, Net: "unixpacket"})
}
