package conn

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// setup applies the options and opens the chosen provider's device.
func setup(opts []Option) (*options, string, transport.Device, error) {
	o := defaults()
	for _, f := range opts {
		f(&o)
	}
	if err := o.validate(); err != nil {
		return nil, "", nil, err
	}
	if !o.noTelemetry {
		o.tel = telemetry.For(o.tracerProvider, o.meterProvider)
	}
	name, dev, err := pickProvider(&o)
	return &o, name, dev, err
}

// Dial connects to addr ("host:port", a DNS name or an IP literal,
// "[::1]:7000" for IPv6). Over TCP first, then RDMA when the listener
// there offers it (negotiate.go); to a plain gRPC server, or when RDMA
// cannot be had, the connection stays TCP (Stats().Provider "tcp"), unless
// WithoutFallback. WithoutTCP dials RDMA directly.
//
// Dial returns once TCP is connected: the negotiation runs behind it, as
// a crypto/tls Conn's handshake does, and its outcome (an upgrade, TCP,
// or an error such as a listener's refusal) comes with the first Read,
// Write or Stats, or from Handshake. A dial to a listener that offered
// RDMA before goes to it directly; where the provider can (shm), it
// returns once its request is queued for the listener, as a TCP dial
// returns once the kernel queued the connection, and the listener's
// answer, or its refusal, comes the same way. A dial WithoutFallback,
// whose error must come from Dial, returns when the RDMA connection is
// set up.
func Dial(ctx context.Context, addr string, opts ...Option) (net.Conn, error) {
	o, name, _, err := setup(opts)
	if err != nil {
		return nil, err
	}
	return dialWith(ctx, addr, o, name)
}

func dialWith(ctx context.Context, addr string, o *options, name string) (net.Conn, error) {
	var c *Conn
	var err error
	if o.noTCP {
		var r *rdmaConn
		if r, err = dialRDMA(ctx, addr, o, name, nil, nil); err == nil {
			c = wrapRDMA(r)
		}
	} else {
		c, err = dialNegotiated(ctx, addr, o, name)
	}
	if err != nil {
		return nil, timedOut(ctx, err)
	}
	return c, nil
}

// timedOut makes err, a dial's failure, pass both tests that callers of
// net.Dialer use for a dial its context's deadline cut short:
// errors.Is(err, context.DeadlineExceeded) and net.Error's Timeout.
// net.Dialer itself passes one or the other, depending on whether the
// socket's deadline or the context's timer fired first; a failure in the
// negotiation passed neither reliably.
func timedOut(ctx context.Context, err error) error {
	dl, ok := ctx.Deadline()
	if !ok || time.Now().Before(dl) || !errors.Is(err, os.ErrDeadlineExceeded) && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if oe, ok := err.(*net.OpError); ok {
		if _, done := oe.Err.(*deadlineError); !done {
			oe.Err = &deadlineError{oe.Err}
		}
		return oe
	}
	return &deadlineError{err}
}

// deadlineError is a dial's failure that its deadline caused.
type deadlineError struct{ err error }

func (e *deadlineError) Error() string   { return e.err.Error() }
func (e *deadlineError) Unwrap() []error { return []error{e.err, context.DeadlineExceeded} }
func (e *deadlineError) Timeout() bool   { return true }
func (e *deadlineError) Temporary() bool { return true }

// dialRDMA sets up an RDMA connection with the listener at addr. early,
// if not nil: return once the request is sent, where the provider can and
// the gate lets it, instead of after the listener's answer (establish);
// forget, if not nil, runs when such a connection then fails.
func dialRDMA(ctx context.Context, addr string, o *options, name string, early *earlyGate, forget func()) (*rdmaConn, error) {
	dev, err := openDevice(name)
	if err != nil {
		return nil, err
	}
	if o.peerCheck != nil {
		ctx = transport.ContextWithPeerCheck(ctx, o.peerCheck)
	}
	if _, ok := dev.(transport.EarlyConnector); !ok {
		early = nil
	}
	// Room in the gate first: the device's socket to the listener, once
	// connected, would wait on the listener's side meanwhile.
	if early != nil {
		if err := early.enter(ctx); err != nil {
			return nil, &net.OpError{Op: "dial", Net: "rdma", Err: err}
		}
	}
	leave := func() {
		if early != nil {
			early.leave()
		}
	}
	if r, ok := dev.(transport.Router); ok {
		if dev, err = r.DeviceFor(ctx, addr); err != nil {
			leave()
			return nil, &net.OpError{Op: "dial", Net: "rdma", Err: err}
		}
	}
	c, cfg, err := newConn(ctx, telemetry.Client, name, dev, o)
	if err != nil {
		leave()
		return nil, err
	}
	if ec, ok := dev.(transport.EarlyConnector); ok && early != nil {
		qp, err := ec.ConnectEarly(ctx, addr, cfg, c.hello().encode())
		if err != nil {
			early.leave()
			c.tel.Fail(err)
			c.release()
			return nil, &net.OpError{Op: "dial", Net: "rdma", Err: err}
		}
		c.setQP(qp)
		c.track() // RPCs may start before it opens (rpcstats.go)
		c.wg.Add(1)
		go c.establish(context.WithoutCancel(ctx), qp, early, forget)
		return c, nil
	}
	leave()
	qp, err := dev.Connect(ctx, addr, cfg, c.hello().encode())
	if err != nil {
		err = rejected(err)
		c.tel.Fail(err)
		c.release()
		return nil, &net.OpError{Op: "dial", Net: "rdma", Err: err}
	}
	c.qp = qp
	peer, err := decodeHello(qp.PeerPrivate())
	if err == nil {
		err = c.start(qp, peer)
	}
	if err != nil {
		c.tel.Fail(err)
		c.release()
		return nil, &net.OpError{Op: "dial", Net: "rdma", Addr: qp.RemoteAddr(), Err: err}
	}
	return c, nil
}

