package transport

import (
	"fmt"
	"net"
	"strconv"
	"syscall"
)

// ZoneIndex turns an IPv6 zone (an interface name, or its index as
// net.ParseIP's callers may write it) into the scope id of a
// sockaddr_in6, for providers that build socket addresses themselves.
// An unknown zone wraps EADDRNOTAVAIL, as the kernel answers a bind to it.
func ZoneIndex(zone string) (int, error) {
	if ifi, err := net.InterfaceByName(zone); err == nil {
		return ifi.Index, nil
	}
	if n, err := strconv.Atoi(zone); err == nil && n > 0 {
		return n, nil
	}
	return 0, fmt.Errorf("unknown IPv6 zone %q: no such interface: %w", zone, syscall.EADDRNOTAVAIL)
}
