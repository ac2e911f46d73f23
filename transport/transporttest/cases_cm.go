package transporttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Connection manager: private data, reject, refused, listener lifetime.
var cmCases = []*testCase{
	{
		name: "PrivateData",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, []byte("welcome"))
			got := ep.qp.PeerPrivate()
			if !bytes.HasPrefix(got, []byte("hello from the peer")) || len(got) < transport.PrivateLenConnect || !allZero(got[len("hello from the peer"):]) {
				t.Fatalf("connect private data %q, want the sent bytes then zeros up to %d", got, transport.PrivateLenConnect)
			}
			if ep.qp.RemoteAddr() == nil || ep.qp.LocalAddr() == nil {
				t.Fatal("QP without addresses")
			}
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, []byte("hello from the peer"))
			if err != nil {
				return err
			}
			defer ep.close()
			if got := ep.qp.PeerPrivate(); !bytes.HasPrefix(got, []byte("welcome")) || !allZero(got[7:]) {
				return fmt.Errorf("accept private data %q", got)
			}
			return p.okThenBye(ctx)
		},
	},
	{
		name: "Reject",
		local: func(t *testing.T, e *env) {
			r, err := e.l.Accept(e.ctx())
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.HasPrefix(r.PeerPrivate(), []byte("may I")) {
				t.Fatalf("request private data %q", r.PeerPrivate())
			}
			if err := r.Reject([]byte("go away")); err != nil {
				t.Fatal(err)
			}
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := newEndpoint(p.dev, setup{})
			if err != nil {
				return err
			}
			defer ep.close()
			qp, err := p.dev.Connect(ctx, p.addr, ep.cfg, []byte("may I"))
			if err == nil {
				qp.Close()
				return errors.New("connect succeeded, want a rejection")
			}
			var rej *transport.RejectError
			if !errors.As(err, &rej) || !bytes.HasPrefix(rej.Private, []byte("go away")) || !allZero(rej.Private[7:]) {
				return fmt.Errorf("connect error %v, want *RejectError with private data \"go away\"", err)
			}
			return p.ctl.sendf("ok")
		},
	},
	{
		name: "ConnRefused",
		local: func(t *testing.T, e *env) {
			l, err := e.dev.Listen(e.h.ListenAddr)
			if err != nil {
				t.Fatal(err)
			}
			addr := l.Addr().String()
			l.Close()
			ep, err := newEndpoint(e.dev, setup{})
			if err != nil {
				t.Fatal(err)
			}
			defer ep.close()
			qp, err := e.dev.Connect(e.ctx(), addr, ep.cfg, nil)
			if err == nil {
				qp.Close()
				t.Fatalf("connect to closed listener %s succeeded", addr)
			}
			if !errors.Is(err, transport.ErrConnRefused) {
				t.Fatalf("connect to closed listener: %v, want ErrConnRefused", err)
			}
		},
	},
	{
		name: "ListenPortZeroAndClose",
		local: func(t *testing.T, e *env) {
			l, err := e.dev.Listen(e.h.ListenAddr)
			if err != nil {
				t.Fatal(err)
			}
			_, port, err := net.SplitHostPort(l.Addr().String())
			if n, _ := strconv.Atoi(port); err != nil || n == 0 {
				t.Fatalf("listener address %v has no real port", l.Addr())
			}
			errc := make(chan error, 1)
			go func() { _, err := l.Accept(context.Background()); errc <- err }()
			time.Sleep(20 * time.Millisecond)
			l.Close()
			select {
			case err := <-errc:
				if !errors.Is(err, net.ErrClosed) {
					t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Close did not unblock Accept")
			}
		},
	},
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
