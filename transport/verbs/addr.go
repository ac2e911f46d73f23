package verbs

// #include "shim.h"
// #include <sys/socket.h>
import "C"

import (
	"fmt"
	"net"
	"net/netip"
	"syscall"
)

func toShimAddr(ap netip.AddrPort) C.struct_shim_addr {
	var a C.struct_shim_addr
	a.port = C.uint16_t(ap.Port())
	ip := ap.Addr().Unmap()
	if ip.Is4() {
		a.family = C.AF_INET
		b := ip.As4()
		for i := range b {
			a.ip[i] = C.uint8_t(b[i])
		}
	} else {
		a.family = C.AF_INET6
		b := ip.As16()
		for i := range b {
			a.ip[i] = C.uint8_t(b[i])
		}
	}
	return a
}

// fromShimAddr returns a *net.TCPAddr: rdma_cm's RDMA_PS_TCP port space
// mirrors TCP ports, and grpc-go treats TCP addresses well (peer info,
// local credentials).
func fromShimAddr(a *C.struct_shim_addr) net.Addr {
	switch a.family {
	case C.AF_INET:
		ip := make(net.IP, 4)
		for i := range ip {
			ip[i] = byte(a.ip[i])
		}
		return &net.TCPAddr{IP: ip, Port: int(a.port)}
	case C.AF_INET6:
		ip := make(net.IP, 16)
		for i := range ip {
			ip[i] = byte(a.ip[i])
		}
		return &net.TCPAddr{IP: ip, Port: int(a.port)}
	}
	return &net.TCPAddr{}
}

// parseListenAddr accepts "host:port" with a literal IP or an empty host
// (all addresses), like net.Listen("tcp", ...).
func parseListenAddr(addr string) (netip.AddrPort, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("verbs: listen address %q: %w", addr, err)
	}
	p, err := net.LookupPort("tcp", port)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("verbs: listen address %q: %w", addr, err)
	}
	if host == "" {
		return netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(p)), nil
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		ips, lerr := net.LookupIP(host)
		if lerr != nil || len(ips) == 0 {
			return netip.AddrPort{}, fmt.Errorf("verbs: listen address %q: cannot resolve host: %w", addr, syscall.EADDRNOTAVAIL)
		}
		ip, _ = netip.AddrFromSlice(ips[0])
	}
	return netip.AddrPortFrom(ip.Unmap(), uint16(p)), nil
}
