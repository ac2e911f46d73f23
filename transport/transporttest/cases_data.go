package transporttest

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Every opcode, scatter-gather on both sides, ordering, signaling, inline.
var dataCases = []*testCase{
	{
		name: "SendRecvScatterGather",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			fill(ep.mem[:20], 'A')
			fill(ep.mem[64:74], 'B')
			e.expect("ready")
			sg := []transport.SGE{ep.sge(0, 20), ep.sge(64, 10)}
			if err := ep.postSend(transport.SendWR{ID: 1, Opcode: transport.OpSend, SG: sg, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			if err := ep.postSend(transport.SendWR{ID: 2, Opcode: transport.OpSendWithImm, SG: sg, Imm: 0xdeadbeef, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			wcs := e.poll(ep.scq, 2)
			e.check(wcs[0], 1, transport.StatusSuccess, transport.WCSend, ep.qp.Num())
			e.check(wcs[1], 2, transport.StatusSuccess, transport.WCSend, ep.qp.Num())
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			for id := uint64(7); id <= 8; id++ {
				base := int(id-7) * 1024
				if err := ep.postRecv(id, ep.sge(base, 10), ep.sge(base+100, 100)); err != nil {
					return err
				}
			}
			if err := p.ctl.sendf("ready"); err != nil {
				return err
			}
			wcs, err := poll(ctx, ep.rcq, 2)
			if err != nil {
				return err
			}
			want := make([]byte, 30)
			fill(want[:20], 'A')
			fill(want[20:], 'B')
			for i, wc := range wcs {
				if err := check(wc, uint64(7+i), transport.StatusSuccess, transport.WCRecv, ep.qp.Num()); err != nil {
					return err
				}
				if wc.ByteLen != 30 {
					return fmt.Errorf("byte_len %d, want 30", wc.ByteLen)
				}
				if wc.HasImm != (i == 1) || (i == 1 && wc.Imm != 0xdeadbeef) {
					return fmt.Errorf("completion %d: imm %v %#x", i, wc.HasImm, wc.Imm)
				}
				base := i * 1024
				got := append(append([]byte{}, ep.mem[base:base+10]...), ep.mem[base+100:base+120]...)
				if !bytes.Equal(got, want) {
					return fmt.Errorf("scattered data %x, want %x", got, want)
				}
			}
			return p.okThenBye(ctx)
		},
	},
	{
		name: "WriteAndWriteWithImm",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			r := e.remoteMR()
			fill(ep.mem[:100], 1)
			fill(ep.mem[200:300], 2)
			if err := ep.postSend(transport.SendWR{ID: 1, Opcode: transport.OpWrite, SG: []transport.SGE{ep.sge(0, 100), ep.sge(200, 100)},
				RemoteAddr: r.addr + 512, RKey: r.rkey, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			if err := ep.postSend(transport.SendWR{ID: 2, Opcode: transport.OpWriteWithImm, SG: []transport.SGE{ep.sge(0, 64)},
				RemoteAddr: r.addr + 4096, RKey: r.rkey, Imm: 0x12345678, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			wcs := e.poll(ep.scq, 2)
			e.check(wcs[0], 1, transport.StatusSuccess, transport.WCRDMAWrite, ep.qp.Num())
			e.check(wcs[1], 2, transport.StatusSuccess, transport.WCRDMAWrite, ep.qp.Num())
			e.send("check")
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if err := ep.postRecv(9); err != nil { // no SGE: an immediate needs none
				return err
			}
			if err := sendMR(p.ctl, ep); err != nil {
				return err
			}
			wcs, err := poll(ctx, ep.rcq, 1)
			if err != nil {
				return err
			}
			if err := check(wcs[0], 9, transport.StatusSuccess, transport.WCRecvRDMAWithImm, ep.qp.Num()); err != nil {
				return err
			}
			if !wcs[0].HasImm || wcs[0].Imm != 0x12345678 {
				return fmt.Errorf("write-with-imm completion imm %v %#x", wcs[0].HasImm, wcs[0].Imm)
			}
			if _, err := p.ctl.expect(ctx, "check"); err != nil {
				return err
			}
			want := make([]byte, 200)
			fill(want[:100], 1)
			fill(want[100:], 2)
			if !bytes.Equal(ep.mem[512:712], want) || !bytes.Equal(ep.mem[4096:4160], want[:64]) {
				return fmt.Errorf("written data differs")
			}
			if !allZero(ep.mem[:512]) || !allZero(ep.mem[712:4096]) {
				return fmt.Errorf("bytes outside the written ranges changed")
			}
			return p.okThenBye(ctx)
		},
	},
	{
		name: "ReadScatter",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			r := e.remoteMR()
			if err := ep.postSend(transport.SendWR{ID: 5, Opcode: transport.OpRead, SG: []transport.SGE{ep.sge(0, 100), ep.sge(1000, 200)},
				RemoteAddr: r.addr + 100, RKey: r.rkey, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			wcs := e.poll(ep.scq, 1)
			e.check(wcs[0], 5, transport.StatusSuccess, transport.WCRDMARead, ep.qp.Num())
			want := make([]byte, 1024)
			fill(want, 9)
			got := append(append([]byte{}, ep.mem[:100]...), ep.mem[1000:1200]...)
			if !bytes.Equal(got, want[100:400]) {
				t.Fatalf("read data differs")
			}
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			fill(ep.mem[:1024], 9)
			if err := sendMR(p.ctl, ep); err != nil {
				return err
			}
			return p.awaitBye(ctx)
		},
	},
	{
		name: "OrderingAndSignaling",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			e.expect("ready")
			const n = 48
			for i := range n {
				binary.LittleEndian.PutUint64(ep.mem[i*8:], uint64(i))
				// Only every 8th is signaled: the others must complete silently.
				if err := ep.postSend(transport.SendWR{ID: uint64(i), Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(i*8, 8)}, Signaled: i%8 == 7}); err != nil {
					t.Fatal(err)
				}
			}
			wcs := e.poll(ep.scq, n/8)
			for i, wc := range wcs {
				e.check(wc, uint64(i*8+7), transport.StatusSuccess, transport.WCSend, ep.qp.Num())
			}
			if err := pollNone(ep.scq, 50*time.Millisecond); err != nil {
				t.Fatal(err)
			}
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			const n = 48
			for i := range n {
				if err := ep.postRecv(uint64(100+i), ep.sge(i*16, 16)); err != nil {
					return err
				}
			}
			if err := p.ctl.sendf("ready"); err != nil {
				return err
			}
			wcs, err := poll(ctx, ep.rcq, n)
			if err != nil {
				return err
			}
			for i, wc := range wcs {
				if err := check(wc, uint64(100+i), transport.StatusSuccess, transport.WCRecv, ep.qp.Num()); err != nil {
					return err
				}
				if v := binary.LittleEndian.Uint64(ep.mem[i*16:]); v != uint64(i) || wc.ByteLen != 8 {
					return fmt.Errorf("message %d carries %d (%d bytes): out of order", i, v, wc.ByteLen)
				}
			}
			return p.okThenBye(ctx)
		},
	},
	{
		name: "InlineCapturedAtPost",
		local: func(t *testing.T, e *env) {
			ep := e.accept(setup{}, nil)
			e.expect("ready")
			copy(ep.mem, "inline payload!!")
			// Inline data is copied at post time: no lkey check, and the
			// buffer is free again as soon as PostSend returns.
			if err := ep.postSend(transport.SendWR{ID: 1, Opcode: transport.OpSend, SG: []transport.SGE{{Addr: ep.mr.Addr(), Length: 16}}, Inline: true, Signaled: true}); err != nil {
				t.Fatal(err)
			}
			copy(ep.mem, "XXXXXXXXXXXXXXXX")
			e.check(e.poll(ep.scq, 1)[0], 1, transport.StatusSuccess, transport.WCSend, ep.qp.Num())
			e.expect("ok")
		},
		peer: func(ctx context.Context, p *peer) error {
			ep, err := p.connect(ctx, setup{}, nil)
			if err != nil {
				return err
			}
			defer ep.close()
			if err := ep.postRecv(1, ep.sge(0, 64)); err != nil {
				return err
			}
			if err := p.ctl.sendf("ready"); err != nil {
				return err
			}
			if _, err := poll(ctx, ep.rcq, 1); err != nil {
				return err
			}
			if got := string(ep.mem[:16]); got != "inline payload!!" {
				return fmt.Errorf("inline send delivered %q", got)
			}
			return p.okThenBye(ctx)
		},
	},
}
