package indep

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"time"
)

// Timings of section 2.6.
var (
	SniffTimeout = 10 * time.Second
	StayTimeout  = 70 * time.Second
)

// Sniffed says what the listener side of the negotiation did with a TCP
// connection.
type Sniffed int

const (
	// PlainClient: not an rdmagrpc client; handed over with bytes replayed.
	PlainClient Sniffed = iota + 1
	// RepliedTCP: an rdmagrpc client with another provider; reply 'T' sent,
	// handed over with the preface and SETTINGS frame replayed.
	RepliedTCP
	// ClientStayed: offer sent, the client answered 'T'; handed over.
	ClientStayed
	// Upgraded: offer sent, the client closed or sent something else; the
	// TCP connection is closed.
	Upgraded
)

func (s Sniffed) String() string {
	switch s {
	case PlainClient:
		return "plain-client"
	case RepliedTCP:
		return "replied-tcp"
	case ClientStayed:
		return "client-stayed"
	case Upgraded:
		return "upgraded"
	}
	return fmt.Sprintf("Sniffed(%d)", int(s))
}

// SniffResult is the outcome of Sniff.
type SniffResult struct {
	Kind Sniffed
	// Conn is the connection to hand to the application (nil after
	// Upgraded): it replays Replayed ahead of the rest of the stream.
	Conn     net.Conn
	Replayed []byte
	// ClientCode is the provider code the client announced (0 if absent).
	ClientCode uint32
	// Reply is the reply sent, if any.
	Reply []byte
	// AfterOffer is the byte (or error) read after an offer.
	AfterOffer    []byte
	AfterOfferErr error
}

// Sniff runs the listener side of section 2.6 on a freshly accepted TCP
// connection. ownCode is the listener's provider code; rdmaPort is the port
// of its RDMA listener (the offer names the local IP of c and that port).
func Sniff(c net.Conn, ownCode uint32, rdmaPort int) (*SniffResult, error) {
	var read []byte
	plain := func() *SniffResult {
		return &SniffResult{Kind: PlainClient, Conn: &replayConn{Conn: c, pre: read}, Replayed: read}
	}
	c.SetReadDeadline(time.Now().Add(SniffTimeout))
	// Step 1: compare with the preface as bytes arrive.
	buf := make([]byte, len(http2Preface))
	for len(read) < len(http2Preface) {
		k, err := c.Read(buf[:len(http2Preface)-len(read)])
		for i := 0; i < k; i++ {
			read = append(read, buf[i])
			if buf[i] != http2Preface[len(read)-1] {
				read = append(read, buf[i+1:k]...)
				c.SetReadDeadline(time.Time{})
				return plain(), nil
			}
		}
		if err != nil {
			c.SetReadDeadline(time.Time{})
			if isTimeout(err) {
				return plain(), nil
			}
			// The document does not say what to do when the client
			// closes during the preface; hand it over like a time-out.
			return plain(), nil
		}
	}
	// Step 2: the frame header.
	hdr, err := readMore(c, &read, 9)
	if err != nil {
		c.SetReadDeadline(time.Time{})
		return plain(), nil
	}
	length := int(hdr[0])<<16 | int(hdr[1])<<8 | int(hdr[2])
	if hdr[3] != 4 || length%6 != 0 || length > 16384 {
		c.SetReadDeadline(time.Time{})
		return plain(), nil
	}
	payload, err := readMore(c, &read, length)
	c.SetReadDeadline(time.Time{})
	if err != nil {
		return plain(), nil
	}
	// Step 3: the parameters.
	rdg := false
	var code uint32
	for i := 0; i+6 <= len(payload); i += 6 {
		id := binary.BigEndian.Uint16(payload[i:])
		v := binary.BigEndian.Uint32(payload[i+2:])
		switch id {
		case settingHello:
			if v == settingMagic {
				rdg = true
			}
		case settingProvider:
			code = v
		}
	}
	if !rdg {
		return plain(), nil
	}
	res := &SniffResult{ClientCode: code, Replayed: read}
	// Step 4: the reply.
	if code != ownCode {
		reply, _ := Reply(verdictTCP, fmt.Sprintf("the server's provider code is %#08x, not the client's %#08x", ownCode, code))
		res.Reply = reply
		if _, err := c.Write(reply); err != nil {
			return nil, fmt.Errorf("send reply: %w", err)
		}
		// Step 5.
		res.Kind = RepliedTCP
		res.Conn = &replayConn{Conn: c, pre: read}
		return res, nil
	}
	local, ok := c.LocalAddr().(*net.TCPAddr)
	if !ok {
		return nil, fmt.Errorf("local address %v is not TCP", c.LocalAddr())
	}
	ip := local.AddrPort().Addr().Unmap()
	reply, err := Reply(verdictRDMA, net.JoinHostPort(ip.String(), strconv.Itoa(rdmaPort)))
	if err != nil {
		return nil, err
	}
	res.Reply = reply
	if _, err := c.Write(reply); err != nil {
		return nil, fmt.Errorf("send reply: %w", err)
	}
	// Step 6: exactly one byte.
	c.SetReadDeadline(time.Now().Add(StayTimeout))
	var one [1]byte
	k, err := c.Read(one[:])
	c.SetReadDeadline(time.Time{})
	res.AfterOffer = append([]byte(nil), one[:k]...)
	res.AfterOfferErr = err
	if k == 1 && one[0] == stayTCP {
		res.Kind = ClientStayed
		res.Conn = &replayConn{Conn: c, pre: read}
		return res, nil
	}
	res.Kind = Upgraded
	c.Close()
	return res, nil
}

func readMore(c net.Conn, read *[]byte, n int) ([]byte, error) {
	start := len(*read)
	*read = append(*read, make([]byte, n)...)
	k, err := io.ReadFull(c, (*read)[start:])
	*read = (*read)[:start+k]
	if err != nil {
		return nil, err
	}
	return (*read)[start:], nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// replayConn reads pre before the rest of the connection.
type replayConn struct {
	net.Conn
	pre []byte
}

func (r *replayConn) Read(b []byte) (int, error) {
	if len(r.pre) > 0 {
		n := copy(b, r.pre)
		r.pre = r.pre[n:]
		return n, nil
	}
	return r.Conn.Read(b)
}
