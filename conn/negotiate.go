package conn

// Mixed fleets: every connection starts over TCP, as Linux SMC-R's do
// (RFC 7609), and is upgraded to RDMA in band when both ends agree.
//
// SMC-R offers the capability in a TCP option of the SYN, which user space
// cannot set. The stream gRPC speaks has its own extension point instead:
// HTTP/2 requires an endpoint to ignore SETTINGS parameters it does not
// know (RFC 9113 §6.5.2), and reserves 0xf000–0xffff for experiments. So
// an rdmagrpc client opens with exactly what any gRPC client sends, the
// HTTP/2 client preface and a SETTINGS frame, whose two parameters from
// that range say "rdmagrpc, version 1, provider P":
//
//   - A plain gRPC server (grpc-go, or any HTTP/2 server) ignores them
//     and answers with its own SETTINGS. Those first bytes are not our
//     reply magic, so the client keeps this very TCP connection, hands
//     the bytes read to grpc-go, and drops grpc-go's own copy of the
//     preface from its first write. A fall-back costs no time-out and no
//     second connection: one round trip that grpc-go needs anyway.
//   - An rdmagrpc listener reads the preface and the SETTINGS frame
//     (which every HTTP/2 client sends at once, so this never waits on a
//     client that waits for us). Without our parameter it is a plain
//     client: the connection goes to Accept as it is, the bytes read
//     replayed. With it, the listener answers with its reply (not HTTP/2:
//     the client said it understands it): an offer of its RDMA listener's
//     address when the providers match, else "stay on TCP" and why.
//   - On an offer the client dials RDMA (bounded by WithUpgradeTimeout).
//     Success: it resets the TCP connection, the listener sees it go and
//     the RDMA connection is the one Accept returns. Failure: it sends
//     stayTCP and both ends carry on over TCP; the listener replays the
//     client's SETTINGS to grpc-go (harmless: its parameters are ignored,
//     and grpc-go ignores the extra SETTINGS acknowledgement).
//
// All of it runs behind the dial (lazy.go): Dial returns once TCP is
// connected, the client's writes wait in its memory until the answer, and
// its reads wait for it, so a dial costs what a TCP dial costs and the
// answer's round trip overlaps the one grpc-go waits for anyway (the
// server's SETTINGS). A client that cannot reach the TCP side at all
// (connection refused: a listener made WithoutTCP, or an older rdmagrpc)
// dials RDMA directly.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

const (
	h2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

	h2FrameSettings = 0x4
	// Our SETTINGS parameters, from HTTP/2's experimental range.
	settingHello    = 0xf0d3 // value settingMagic
	settingProvider = 0xf0d4 // value providerCode(the client's provider)
	settingAlso     = 0xf0d5 // repeated: another provider the client dials
	settingHostHi   = 0xf0d6 // the client's kernel (hostID), high 32 bits
	settingHostLo   = 0xf0d7 // and low 32 bits
	settingMagic    = 0x52444701

	replyMagic = "RDMG"
	// replyVersion is the negotiation's version, in the reply.
	replyVersion = 1
	verdictRDMA  = 'R' // payload: the RDMA listener's host:port
	verdictTCP   = 'T' // payload: why not
	// verdictOffers answers a client that said which kernel it runs on:
	// the listeners it may dial, in order (offer.go).
	verdictOffers = 'O'
	// stayTCP is the client's word after a failed upgrade.
	stayTCP = 'T'

	// sniffTimeout bounds how long a listener waits for a TCP client's
	// first bytes; one that sends nothing by then (not an HTTP/2 client)
	// is handed to Accept as it is.
	sniffTimeout = 10 * time.Second
	// maxReply bounds the reply payload a client reads.
	maxReply = 1 << 10
	// maxOffers bounds the offers of a reply 'O' (offer.go).
	maxOffers = 4
)

// aLongTimeAgo is a deadline in the past: setting it wakes a blocked I/O.
var aLongTimeAgo = time.Unix(1, 0)