// rejected names why a listener refused a connection, when it said.
func rejected(err error) error {
	var rej *transport.RejectError
	if !errors.As(err, &rej) {
		return err
	}
	if isBacklogFull(rej.Private) {
		return fmt.Errorf("%w: %w", ErrBacklogFull, err)
	}
	if why, ok := bytes.CutPrefix(rej.Private, transport.RejectPeerRefused); ok {
		return fmt.Errorf("%w (%s): %w", ErrPeerRefused, bytes.TrimRight(why, "\x00"), err)
	}
	if why, ok := bytes.CutPrefix(rej.Private, transport.RejectListenerFailed); ok {
		return fmt.Errorf("conn: the listener could not take the connection (%s): %w", bytes.TrimRight(why, "\x00"), err)
	}
	return err
}

// Dialer returns a dial function for grpc.WithContextDialer. Its
// connections share the options it was given, applied once (every
// connection keeps them: a copy each cost every idle client end 280 B);
// a failure to apply them, such as a provider that cannot be opened, is
// tried again at the next dial.
func Dialer(opts ...Option) func(context.Context, string) (net.Conn, error) {
	var (
		mu   sync.Mutex
		o    *options
		name string
	)
	return func(ctx context.Context, addr string) (net.Conn, error) {
		mu.Lock()
		if o == nil {
			so, sname, _, err := setup(opts)
			if err != nil {
				mu.Unlock()
				return nil, err
			}
			o, name = so, sname
		}
		so, sname := o, name
		mu.Unlock()
		return dialWith(ctx, addr, so, sname)
	}
}

// Listener accepts rdmagrpc connections; it implements net.Listener.
type Listener struct {
	l   transport.Listener
	tcp *net.TCPListener // the TCP side (nil: WithoutTCP)
	// local is an shm side beside l for the clients of this kernel
	// (offer.go); nil: none.
	local *side
	// negotiations counts the TCP connections that spoke our SETTINGS
	// parameter (tests: a known server is dialed directly).
	negotiations atomic.Int64
	dev          transport.Device
	name         string
	o            *options
	// backlog holds a token per connection being set up or set up and
	// not yet taken by Accept: each holds a queue pair and registered
	// memory, so a burst of dials must not pin them without bound.
	backlog chan struct{}
	conns   chan *Conn
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	once    sync.Once
}

// Listen listens on addr ("host:port"; port 0 picks one, see Addr): over
// TCP, where plain gRPC clients are served as they are and rdmagrpc
// clients are offered RDMA, and over the RDMA provider, on the same port
// when its port space has it free, else on one it picks (the offer names
// it). WithoutTCP: RDMA only, on addr.
func Listen(ctx context.Context, addr string, opts ...Option) (net.Listener, error) {
	o, name, dev, err := setup(opts)
	if err != nil {
		return nil, err
	}
	var tcpL *net.TCPListener
	rdmaAddr := addr
	host, _, _ := net.SplitHostPort(addr)
	if !o.noTCP {
		var lc net.ListenConfig
		nl, err := lc.Listen(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		tcpL = nl.(*net.TCPListener)
		_, port, _ := net.SplitHostPort(tcpL.Addr().String())
		rdmaAddr = net.JoinHostPort(host, port)
	}
	tl, err := dev.Listen(rdmaAddr)
	if err != nil && tcpL != nil {
		tl, err = dev.Listen(net.JoinHostPort(host, "0"))
	}
	if err != nil {
		if tcpL != nil {
			tcpL.Close()
		}
		return nil, &net.OpError{Op: "listen", Net: "rdma", Err: err}
	}
	if o.peerCheck != nil {
		pc, ok := tl.(transport.PeerChecker)
		if !ok {
			tl.Close()
			if tcpL != nil {
				tcpL.Close()
			}
			return nil, &net.OpError{Op: "listen", Net: "rdma", Err: fmt.Errorf("conn: WithPeerCheck: the %s provider's peers are not processes of this host; the kernel cannot say who they are", name)}
		}
		pc.SetPeerCheck(o.peerCheck)
	}
	lctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	l := &Listener{l: tl, tcp: tcpL, dev: dev, name: name, o: o, backlog: make(chan struct{}, o.backlog), conns: make(chan *Conn), ctx: lctx, cancel: cancel}
	_, port, _ := net.SplitHostPort(rdmaAddr)
	l.listenLocal(host, port)
	l.serve(&side{l: tl, dev: dev, name: name})
	if l.local != nil {
		l.serve(l.local)
	}
	if tcpL != nil {
		l.wg.Add(1)
		go l.serveTCP()
	}
	return l, nil
}

// serve answers the connection requests of one side: on the provider's
// goroutine where it has one (transport.RequestHandler, whose Close waits
// for it, before l.wg.Wait), else on an accept loop of ours.
func (l *Listener) serve(s *side) {
	if rh, ok := s.l.(transport.RequestHandler); ok {
		rh.HandleRequests(func(req transport.ConnRequest) {
			if l.admit(req) {
				l.handshake(req, s)
			}
		})
		return
	}
	l.wg.Add(1)
	go l.acceptLoop(s)
}

func (l *Listener) acceptLoop(s *side) {
	defer l.wg.Done()
	for {
		req, err := s.l.Accept(l.ctx)
		if err != nil {
			return
		}
		if !l.admit(req) {
			continue
		}
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.handshake(req, s)
		}()
	}
}

