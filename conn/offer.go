package conn

// One listener, every provider it can serve. A listener whose provider
// reaches other hosts (verbs) also listens on shm, which reaches the
// processes of its own kernel only, and chooses per connection: a client
// on the same kernel is offered shared memory first (its bytes then never
// go down to the NIC and back through its loopback, as Linux's SMC-D
// loopback serves peers inside one kernel), any other client the
// listener's own provider. "The same kernel" is checked, not guessed from
// an address: each end says which kernel it runs on (a hash of the
// kernel's boot_id, which every network, PID and mount namespace of one
// kernel shares and no other kernel has), the listener offers shm only to
// a client of its own kernel and the client dials an shm offer only from a
// listener of its own. A client that said nothing of its kernel (an older
// or an independent implementation) gets the one-provider reply it
// understands.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"os"
	"slices"
	"strings"
	"sync"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// clientHello is what an rdmagrpc client says in its first SETTINGS frame.
type clientHello struct {
	magic    uint32   // settingMagic: an rdmagrpc client; else a plain one
	provider uint32   // its provider's code
	also     []uint32 // the codes of other providers it can dial
	host     uint64   // its kernel (hostID); 0: not said
}

// can says the client can dial a listener of the provider code.
func (h clientHello) can(code uint32) bool {
	return h.provider == code || slices.Contains(h.also, code)
}

// encode is the client start: the HTTP/2 preface and a SETTINGS frame
// with our parameters, a valid start of an HTTP/2 connection.
func (h clientHello) encode() []byte {
	params := 2 + len(h.also)
	if h.host != 0 {
		params += 2
	}
	b := make([]byte, 0, len(h2Preface)+9+6*params)
	b = append(b, h2Preface...)
	b = append(b, 0, 0, byte(6*params), h2FrameSettings, 0, 0, 0, 0, 0)
	param := func(id uint16, v uint32) {
		b = binary.BigEndian.AppendUint16(b, id)
		b = binary.BigEndian.AppendUint32(b, v)
	}
	param(settingHello, h.magic)
	param(settingProvider, h.provider)
	for _, c := range h.also {
		param(settingAlso, c)
	}
	if h.host != 0 {
		param(settingHostHi, uint32(h.host>>32))
		param(settingHostLo, uint32(h.host))
	}
	return b
}

// clientStart is the start of a client of the provider name that can also
// dial the providers also, on kernel host (0: not said).
func clientStart(name string, also []string, host uint64) []byte {
	h := clientHello{magic: settingMagic, provider: providerCode(transport.Family(name)), host: host}
	for _, a := range also {
		h.also = append(h.also, providerCode(transport.Family(a)))
	}
	return h.encode()
}

// startOf is the client start of a dial with options o over provider name.
func startOf(o *options, name string) []byte {
	return clientStart(name, alsoFor(o, name), clientHost())
}

// alsoFor is what a client of provider name can dial besides it: shm,
// unless the provider was pinned (WithProvider, RDMAGRPC_PROVIDER) or is
// shm already.
func alsoFor(o *options, name string) []string {
	if o.pinned || transport.Family(name) == "shm" || !transport.Registered("shm") {
		return nil
	}
	return []string{"shm"}
}

// localOnly says a provider reaches the processes of its own kernel only.
func localOnly(name string) bool { return transport.Family(name) == "shm" }

// hostID names this kernel: FNV-1a 64 of its boot_id, 0 where that cannot
// be read (then no shm is offered or dialed by this rule).
var hostID = sync.OnceValue(func() uint64 {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	id := strings.TrimSpace(string(b))
	if err != nil || id == "" {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte(id))
	return max(h.Sum64(), 1)
})

// clientHost is the kernel a client says it runs on; tests replace it to
// play a client of another host.
var clientHost = hostID

// offer is an RDMA listener a server offered: the provider (this
// process's name for it), its address, and why a connection to it would
// use it (Stats.ProviderReason; "" keeps the provider's own reason).
type offer struct {
	provider, addr, why string
}

// Reply 'O' lists the listener's offers in its order of preference:
//
//	host u64 | count u8 | count × (code u32 | length u8 | host:port)
//
// host is the listener's kernel (hostID, 0: not known); count is at
// most maxOffers (negotiate.go).

func encodeOffers(host uint64, codes []uint32, addrs []string) string {
	b := binary.BigEndian.AppendUint64(nil, host)
	b = append(b, byte(len(codes)))
	for i, c := range codes {
		b = binary.BigEndian.AppendUint32(b, c)
		b = append(b, byte(len(addrs[i])))
		b = append(b, addrs[i]...)
	}
	return string(b)
}

var errOffers = errors.New("conn: negotiation: malformed offers")

func decodeOffers(p string) (host uint64, codes []uint32, addrs []string, err error) {
	if len(p) < 9 {
		return 0, nil, nil, errOffers
	}
	host, n, p := binary.BigEndian.Uint64([]byte(p[:8])), int(p[8]), p[9:]
	if n > maxOffers {
		return 0, nil, nil, fmt.Errorf("%w: %d offers (at most %d)", errOffers, n, maxOffers)
	}
	for range n {
		if len(p) < 5 || len(p) < 5+int(p[4]) {
			return 0, nil, nil, errOffers
		}
		codes = append(codes, binary.BigEndian.Uint32([]byte(p[:4])))
		addrs = append(addrs, p[5:5+int(p[4])])
		p = p[5+int(p[4]):]
	}
	if len(p) != 0 {
		return 0, nil, nil, fmt.Errorf("%w: %d bytes after the last", errOffers, len(p))
	}
	return host, codes, addrs, nil
}

