package shm

import (
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// BenchmarkPingPong is one 64-byte SEND each way between two QPs of this
// process, busy-polling: the round-trip cost of the data path itself.
func BenchmarkPingPong(b *testing.B) {
	cli, srv := pair(b, nil)
	wc := make([]transport.WorkCompletion, 4)
	wait := func(cq transport.CQ) {
		for {
			n, err := cq.Poll(wc)
			if err != nil {
				b.Fatal(err)
			}
			if n > 0 {
				if wc[0].Status != transport.StatusSuccess {
					b.Fatal(wc[0].Status)
				}
				return
			}
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		srv.qp.PostRecv(transport.RecvWR{SG: srv.sge(0, 64)})
		cli.qp.PostRecv(transport.RecvWR{SG: cli.sge(0, 64)})
		cli.qp.PostSend(transport.SendWR{Opcode: transport.OpSend, SG: cli.sge(64, 64), Signaled: true})
		wait(cli.scq)
		wait(srv.rcq)
		srv.qp.PostSend(transport.SendWR{Opcode: transport.OpSend, SG: srv.sge(64, 64), Signaled: true})
		wait(srv.scq)
		wait(cli.rcq)
	}
}

// BenchmarkWrite1MiB is a 1 MiB RDMA WRITE: bounded by memcpy.
func BenchmarkWrite1MiB(b *testing.B) {
	cli, srv := pair(b, nil)
	src, _ := cli.dev.AllocMemory(1 << 20)
	dst, _ := srv.dev.AllocMemory(1 << 20)
	smr, _ := cli.pd.RegMR(src, transport.AccessLocalWrite)
	dmr, _ := srv.pd.RegMR(dst, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	defer func() { smr.Dereg(); dmr.Dereg(); cli.dev.FreeMemory(src); srv.dev.FreeMemory(dst) }()
	wc := make([]transport.WorkCompletion, 1)
	b.SetBytes(1 << 20)
	for b.Loop() {
		cli.qp.PostSend(transport.SendWR{Opcode: transport.OpWrite, Signaled: true,
			SG: []transport.SGE{{Addr: smr.Addr(), Length: 1 << 20, LKey: smr.LKey()}}, RemoteAddr: dmr.Addr(), RKey: dmr.RKey()})
		for {
			n, _ := cli.scq.Poll(wc)
			if n > 0 {
				break
			}
		}
	}
}
