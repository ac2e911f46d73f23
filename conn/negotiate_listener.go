package conn

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"time"

	"github.com/rdmagrpc/rdmagrpc/internal/telemetry"
)

// sniff reads what a TCP client sends first: the HTTP/2 preface and its
// first frame, which must be SETTINGS. read is every byte taken (to be
// replayed if the connection stays TCP); h is what our parameters say
// (h.magic 0: a plain client).
func sniff(r io.Reader) (read []byte, h clientHello, err error) {
	buf := make([]byte, len(h2Preface)+9)
	// Byte by byte as they come: a client whose first bytes are not the
	// preface (TLS, or a protocol of its own) is handed over at once,
	// even if it wrote fewer than the preface's length and waits, or
	// closed.
	for n := 0; n < len(h2Preface); {
		m, err := r.Read(buf[n:len(h2Preface)])
		n += m
		if string(buf[:n]) != h2Preface[:n] {
			return buf[:n], h, nil
		}
		if err != nil {
			if err == io.EOF && n > 0 {
				err = io.ErrUnexpectedEOF
			}
			return buf[:n], h, err
		}
	}
	if n, err := io.ReadFull(r, buf[len(h2Preface):]); err != nil {
		// Every byte taken is replayed to whoever gets the connection
		// (a client that paused mid-header, past sniffTimeout).
		return buf[:len(h2Preface)+n], h, err
	}
	fh := buf[len(h2Preface):]
	length := int(fh[0])<<16 | int(fh[1])<<8 | int(fh[2])
	if fh[3] != h2FrameSettings || length%6 != 0 || length > 16<<10 {
		return buf, h, nil
	}
	payload := make([]byte, length)
	if n, err := io.ReadFull(r, payload); err != nil {
		return append(buf, payload[:n]...), h, err
	}
	read = append(buf, payload...)
	var hi, lo uint32
	for p := payload; len(p) >= 6; p = p[6:] {
		id, v := binary.BigEndian.Uint16(p), binary.BigEndian.Uint32(p[2:])
		switch id {
		case settingHello:
			if v == settingMagic {
				h.magic = v
			}
		case settingProvider:
			h.provider = v
		case settingAlso:
			if len(h.also) < maxOffers {
				h.also = append(h.also, v)
			}
		case settingHostHi:
			hi = v
		case settingHostLo:
			lo = v
		}
	}
	h.host = uint64(hi)<<32 | uint64(lo)
	return read, h, nil
}

func encodeReply(verdict byte, payload string) []byte {
	if len(payload) > maxReply {
		payload = payload[:maxReply]
	}
	b := append([]byte(replyMagic), replyVersion, verdict)
	b = binary.BigEndian.AppendUint16(b, uint16(len(payload)))
	return append(b, payload...)
}

// serveTCP is the TCP side of a listener: every connection is sniffed,
// and handed to Accept as TCP or offered an upgrade.
func (l *Listener) serveTCP() {
	defer l.wg.Done()
	for {
		tc, err := l.tcp.AcceptTCP()
		if err != nil {
			return // closed
		}
		l.wg.Add(1)
		go l.negotiate(tc)
	}
}

// negotiate is the listener's half of one TCP connection's set-up.
func (l *Listener) negotiate(tc *net.TCPConn) {
	defer l.wg.Done()
	// The listener's Close ends a negotiation in progress.
	stop := context.AfterFunc(l.ctx, func() { tc.SetDeadline(aLongTimeAgo) })
	defer stop()
	tc.SetReadDeadline(time.Now().Add(sniffTimeout))
	read, h, err := sniff(tc)
	var ne net.Error
	silent := errors.As(err, &ne) && ne.Timeout() // sent too little: not HTTP/2, maybe a client that waits for us
	if l.ctx.Err() != nil || (err != nil && !silent) {
		tc.Close() // gone (mid-preface or before), or closing
		return
	}
	// A connection waiting for Accept takes a backlog token, as an RDMA
	// one does; a negotiation holds none (an upgrading client's RDMA
	// request needs one meanwhile).
	handOver := func(why string) {
		select {
		case l.backlog <- struct{}{}:
		default:
			tc.SetLinger(0) // full: refuse at once
			tc.Close()
			return
		}
		tc.SetDeadline(time.Time{})
		c := newTCPConn(telemetry.Server, tc, read, false, why, l.o)
		select {
		case l.conns <- &Conn{tcp: c}:
		case <-l.ctx.Done():
			<-l.backlog
			c.Close()
		}
	}
	if h.magic == 0 {
		handOver("a plain TCP client")
		return
	}
	// Offer the RDMA listeners at the address the client reached us at.
	verdict, payload := l.replyTo(h, tc.LocalAddr().(*net.TCPAddr))
	// Counted before the reply goes: the client may upgrade, dial again
	// and look at the count before this goroutine runs again (tests
	// failed on that under load, counting 0 negotiations).
	l.negotiations.Add(1)
	if _, err := tc.Write(encodeReply(verdict, payload)); err != nil {
		tc.Close()
		return
	}
	if verdict == verdictTCP {
		handOver(payload)
		return
	}
	// The client now dials RDMA; it resets this connection when that
	// worked, or says stayTCP.
	tc.SetReadDeadline(time.Now().Add(sniffTimeout + time.Minute))
	var b [1]byte
	if _, err := io.ReadFull(tc, b[:]); err != nil || b[0] != stayTCP || l.ctx.Err() != nil {
		tc.Close()
		return
	}
	handOver("the client could not upgrade to RDMA")
}
