package verbs

// #include "shim.h"
import "C"

import (
	"net/netip"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// IPv4 returns the first IPv4 address in the GID table of port 1 of d (a
// RoCEv2 GID is an IPv4-mapped address of the netdev under the device).
// It is the address to Listen on and Connect to when d is a Soft-RoCE or
// RoCE device; ok is false for InfiniBand or a device of another provider.
func IPv4(d transport.Device) (addr netip.Addr, ok bool) {
	dv, isVerbs := d.(*device)
	if !isVerbs {
		return netip.Addr{}, false
	}
	var p C.struct_shim_port
	if C.shim_query_port(dv.ctx, port, &p) != 0 {
		return netip.Addr{}, false
	}
	var b [4]C.uint8_t
	// The IPv4 GIDs come first in practice; a table can hold thousands.
	for i := 0; i < min(int(p.gid_tbl_len), 16); i++ {
		if C.shim_query_gid_ipv4(dv.ctx, port, C.int(i), &b[0]) == 0 {
			return netip.AddrFrom4([4]byte{byte(b[0]), byte(b[1]), byte(b[2]), byte(b[3])}), true
		}
	}
	return netip.Addr{}, false
}