// admit takes a backlog token for req, or refuses it.
func (l *Listener) admit(req transport.ConnRequest) bool {
	select {
	case l.backlog <- struct{}{}:
		return true
	default:
		// Full: refuse now, so the dialer learns it at once rather
		// than at its time-out, and nothing is set up for it.
		req.Reject(transport.RejectBacklogFull)
		l.refused(req, ErrBacklogFull)
		return false
	}
}

// handshake answers one request to side s, holding its backlog token; a
// bad one is rejected, never fatal to the listener.
func (l *Listener) handshake(req transport.ConnRequest, s *side) {
	taken := false // by Accept, with its backlog token
	defer func() {
		if !taken {
			<-l.backlog
		}
	}()
	peer, err := decodeHello(req.PeerPrivate())
	if err != nil {
		req.Reject(nil)
		l.refused(req, err)
		return
	}
	dev := s.dev
	if rd, ok := req.(transport.RequestDevice); ok {
		dev = rd.Device()
	}
	c, cfg, err := newConn(withProviderWhy(context.Background(), s.why), telemetry.Server, s.name, dev, l.o)
	if err != nil {
		req.Reject(nil)
		l.refused(req, err)
		return
	}
	qp, err := req.Accept(l.ctx, cfg, c.hello().encode())
	if err != nil {
		c.tel.Fail(err)
		c.release()
		l.refused(req, err)
		return
	}
	c.qp = qp
	if err := c.start(qp, peer); err != nil {
		c.tel.Fail(err)
		c.release()
		l.refused(req, err)
		return
	}
	select {
	case l.conns <- wrapRDMA(c):
		taken = true
	case <-l.ctx.Done():
		c.Close()
	}
}

// refused logs, at debug level, a connection request the listener did not
// set up: its dialer learns why from its own error, the server's
// operator only from here.
func (l *Listener) refused(req transport.ConnRequest, err error) {
	if lg := l.o.log(); lg.Enabled(context.Background(), slog.LevelDebug) {
		lg.Debug("rdmagrpc: connection request not accepted", "listener", l.Addr().String(), "from", req.RemoteAddr().String(), "err", err)
	}
}

// Accept waits for the next connection.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		<-l.backlog
		return c, nil
	case <-l.ctx.Done():
		return nil, &net.OpError{Op: "accept", Net: "rdma", Addr: l.Addr(), Err: net.ErrClosed}
	}
}

// Close stops listening; connections already accepted stay open.
func (l *Listener) Close() error {
	err := net.ErrClosed
	l.once.Do(func() {
		l.cancel()
		err = l.l.Close()
		if l.local != nil {
			err = errors.Join(err, l.local.l.Close())
		}
		if l.tcp != nil {
			err = errors.Join(err, l.tcp.Close())
		}
		l.wg.Wait()
	})
	if err != nil {
		return fmt.Errorf("conn: close listener: %w", err)
	}
	return nil
}

// Addr is the listener's one address: its TCP side's, or with WithoutTCP
// its RDMA provider's.
func (l *Listener) Addr() net.Addr {
	if l.tcp != nil {
		return l.tcp.Addr()
	}
	return l.l.Addr()
}

// ErrPeerRefused is what a dial refused by the listener's peer check
// wraps (shm: by default a listener admits only its own user's processes;
// see WithPeerCheck).
var ErrPeerRefused = errors.New("conn: the listener refused this process")

// ErrListenerRefused is what a dial wraps when the process listening at
// the address failed this dial's peer check (shm: by default a dial
// admits only a listener of its own user; see WithPeerCheck). Nothing was
// sent to it.
var ErrListenerRefused = transport.ErrListenerRefused

// ErrBacklogFull is what a dial refused by a full accept backlog wraps
// (WithBacklog): the listener accepts more slowly than it is dialed. A
// later dial may succeed.
var ErrBacklogFull = errors.New("conn: the listener's accept backlog is full (it accepts more slowly than it is dialed)")

func isBacklogFull(private []byte) bool {
	return bytes.HasPrefix(private, transport.RejectBacklogFull)
}