// DefaultUpgradeTimeout: see WithUpgradeTimeout.
const DefaultUpgradeTimeout = 2 * time.Second

func providerCode(name string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(name))
	return h.Sum32()
}

// readReply reads the listener's reply after its magic.
func readReply(r io.Reader) (verdict byte, payload string, err error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, "", err
	}
	if h[0] != replyVersion {
		return 0, "", fmt.Errorf("conn: negotiation version %d, want %d", h[0], replyVersion)
	}
	n := int(binary.BigEndian.Uint16(h[2:]))
	if n > maxReply {
		return 0, "", fmt.Errorf("conn: negotiation reply of %d bytes (at most %d)", n, maxReply)
	}
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		return 0, "", err
	}
	if h[1] != verdictRDMA && h[1] != verdictTCP && h[1] != verdictOffers {
		return 0, "", fmt.Errorf("conn: negotiation verdict %q unknown", h[1])
	}
	return h[1], string(p), nil
}

// ErrNoRDMA is what a dial WithoutFallback wraps when the server cannot be
// reached over RDMA.
var ErrNoRDMA = errors.New("conn: no RDMA to this server (WithoutFallback)")

// failedUpgrades remembers RDMA addresses an upgrade could not reach, so
// that only the first dial pays WithUpgradeTimeout: later ones stay on TCP
// at once until the entry expires.
var failedUpgrades = struct {
	sync.Mutex
	m map[string]time.Time
}{m: map[string]time.Time{}}

const failedUpgradeTTL = 30 * time.Second

func upgradeFailedRecently(addr string) bool {
	failedUpgrades.Lock()
	defer failedUpgrades.Unlock()
	t, ok := failedUpgrades.m[addr]
	if ok && time.Since(t) > failedUpgradeTTL {
		delete(failedUpgrades.m, addr)
		return false
	}
	return ok
}

func noteFailedUpgrade(addr string) {
	failedUpgrades.Lock()
	defer failedUpgrades.Unlock()
	if len(failedUpgrades.m) > 4096 {
		clear(failedUpgrades.m)
	}
	failedUpgrades.m[addr] = time.Now()
}

// knownServers remembers, per dialed address and provider, the RDMA
// listener a negotiation there found on the dialed port: the next dials
// go to it directly and skip the TCP leg (a TCP connect and a round
// trip per dial). The entry goes at the first failure, and that dial negotiates
// again, so a server that stopped being rdmagrpc costs one failed RDMA
// dial (on shm an immediate refusal; on verbs at most WithUpgradeTimeout).
// A server that stays TCP is not remembered: its negotiation runs behind
// the dial and costs it nothing (lazy.go).
var knownServers = struct {
	sync.Mutex
	m map[[2]string]*knownServer
}{m: map[[2]string]*knownServer{}}

// knownServer is an RDMA listener dialed directly, and its dials that
// returned before its answer. A failure forgets it (known false) but
// keeps the entry, so that the count of its dials still in flight
// carries over to the next negotiation's verdict: deleted, a new entry
// started again at zero while the old dials still waited, and each
// refusal of a full backlog let a client run maxEarly more ahead.
type knownServer struct {
	offer
	known bool
	early earlyGate
}

// earlyGate bounds a server's dials that returned before its answer
// (dialRDMA's early path). Without a bound a client dialing in a loop ran
// thousands of requests ahead of the listener, and about one connection
// in ten of a loop of 10,000 failed after its dial had returned (the
// answer too late, the backlog full, the listener out of descriptors).
// Beyond maxEarly a dial waits for room, as a TCP dial waits in connect
// while the listener's queue is full, so one client process cannot fill a
// backlog of more (somaxconn, 4096 by default). The bound is generous
// (256) so that a client dialing in a loop and its listener alternate
// less between working and waiting.
type earlyGate struct{ sem chan struct{} }

const maxEarly = 256

func newEarlyGate() earlyGate { return earlyGate{sem: make(chan struct{}, maxEarly)} }