// offersFrom is what a client of provider name makes of a reply with an
// offer: the RDMA listeners to dial, in order, or why there are none.
func offersFrom(kind byte, payload string, o *options, name string) ([]offer, string, error) {
	if kind == verdictRDMA {
		return []offer{{provider: name, addr: payload}}, "", nil
	}
	host, codes, addrs, err := decodeOffers(payload)
	if err != nil {
		return nil, "", err
	}
	own := providerCode(transport.Family(name))
	me := clientHost()
	var offers []offer
	var skipped []string
	for i, c := range codes {
		switch {
		case c == own && localOnly(name) && (host == 0 || host != me):
			skipped = append(skipped, fmt.Sprintf("%s at %s: the server runs on another kernel", name, addrs[i]))
		case c == own:
			why := ""
			if host != me {
				why = o.providerWhy + "; the server is on " + whyOtherHost
			}
			offers = append(offers, offer{provider: name, addr: addrs[i], why: why})
		case slices.ContainsFunc(alsoFor(o, name), func(a string) bool { return providerCode(transport.Family(a)) == c }):
			a := "shm"
			if host == 0 || host != me {
				skipped = append(skipped, fmt.Sprintf("%s at %s: the server runs on another kernel", a, addrs[i]))
				continue
			}
			offers = append(offers, offer{provider: a, addr: addrs[i], why: "the server is on this host " + whySameKernel + ": shared memory"})
		default:
			skipped = append(skipped, fmt.Sprintf("provider %#08x at %s: not one this client dials", c, addrs[i]))
		}
	}
	return offers, strings.Join(skipped, "; "), nil
}

// side is one provider a listener serves.
type side struct {
	l    transport.Listener
	dev  transport.Device
	name string
	why  string // Stats.ProviderReason of its connections
}

// replyTo is the listener's answer to a client start h that reached it at
// local: its verdict and payload.
func (l *Listener) replyTo(h clientHello, local *net.TCPAddr) (byte, string) {
	at := func(tl transport.Listener) string {
		_, port, _ := net.SplitHostPort(tl.Addr().String())
		host := local.IP.String()
		if local.Zone != "" {
			host += "%" + local.Zone
		}
		return net.JoinHostPort(host, port)
	}
	own := providerCode(transport.Family(l.name))
	if h.host == 0 {
		// A client that did not say where it runs reads 'R' and 'T'.
		if h.provider != own {
			return verdictTCP, fmt.Sprintf("the server's RDMA provider is %s, not the client's", l.name)
		}
		return verdictRDMA, at(l.l)
	}
	me := hostID()
	var codes []uint32
	var addrs []string
	if me != 0 && h.host == me {
		if tl := l.localSide(); tl != nil && h.can(shmCode) {
			codes, addrs = append(codes, shmCode), append(addrs, at(tl))
		}
	}
	// shm's own offer is the one above, to a client of this kernel only.
	if h.can(own) && !localOnly(l.name) {
		codes, addrs = append(codes, own), append(addrs, at(l.l))
	}
	if len(codes) == 0 {
		why := fmt.Sprintf("the server's RDMA provider is %s, not the client's", l.name)
		if l.local != nil {
			why = fmt.Sprintf("the server serves %s, and shm to the processes of its own host; the client is on %s or dials neither", l.name, whyOtherHost)
		}
		return verdictTCP, why
	}
	return verdictOffers, encodeOffers(me, codes, addrs)
}

// shmCode is shm's provider code.
var shmCode = providerCode("shm")

// localSide is the listener's shm side: its own provider's when that is
// shm, else the one it added (nil: none).
func (l *Listener) localSide() transport.Listener {
	switch {
	case localOnly(l.name):
		return l.l
	case l.local != nil:
		return l.local.l
	}
	return nil
}

type providerWhyKey struct{}

// withProviderWhy makes why the ProviderReason of a connection newConn
// makes under ctx ("": the provider's own reason).
func withProviderWhy(ctx context.Context, why string) context.Context {
	if why == "" {
		return ctx
	}
	return context.WithValue(ctx, providerWhyKey{}, why)
}

func providerWhy(ctx context.Context, o *options) string {
	if why, ok := ctx.Value(providerWhyKey{}).(string); ok {
		return why
	}
	return o.providerWhy
}

// listenLocal adds an shm side to a listener whose provider reaches other
// hosts, on port (the TCP side's) or, taken, one shm picks: the clients of
// its own kernel are offered it first. Not where the provider was pinned,
// nor without a TCP side (a direct dial names one provider). A failure
// leaves the listener as it was: its own provider serves every client.
func (l *Listener) listenLocal(host, port string) {
	if l.o.pinned || l.tcp == nil || localOnly(l.name) || !transport.Registered("shm") {
		return
	}
	dev, err := openDevice("shm")
	var tl transport.Listener
	if err == nil {
		if tl, err = dev.Listen(net.JoinHostPort(host, port)); err != nil {
			tl, err = dev.Listen(net.JoinHostPort(host, "0"))
		}
	}
	if err == nil && l.o.peerCheck != nil {
		if pc, ok := tl.(transport.PeerChecker); ok {
			pc.SetPeerCheck(l.o.peerCheck)
		}
	}
	if err != nil {
		l.o.log().Info("rdmagrpc: no shared-memory side: clients on this host use "+l.name+" too", "listener", l.Addr().String(), "err", err)
		return
	}
	l.local = &side{l: tl, dev: dev, name: "shm", why: "the client is on this host " + whySameKernel + ": shared memory"}
}
