package shm

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// The cross-process tests re-execute this test binary as the peer.
const peerEnv = "RDMAGRPC_SHM_TEST_PEER"

func TestMain(m *testing.M) {
	if mode := os.Getenv(isoEnv); mode != "" {
		if err := isoHelper(mode); err != nil {
			fmt.Fprintln(os.Stderr, "isolation helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if mode := os.Getenv(freezeEnv); mode != "" {
		if err := freezeHelper(mode); err != nil {
			fmt.Fprintln(os.Stderr, "freeze helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if name := os.Getenv(squatEnv); name != "" {
		if err := squatter(name); err != nil {
			fmt.Fprintln(os.Stderr, "squatter:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if peer, ok := map[string]func() error{"echo": echoPeer, "named": namedPeer}[os.Getenv(peerEnv)]; ok {
		if err := peer(); err != nil {
			fmt.Fprintln(os.Stderr, "peer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// echoPeer listens, prints its address, accepts one connection whose
// accept private data describes its MR, and echoes every message it
// receives until the connection ends.
func echoPeer() error {
	p, _ := transport.Get("shm")
	d, err := p.Open("")
	if err != nil {
		return err
	}
	pd, _ := d.AllocPD()
	cq, _ := d.CreateCQ(64)
	mem, err := d.AllocMemory(1 << 20)
	if err != nil {
		return err
	}
	mr, err := pd.RegMR(mem, transport.AccessLocalWrite|transport.AccessRemoteWrite|transport.AccessRemoteRead)
	if err != nil {
		return err
	}
	l, err := d.Listen("127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println(l.Addr().String())
	ctx := context.Background()
	r, err := l.Accept(ctx)
	if err != nil {
		return err
	}
	priv := binary.LittleEndian.AppendUint64(nil, mr.Addr())
	priv = binary.LittleEndian.AppendUint32(priv, mr.RKey())
	qp, err := r.Accept(ctx, transport.QPConfig{PD: pd, SendCQ: cq, RecvCQ: cq, MaxSendWR: 16, MaxRecvWR: 8,
		MaxSendSGE: 1, MaxRecvSGE: 1, RNRRetry: 7, MinRNRTimer: time.Millisecond}, priv)
	if err != nil {
		return err
	}
	const slot = 4096
	for i := range 8 {
		qp.PostRecv(transport.RecvWR{ID: uint64(i), SG: []transport.SGE{{Addr: mr.Addr() + uint64(i*slot), Length: slot, LKey: mr.LKey()}}})
	}
	wc := make([]transport.WorkCompletion, 8)
	for {
		n, err := cq.Poll(wc)
		if err != nil {
			return err
		}
		if n == 0 {
			cq.ReqNotify()
			if n, _ = cq.Poll(wc); n == 0 {
				if err := cq.Wait(ctx); err != nil {
					return err
				}
				continue
			}
		}
		for _, w := range wc[:n] {
			if w.Status != transport.StatusSuccess {
				return nil // disconnected
			}
			if w.Opcode != transport.WCRecv {
				continue
			}
			off := uint64(w.ID) * slot
			// Echo from a second half of the region so the receive
			// buffer can be reposted at once.
			echo := uint64(512<<10) + off
			copy(mem[echo:echo+uint64(w.ByteLen)], mem[off:off+uint64(w.ByteLen)])
			qp.PostRecv(transport.RecvWR{ID: w.ID, SG: []transport.SGE{{Addr: mr.Addr() + off, Length: slot, LKey: mr.LKey()}}})
			qp.PostSend(transport.SendWR{ID: 100, Opcode: transport.OpSendWithImm, Imm: w.ByteLen, Signaled: true,
				SG: []transport.SGE{{Addr: mr.Addr() + echo, Length: w.ByteLen, LKey: mr.LKey()}}})
		}
	}
}

// namedPeer listens, prints its address, and accepts connections as conn
// does (on the device of the dialer's process); into each dialer's memory
// it writes "pong" at offset 64, until it is killed.
func namedPeer() error {
	p, _ := transport.Get("shm")
	d, err := p.Open("")
	if err != nil {
		return err
	}
	l, err := d.Listen("127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println(l.Addr().String())
	ctx := context.Background()
	for {
		r, err := l.Accept(ctx)
		if err != nil {
			return err
		}
		s, err := newIsoSide(r.(transport.RequestDevice).Device())
		if err != nil {
			return err
		}
		q, err := r.Accept(ctx, s.cfg(), s.private())
		if err != nil {
			return err
		}
		copy(s.mem, "pong")
		raddr, rkey := remote(q.PeerPrivate())
		if err := s.write(q, 0, 4, raddr+64, rkey); err != nil {
			return err
		}
	}
}

func startPeer(t *testing.T) (*exec.Cmd, string) {
	t.Helper()
	return startPeerMode(t, "echo")
}

func startPeerMode(t *testing.T, mode string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), peerEnv+"="+mode)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("peer did not print its address: %v", err)
	}
	return cmd, strings.TrimSpace(line)
}

func TestCrossProcess(t *testing.T) {
	cmd, addr := startPeer(t)
	s := openSide(t, 64)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg := s.cfg()
	var err error
	s.qp, err = s.dev.Connect(ctx, addr, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	priv := s.qp.PeerPrivate()
	if len(priv) != transport.PrivateLenAccept {
		t.Fatalf("private %x", priv)
	}
	raddr, rkey := binary.LittleEndian.Uint64(priv), binary.LittleEndian.Uint32(priv[8:])

	// RDMA WRITE then READ back from the other process's memory.
	copy(s.mem, "across processes")
	s.qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpWrite, SG: s.sge(0, 16), RemoteAddr: raddr + 300000, RKey: rkey})
	s.qp.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpRead, SG: s.sge(1000, 16), RemoteAddr: raddr + 300000, RKey: rkey, Signaled: true})
	wc := poll(t, s.scq, 1)[0]
	wantStatus(t, wc, transport.StatusSuccess)
	if string(s.mem[1000:1016]) != "across processes" {
		t.Fatalf("read back %q", s.mem[1000:1016])
	}

	// SEND and receive the echo (the peer waits on its eventfd).
	for i := range 20 {
		s.qp.PostRecv(transport.RecvWR{ID: uint64(i), SG: s.sge(8192, 4096)})
		msg := fmt.Sprintf("message %d", i)
		copy(s.mem[4096:], msg)
		if _, err := s.qp.PostSend(transport.SendWR{ID: 10, Opcode: transport.OpSend, SG: s.sge(4096, len(msg)), Signaled: true}); err != nil {
			t.Fatal(err)
		}
		wantStatus(t, poll(t, s.scq, 1)[0], transport.StatusSuccess)
		rc := poll(t, s.rcq, 1)[0]
		wantStatus(t, rc, transport.StatusSuccess)
		if got := string(s.mem[8192 : 8192+rc.ByteLen]); got != msg || rc.Imm != uint32(len(msg)) {
			t.Fatalf("echo %q imm %d, want %q", got, rc.Imm, msg)
		}
	}

	// SIGKILL the peer: the connection hangs up, work is flushed.
	s.qp.PostRecv(transport.RecvWR{ID: 77, SG: s.sge(8192, 4096)})
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.qp.Disconnected():
	case <-time.After(5 * time.Second):
		t.Fatal("peer death not noticed")
	}
	if s.qp.State() != transport.QPSErr {
		t.Fatalf("state %v", s.qp.State())
	}
	rc := poll(t, s.rcq, 1)[0]
	if rc.ID != 77 || rc.Status != transport.StatusWRFlushErr {
		t.Fatalf("%+v", rc)
	}
	s.qp.PostSend(transport.SendWR{ID: 78, Opcode: transport.OpSend})
	if wc := poll(t, s.scq, 1)[0]; wc.ID != 78 || wc.Status != transport.StatusWRFlushErr {
		t.Fatalf("%+v", wc)
	}
}