// enter takes a place in the gate, waiting for one until ctx ends.
func (g *earlyGate) enter(ctx context.Context) error {
	select {
	case g.sem <- struct{}{}:
		return nil
	default:
	}
	select {
	case g.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("conn: %d dials to this server wait for its answer: %w", maxEarly, ctx.Err())
	}
}

func (g *earlyGate) leave() { <-g.sem }

// inFlight is the number of dials in the gate.
func (g *earlyGate) inFlight() int { return len(g.sem) }

// ForgetServers drops what earlier dials learned about servers (an RDMA
// listener to dial directly, an upgrade that timed out), so that the next
// dial to each negotiates afresh. Dials keep this up to date themselves,
// from every change they see; ForgetServers is for a program that knows
// better (a fleet changed under it) and for timing first dials.
func ForgetServers() {
	knownServers.Lock()
	clear(knownServers.m)
	knownServers.Unlock()
	failedUpgrades.Lock()
	clear(failedUpgrades.m)
	failedUpgrades.Unlock()
}

// rememberServer notes that a client of provider name reached the server
// at addr through the offer of.
func rememberServer(addr, name string, of offer) {
	// Only an RDMA listener on the dialed port is the same server for
	// sure later; one on a port of its own may be another process's by
	// the next dial.
	_, p1, err1 := net.SplitHostPort(addr)
	_, p2, err2 := net.SplitHostPort(of.addr)
	if err1 != nil || err2 != nil || p1 != p2 {
		return
	}
	knownServers.Lock()
	defer knownServers.Unlock()
	k := [2]string{addr, name}
	if s, ok := knownServers.m[k]; ok && s.offer == of {
		s.known = true // its gate counts dials in flight
		return
	}
	if len(knownServers.m) >= 4096 {
		clear(knownServers.m)
	}
	knownServers.m[k] = &knownServer{offer: of, known: true, early: newEarlyGate()}
}

func lookupServer(addr, provider string) (*knownServer, bool) {
	knownServers.Lock()
	defer knownServers.Unlock()
	s, ok := knownServers.m[[2]string{addr, provider}]
	if !ok || !s.known {
		return nil, false
	}
	return s, true
}

func forgetServer(addr, provider string) {
	knownServers.Lock()
	defer knownServers.Unlock()
	if s, ok := knownServers.m[[2]string{addr, provider}]; ok {
		s.known = false
	}
}

// dialNegotiated is Dial's default path: TCP first, then RDMA if the
// listener offers it (see the top of this file); straight to RDMA where
// the listener at addr offered it before. The negotiation runs behind
// the dial (lazy.go): Dial returns once TCP is connected, as net.Dial
// does, except WithoutFallback, whose dial must fail when there is no
// RDMA and so waits for the answer.
func dialNegotiated(ctx context.Context, addr string, o *options, name string) (*Conn, error) {
	if known, ok := lookupServer(addr, name); ok {
		// Early unless WithoutFallback, whose errors must come from Dial:
		// a failure after the request went out comes with the first
		// call, as TCP's reset, and the next dial negotiates afresh.
		var gate *earlyGate
		if !o.noFallback {
			gate = &known.early
		}
		c, _, err := upgrade(withProviderWhy(ctx, known.why), known.addr, o, known.provider, gate, func() { forgetServer(addr, name) })
		if err == nil {
			return wrapRDMA(c), nil
		}
		forgetServer(addr, name)
		if final(ctx, err) {
			return nil, err
		}
		// Gone or changed: negotiate afresh.
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			// Nothing on the TCP side: a listener WithoutTCP, or one of
			// an rdmagrpc older than the TCP side.
			c, rerr := dialRDMA(ctx, addr, o, name, nil, nil)
			if rerr == nil {
				return wrapRDMA(c), nil
			}
			if listenerAnswered(rerr) {
				return nil, rerr
			}
			return nil, &dialError{tcp: err, rdma: rerr}
		}
		return nil, err
	}
	tc := nc.(*net.TCPConn)
	if !o.noFallback {
		return &Conn{tcp: dialBehind(tc, addr, o, name)}, nil
	}
	// The dial's context bounds the negotiation: it cuts the socket's
	// deadline short. A connection returned after that fired is unusable.
	stop := context.AfterFunc(ctx, func() { tc.SetDeadline(aLongTimeAgo) })
	if dl, ok := ctx.Deadline(); ok {
		tc.SetDeadline(dl)
	}
	v, err := settle(ctx, tc, addr, o, name)
	if !stop() && err == nil {
		if v.rdma != nil {
			v.rdma.Close()
		}
		err = ctx.Err()
	}
	if err != nil {
		tc.Close()
		return nil, &net.OpError{Op: "dial", Net: "tcp", Source: tc.LocalAddr(), Addr: tc.RemoteAddr(), Err: err}
	}
	return wrapRDMA(v.rdma), nil // WithoutFallback: settle never stays on TCP
}

