package conn

import (
	"context"
	"fmt"
	"io"
	"net"
	"time"
)

// A connection whose first bytes are not an HTTP/2 client's (TLS: grpc-go
// writes its ClientHello first) cannot be negotiated in-band: the
// negotiation's preface would reach a plain TLS server before the
// ClientHello, and that server closes the connection. So the question
// goes on a connection of its own, a probe, which carries only the
// negotiation's start. A plain server reads it as a bad first record and
// closes it; an rdmagrpc listener answers, and the probe is reset then,
// so that the listener drops it without an Accept. With an offer, the
// dial upgrades to the offered RDMA address directly, as a dial to a
// server it knows does, and its own TCP connection, on which nothing was
// sent, is reset; without one, that connection carries on untouched.

// probeTimeout bounds a probe, dial to answer, within the upgrade's
// context.
const probeTimeout = 5 * time.Second

// settleApart is the negotiation of a connection tc whose first bytes are
// not an HTTP/2 start: a probe, then an upgrade or tc as it is.
func settleApart(ctx context.Context, tc *net.TCPConn, addr string, o *options, name string) (verdict, error) {
	stay := func(why string) (verdict, error) {
		if o.noFallback {
			return verdict{}, fmt.Errorf("%w: %s", ErrNoRDMA, why)
		}
		return verdict{why: why, untouched: true}, nil
	}
	offers, skipped, err := probeServer(ctx, addr, o, name)
	if err != nil {
		if final(ctx, err) {
			return verdict{}, err
		}
		return stay(fmt.Sprintf("the first bytes written are not an HTTP/2 start (TLS, say), and a probe found no RDMA offer: %v", err))
	}
	c, upErr, err := upgradeFor(ctx, tc, addr, offers, skipped, o, name)
	switch {
	case err != nil:
		return verdict{}, err
	case c != nil:
		return verdict{rdma: c}, nil
	}
	return stay(fmt.Sprintf("the RDMA upgrade failed: %v", upErr))
}

// probeServer asks the server at addr, on a connection of its own,
// whether it offers RDMA to a client of the provider name, and returns its
// offers (offersFrom).
func probeServer(ctx context.Context, addr string, o *options, name string) ([]offer, string, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, "", ctxErr(ctx, fmt.Errorf("probe: %w", err))
	}
	defer nc.Close()
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(aLongTimeAgo) })
	defer stop()
	if _, err := nc.Write(startOf(o, name)); err != nil {
		return nil, "", ctxErr(ctx, fmt.Errorf("probe: %w", err))
	}
	var magic [len(replyMagic)]byte
	if _, err := io.ReadFull(nc, magic[:]); err != nil || string(magic[:]) != replyMagic {
		return nil, "", ctxErr(ctx, fmt.Errorf("probe: not an rdmagrpc server (%v)", err))
	}
	kind, payload, err := readReply(nc)
	nc.(*net.TCPConn).SetLinger(0) // a reset: the listener drops the probe at once
	switch {
	case err != nil:
		return nil, "", ctxErr(ctx, fmt.Errorf("probe: %w", err))
	case kind == verdictTCP:
		return nil, "", fmt.Errorf("the server offers no RDMA: %s", payload)
	}
	return offersFrom(kind, payload, o, name)
}
