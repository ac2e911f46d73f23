// Package indep is an implementation of the rdmagrpc wire protocol written
// from doc/protocol.md alone, to check that the document is enough to
// interoperate with the code. It imports nothing of the module.
package indep

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// Section 2.2 constants.
const (
	http2Preface    = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
	settingHello    = 0xf0d3
	settingProvider = 0xf0d4
	settingMagic    = 0x52444701
	replyMagic      = "RDMG"
	replyVersion    = 1
	verdictRDMA     = 'R'
	verdictTCP      = 'T'
	stayTCP         = 'T'
	maxReplyPayload = 1024
)

// ProviderCode is FNV-1a 32-bit of the provider family name (section 2.3).
func ProviderCode(name string) uint32 {
	h := uint32(0x811c9dc5)
	for i := 0; i < len(name); i++ {
		h ^= uint32(name[i])
		h *= 0x01000193
	}
	return h
}

// ClientStart returns the 45 bytes of section 2.2.
func ClientStart(provider string) []byte {
	b := make([]byte, 0, 45)
	b = append(b, http2Preface...)
	b = append(b, 0, 0, 12, 4, 0, 0, 0, 0, 0)
	b = binary.BigEndian.AppendUint16(b, settingHello)
	b = binary.BigEndian.AppendUint32(b, settingMagic)
	b = binary.BigEndian.AppendUint16(b, settingProvider)
	b = binary.BigEndian.AppendUint32(b, ProviderCode(provider))
	return b
}

// Reply builds the listener reply of section 2.4.
func Reply(verdict byte, payload string) ([]byte, error) {
	if len(payload) > maxReplyPayload {
		return nil, fmt.Errorf("reply payload %d bytes > %d", len(payload), maxReplyPayload)
	}
	b := []byte(replyMagic)
	b = append(b, replyVersion, verdict)
	b = binary.BigEndian.AppendUint16(b, uint16(len(payload)))
	return append(b, payload...), nil
}

// Outcome of the client side of the negotiation.
type Outcome int

const (
	// PlainServer: the first 4 bytes were not "RDMG"; the connection stays
	// TCP and Leftover holds the server's first bytes (section 2.5, 2).
	PlainServer Outcome = iota + 1
	// StayTCP: verdict 'T' (section 2.5).
	StayTCP
	// Offer: verdict 'R'; Payload is the RDMA address.
	Offer
)

func (o Outcome) String() string {
	switch o {
	case PlainServer:
		return "plain-server"
	case StayTCP:
		return "stay-tcp"
	case Offer:
		return "offer"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Negotiation is the result of Negotiate.
type Negotiation struct {
	Outcome  Outcome
	Payload  string   // the address (Offer) or the reason (StayTCP)
	Leftover []byte   // bytes of a plain server, for the HTTP/2 layer
	Conn     net.Conn // the TCP connection, still open
}

// Negotiate dials addr over TCP, sends the client start and reads the
// answer as section 2.5 says. The whole negotiation is bounded by ctx.
// The caller then either closes Conn (after a successful upgrade, with
// CloseReset) or, after a failed RDMA dial, calls SendStayTCP.
func Negotiate(ctx context.Context, addr, provider string) (*Negotiation, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	n, err := NegotiateOn(ctx, c, provider)
	if err != nil {
		c.Close()
		return nil, err
	}
	return n, nil
}

// NegotiateOn runs the client negotiation on an open connection.
func NegotiateOn(ctx context.Context, c net.Conn, provider string) (*Negotiation, error) {
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	defer c.SetDeadline(time.Time{})

	// "MUST send the preface and this SETTINGS frame together, before
	// reading anything": one write.
	if _, err := c.Write(ClientStart(provider)); err != nil {
		return nil, fmt.Errorf("send client start: %w", err)
	}
	var head [4]byte
	got := 0
	for got < 4 {
		k, err := c.Read(head[got:])
		got += k
		if err != nil && got < 4 {
			if got > 0 && !bytes.HasPrefix([]byte(replyMagic), head[:got]) {
				// Fewer than 4 bytes, but they cannot be "RDMG": section
				// 2.5 case 3 covers only prefixes of RDMG, so this is
				// case 2 (a plain server) with a short first read.
				break
			}
			if ctx.Err() != nil {
				return nil, fmt.Errorf("negotiation: %w (read %q)", ctx.Err(), head[:got])
			}
			if dl, ok := ctx.Deadline(); ok && isTimeout(err) && !time.Now().Before(dl) {
				return nil, fmt.Errorf("negotiation: %w (read %q)", context.DeadlineExceeded, head[:got])
			}
			if errors.Is(err, io.EOF) {
				return nil, fmt.Errorf("negotiation: connection ended after %d bytes %q", got, head[:got])
			}
			return nil, fmt.Errorf("negotiation: read after %d bytes %q: %w", got, head[:got], err)
		}
	}
	if string(head[:got]) != replyMagic {
		return &Negotiation{Outcome: PlainServer, Leftover: append([]byte(nil), head[:got]...), Conn: c}, nil
	}
	var rest [4]byte
	if _, err := io.ReadFull(c, rest[:]); err != nil {
		return nil, fmt.Errorf("negotiation: reply header: %w", err)
	}
	version, verdict, length := rest[0], rest[1], int(binary.BigEndian.Uint16(rest[2:]))
	if version != replyVersion {
		return nil, fmt.Errorf("negotiation: reply version %d, want %d", version, replyVersion)
	}
	if verdict != verdictRDMA && verdict != verdictTCP {
		return nil, fmt.Errorf("negotiation: reply verdict %#x", verdict)
	}
	if length > maxReplyPayload {
		return nil, fmt.Errorf("negotiation: reply length %d > %d", length, maxReplyPayload)
	}
	payload := make([]byte, length)
	if _, err := io.ReadFull(c, payload); err != nil {
		return nil, fmt.Errorf("negotiation: reply payload: %w", err)
	}
	n := &Negotiation{Payload: string(payload), Conn: c}
	if verdict == verdictRDMA {
		n.Outcome = Offer
		if _, _, err := net.SplitHostPort(n.Payload); err != nil {
			return nil, fmt.Errorf("negotiation: offered address %q: %w", n.Payload, err)
		}
	} else {
		n.Outcome = StayTCP
	}
	return n, nil
}

// SendStayTCP sends the one byte 'T' after a failed upgrade (section 2.5).
func (n *Negotiation) SendStayTCP() error {
	_, err := n.Conn.Write([]byte{stayTCP})
	return err
}

// CloseReset closes the TCP connection with a reset (SO_LINGER 0), as the
// client does after a successful upgrade.
func CloseReset(c net.Conn) error {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	return c.Close()
}