// dialError is a dial that nothing answered, over TCP nor directly over
// RDMA. It is the TCP error, to errors.Is and errors.As and as a
// net.Error, as net.Dial's would be (grpc-go's back-off and users' retry
// code look for syscall.ECONNREFUSED); its text gives the RDMA attempt's
// reason too.
type dialError struct{ tcp, rdma error }

func (e *dialError) Error() string {
	return e.tcp.Error() + " (and directly over RDMA: " + e.rdma.Error() + ")"
}

func (e *dialError) Unwrap() error { return e.tcp }

func (e *dialError) Timeout() bool {
	var ne net.Error
	return errors.As(e.tcp, &ne) && ne.Timeout()
}

// Temporary is net.Error's; deprecated there, false here.
func (e *dialError) Temporary() bool { return false }

// listenerAnswered: err is an RDMA listener's answer (a refusal of this
// process, a full backlog, a rejection), which says more than TCP's
// refusal.
func listenerAnswered(err error) bool {
	var rej *transport.RejectError
	return errors.As(err, &rej) || errors.Is(err, ErrPeerRefused) || errors.Is(err, ErrListenerRefused) || errors.Is(err, ErrBacklogFull)
}

// verdict is what a negotiation found: an upgraded connection, or the
// TCP connection stays, with the server's bytes already read and why.
type verdict struct {
	rdma   *rdmaConn
	replay []byte
	why    string
	// untouched: nothing of the negotiation went on the TCP connection
	// (settleApart), so the user's bytes go out as written.
	untouched bool
}

// settle is the client's side of a negotiation on tc: our start, the
// server's answer, and the RDMA dial it offers. Staying on TCP is an
// ErrNoRDMA error WithoutFallback.
func settle(ctx context.Context, tc *net.TCPConn, addr string, o *options, name string) (verdict, error) {
	stay := func(replay []byte, why string) (verdict, error) {
		if o.noFallback {
			return verdict{}, fmt.Errorf("%w: %s", ErrNoRDMA, why)
		}
		return verdict{replay: replay, why: why}, nil
	}
	if _, err := tc.Write(startOf(o, name)); err != nil {
		return verdict{}, ctxErr(ctx, fmt.Errorf("negotiation: sending the HTTP/2 preface: %w", err))
	}
	var magic [len(replyMagic)]byte
	n, err := io.ReadFull(tc, magic[:])
	if string(magic[:n]) != replyMagic {
		if n == 0 || (err != nil && replyMagic[:n] == string(magic[:n])) {
			// Nothing, or cut inside what may be our reply's magic.
			return verdict{}, ctxErr(ctx, fmt.Errorf("negotiation: the server closed or failed before answering the HTTP/2 preface: %w", err))
		}
		// An HTTP/2 server that is not rdmagrpc: what it sent is the
		// start of its SETTINGS frame, grpc-go's to read (an error after
		// it comes again at the next read).
		return stay(magic[:n], "the server is a plain gRPC (HTTP/2) server, not rdmagrpc")
	}
	kind, payload, err := readReply(tc)
	if err != nil {
		return verdict{}, ctxErr(ctx, fmt.Errorf("negotiation: the rdmagrpc server's reply: %w", err))
	}
	if kind == verdictTCP {
		return stay(nil, "the server offers no RDMA: "+payload)
	}
	offers, skipped, err := offersFrom(kind, payload, o, name)
	if err != nil {
		return verdict{}, ctxErr(ctx, err)
	}
	c, upErr, err := upgradeFor(ctx, tc, addr, offers, skipped, o, name)
	switch {
	case err != nil:
		return verdict{}, err
	case c != nil:
		return verdict{rdma: c}, nil
	}
	v, err := stay(nil, fmt.Sprintf("the RDMA upgrade failed: %v", upErr))
	if err != nil {
		return v, err
	}
	if _, err := tc.Write([]byte{stayTCP}); err != nil {
		return verdict{}, ctxErr(ctx, fmt.Errorf("negotiation: staying on TCP: %w", err))
	}
	return v, nil
}

