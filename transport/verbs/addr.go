package verbs

// #include "shim.h"
// #include <sys/socket.h>
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"syscall"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func toShimAddr(ap netip.AddrPort) (C.struct_shim_addr, error) {
	var a C.struct_shim_addr
	a.port = C.uint16_t(ap.Port())
	ip := ap.Addr().Unmap()
	if ip.Is4() {
		a.family = C.AF_INET
		b := ip.As4()
		for i := range b {
			a.ip[i] = C.uint8_t(b[i])
		}
		return a, nil
	}
	a.family = C.AF_INET6
	b := ip.As16()
	for i := range b {
		a.ip[i] = C.uint8_t(b[i])
	}
	if z := ip.Zone(); z != "" {
		idx, err := transport.ZoneIndex(z)
		if err != nil {
			return a, fmt.Errorf("verbs: address %v: %w", ap, err)
		}
		a.scope_id = C.uint32_t(idx)
	}
	return a, nil
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
		ta := &net.TCPAddr{IP: ip, Port: int(a.port)}
		if a.scope_id != 0 {
			ta.Zone = strconv.Itoa(int(a.scope_id))
			if ifi, err := net.InterfaceByIndex(int(a.scope_id)); err == nil {
				ta.Zone = ifi.Name
			}
		}
		return ta
	}
	return &net.TCPAddr{}
}

// resolveHostPort turns "host:port" into one address, as net.Dial and
// net.Listen do for "tcp": a literal IP (an IPv6 one keeps its zone, so
// link-local addresses work), an empty host (all addresses: listeners
// only), or a name, IPv4 preferred (RoCE deployments and Soft-RoCE are
// configured with IPv4 GIDs) — the same choice for Listen and Dial, so
// that both ends of one name agree.
func resolveHostPort(ctx context.Context, addr string, listen bool) (netip.AddrPort, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("verbs: address %q: %w", addr, err)
	}
	port, err := net.DefaultResolver.LookupPort(ctx, "tcp", portStr)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("verbs: address %q: %w", addr, err)
	}
	if host == "" {
		if !listen {
			return netip.AddrPort{}, fmt.Errorf("verbs: address %q: no host to connect to", addr)
		}
		return netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(port)), nil
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return netip.AddrPortFrom(ip.Unmap(), uint16(port)), nil
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil || len(ips) == 0 {
		if err == nil {
			err = errors.New("no addresses")
		}
		if listen {
			err = fmt.Errorf("%w (%v)", syscall.EADDRNOTAVAIL, err)
		}
		return netip.AddrPort{}, fmt.Errorf("verbs: address %q: cannot resolve host: %w", addr, err)
	}
	best := ips[0].Unmap()
	for _, ip := range ips {
		if ip.Unmap().Is4() {
			best = ip.Unmap()
			break
		}
	}
	return netip.AddrPortFrom(best, uint16(port)), nil
}
