package rxe

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"
)

// Addresses of the guests: a single guest gets GuestAddrA on a dummy
// netdev; a pair gets A and B on e1000 NICs joined by a qemu UDP socket.
const (
	GuestAddrA = "10.99.0.1"
	GuestAddrB = "10.99.0.2"
)

// PairGrace is how long the other guest of a pair may go on after one
// guest failed (non-zero exit or harness error) before it is stopped: a
// server whose client died would otherwise wait for the whole deadline.
var PairGrace = 15 * time.Second

// RunOne boots one guest with rxe0 on a dummy netdev (RXE_ADDR and
// RXE_PEER are both GuestAddrA) and runs p. A non-zero exit of the
// payload is reported in Result.ExitCode, not as an error; errors mean
// the harness or the guest failed (or ctx ended; qemu is then killed).
func (img *Image) RunOne(ctx context.Context, p Payload) (Result, error) {
	return img.runGuest(ctx, guestSpec{
		payload: p,
		net:     netConfig{netdev: "d0", addr: GuestAddrA, peer: GuestAddrA, role: "single"},
	})
}

// RunPair boots two guests joined by an emulated Ethernet link, each with
// rxe0 on its eth0, and runs a in the first (RXE_ADDR=GuestAddrA,
// RXE_PEER=GuestAddrB) and b in the second (the reverse) at the same
// time. The payloads synchronise by themselves (a client retries until
// its server listens). Both results are returned; the error joins the
// harness errors of both guests.
func (img *Image) RunPair(ctx context.Context, a, b Payload) (Result, Result, error) {
	pa, pb, err := freeUDPPorts()
	if err != nil {
		return Result{}, Result{}, err
	}
	nic := func(local, remote int, mac string) []string {
		return []string{
			"-netdev", fmt.Sprintf("socket,id=n0,udp=127.0.0.1:%d,localaddr=127.0.0.1:%d", remote, local),
			// romfile= : no PXE option ROM needed, and ipxe-qemu may be absent.
			"-device", "e1000,netdev=n0,romfile=,mac=" + mac,
		}
	}
	specs := [2]guestSpec{
		{payload: a, net: netConfig{netdev: "eth0", addr: GuestAddrA, peer: GuestAddrB, role: "a"},
			nic: nic(pa, pb, "52:54:00:99:00:01")},
		{payload: b, net: netConfig{netdev: "eth0", addr: GuestAddrB, peer: GuestAddrA, role: "b"},
			nic: nic(pb, pa, "52:54:00:99:00:02")},
	}
	var (
		res  [2]Result
		errs [2]error
		wg   sync.WaitGroup
	)
	ctxs := [2]context.Context{}
	cancels := [2]context.CancelFunc{}
	for i := range specs {
		ctxs[i], cancels[i] = context.WithCancel(ctx)
		defer cancels[i]()
	}
	var timers [2]*time.Timer
	for i := range specs {
		wg.Go(func() {
			res[i], errs[i] = img.runGuest(ctxs[i], specs[i])
			if errs[i] != nil || res[i].ExitCode != 0 {
				timers[i] = time.AfterFunc(PairGrace, cancels[1-i])
			}
		})
	}
	wg.Wait()
	for _, t := range timers {
		if t != nil {
			t.Stop()
		}
	}
	var err2 error
	switch {
	case errs[0] != nil && errs[1] != nil:
		err2 = fmt.Errorf("%w; %w", errs[0], errs[1])
	case errs[0] != nil:
		err2 = errs[0]
	case errs[1] != nil:
		err2 = errs[1]
	}
	return res[0], res[1], err2
}

// freeUDPPorts asks the kernel for two unused UDP ports on loopback. They
// are released before qemu binds them; a collision in between is unlikely
// and shows up as a qemu start error.
func freeUDPPorts() (int, int, error) {
	var ports [2]int
	var conns []net.PacketConn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range ports {
		c, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			return 0, 0, fmt.Errorf("rxe: pick UDP port: %w", err)
		}
		conns = append(conns, c)
		ports[i] = c.LocalAddr().(*net.UDPAddr).Port
	}
	return ports[0], ports[1], nil
}