// upgradeFor dials the offers the listener at addr made, in order, for
// the dial whose TCP connection is tc, skipping those an upgrade to
// failed recently. On success tc is reset (the listener lets it go; no
// TIME_WAIT on either side) and the listener remembered; otherwise upErr
// says why the dial carries on over TCP (skipped: offers the client could
// not take), or err is final.
func upgradeFor(ctx context.Context, tc *net.TCPConn, addr string, offers []offer, skipped string, o *options, name string) (c *rdmaConn, upErr, err error) {
	var errs []error
	if skipped != "" {
		errs = append(errs, errors.New("not dialed: "+skipped))
	}
	for i, of := range offers {
		if upgradeFailedRecently(of.addr) {
			errs = append(errs, fmt.Errorf("an upgrade to %s failed less than %v ago", of.addr, failedUpgradeTTL))
			continue
		}
		c, timedOut, err := upgrade(withProviderWhy(ctx, of.why), of.addr, o, of.provider, nil, nil)
		if err == nil {
			tc.SetLinger(0)
			tc.Close()
			rememberServer(addr, name, of)
			return c, nil, nil
		}
		// A listener's no ends the dial, unless another of its
		// providers is still to try (shm's peer check, say, may refuse
		// a process that its RDMA side serves).
		if ctx.Err() != nil || final(ctx, err) && i == len(offers)-1 {
			return nil, nil, err
		}
		// Remember only what costs time to find out again: an address
		// that did not answer. A local failure (memory, budget) may be
		// gone at the next dial.
		if timedOut || errors.Is(err, syscall.ETIMEDOUT) || errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH) {
			noteFailedUpgrade(of.addr)
		}
		if len(offers) > 1 {
			err = fmt.Errorf("%s at %s: %w", of.provider, of.addr, err)
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		errs = append(errs, errors.New("the server made no offer"))
	}
	return nil, errors.Join(errs...), nil
}

// upgrade dials the RDMA address a listener offered, within
// WithUpgradeTimeout; timedOut says that bound ran out.
// early and forget: see dialRDMA.
func upgrade(ctx context.Context, rdmaAddr string, o *options, name string, early *earlyGate, forget func()) (c *rdmaConn, timedOut bool, err error) {
	uctx, cancel := context.WithTimeout(ctx, o.upgradeTimeout)
	defer cancel()
	c, err = dialRDMA(uctx, rdmaAddr, o, name, early, forget)
	return c, errors.Is(uctx.Err(), context.DeadlineExceeded), err
}

// final says a failed RDMA dial ends the dial: the caller's context is
// done, or the RDMA listener was reached and said no (backlog full, peer
// refused), an answer not to be gone round over TCP.
func final(ctx context.Context, err error) bool {
	rej := (*transport.RejectError)(nil)
	if ctx.Err() != nil {
		return true
	}
	// A listener that could not take the connection (out of descriptors)
	// may still take it over TCP, which costs it one.
	return errors.As(err, &rej) && !bytes.HasPrefix(rej.Private, transport.RejectListenerFailed)
}

// ctxErr prefers the context's error to the deadline it set on the socket.
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	return err
}
