package shm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// The attack the shm isolation is for. A server process S has two
// clients: A, a victim whose connection carries a canary both ways, and B,
// a hostile process of the same user that completes the handshake, then
// bypasses every check: it asks S for the memfd behind every key in S's MR
// table it was handed, maps every descriptor it gets, scans all of it for
// A's canary, and overwrites all of it. A's canary must never be found,
// and A's connection must be intact afterwards. Connections are set up as
// conn sets them up: on the device of the peer process (Router.DeviceFor,
// RequestDevice); a build without those falls back to the one device.

const (
	isoEnv    = "RDMAGRPC_SHM_ISO"      // helper mode: victim or hostile
	isoAddr   = "RDMAGRPC_SHM_ISO_ADDR" // S's address
	isoCanary = "rdmagrpc-isolation-canary-"
)

func canary(b []byte) {
	for i := 0; i+len(isoCanary) <= len(b); i += len(isoCanary) {
		copy(b[i:], isoCanary)
	}
}

// isoSide is one end's PD, CQ and registered memory.
type isoSide struct {
	dev transport.Device
	pd  transport.PD
	cq  transport.CQ
	mem []byte
	mr  transport.MR
}

func newIsoSide(dev transport.Device) (*isoSide, error) {
	s := &isoSide{dev: dev}
	var err error
	if s.pd, err = dev.AllocPD(); err != nil {
		return nil, err
	}
	if s.cq, err = dev.CreateCQ(64); err != nil {
		return nil, err
	}
	if s.mem, err = dev.AllocMemory(64 << 10); err != nil {
		return nil, err
	}
	s.mr, err = s.pd.RegMR(s.mem, transport.AccessLocalWrite|transport.AccessRemoteWrite|transport.AccessRemoteRead)
	return s, err
}

func (s *isoSide) cfg() transport.QPConfig {
	return transport.QPConfig{PD: s.pd, SendCQ: s.cq, RecvCQ: s.cq, MaxSendWR: 16, MaxRecvWR: 8, MaxSendSGE: 1, MaxRecvSGE: 1,
		RNRRetry: 7, MinRNRTimer: time.Millisecond, RetryCount: 7}
}

func (s *isoSide) private() []byte {
	b := binary.LittleEndian.AppendUint64(nil, s.mr.Addr())
	return binary.LittleEndian.AppendUint32(b, s.mr.RKey())
}

func remote(priv []byte) (uint64, uint32) {
	return binary.LittleEndian.Uint64(priv), binary.LittleEndian.Uint32(priv[8:])
}

// write RDMA-writes n bytes from off of s.mem to raddr and waits for it.
func (s *isoSide) write(qp transport.QP, off, n int, raddr uint64, rkey uint32) error {
	if _, err := qp.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpWrite, Signaled: true, RemoteAddr: raddr, RKey: rkey,
		SG: []transport.SGE{{Addr: s.mr.Addr() + uint64(off), Length: uint32(n), LKey: s.mr.LKey()}}}); err != nil {
		return err
	}
	wc := make([]transport.WorkCompletion, 1)
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); {
		if k, err := s.cq.Poll(wc); err != nil || k == 1 {
			if err == nil && wc[0].Status != transport.StatusSuccess {
				err = errors.New(wc[0].Status.String())
			}
			return err
		}
		time.Sleep(100 * time.Microsecond)
	}
	return errors.New("write did not complete")
}

// dialIso connects to addr the way conn does.
func dialIso(ctx context.Context, addr string) (*isoSide, transport.QP, error) {
	p, _ := transport.Get(ProviderName)
	d, err := p.Open("")
	if err != nil {
		return nil, nil, err
	}
	dev := d
	if r, ok := d.(transport.Router); ok {
		if dev, err = r.DeviceFor(ctx, addr); err != nil {
			return nil, nil, err
		}
	}
	s, err := newIsoSide(dev)
	if err != nil {
		return nil, nil, err
	}
	qp, err := dev.Connect(ctx, addr, s.cfg(), s.private())
	return s, qp, err
}

// isoHelper is the body of a helper process; it talks over stdin/stdout.
func isoHelper(mode string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, conn, err := dialIso(ctx, os.Getenv(isoAddr))
	if err != nil {
		return err
	}
	raddr, rkey := remote(conn.PeerPrivate())
	in := bufio.NewScanner(os.Stdin)
	switch mode {
	case "victim":
		canary(s.mem[:32<<10])
		if err := s.write(conn, 0, 32<<10, raddr, rkey); err != nil {
			return err
		}
		fmt.Println("written")
		in.Scan() // S wrote "after" into our memory at 40 KiB
		if !bytes.HasPrefix(s.mem[40<<10:], []byte("after")) {
			fmt.Println("broken")
			return nil
		}
		fmt.Println("intact")
	case "hostile":
		// Legitimate first: a write into what S granted us, which maps
		// the arena behind it.
		copy(s.mem, "hello")
		if err := s.write(conn, 0, 5, raddr, rkey); err != nil {
			return err
		}
		q := conn.(*qp)
		// Then forge: a memfd request for every key in S's table.
		asked, got := 0, 0
		for idx := range mrEntries {
			key := atomic.LoadUint32(word32(q.peer.mrt, idx*mrEntrySize+mrKey))
			if key == 0 {
				continue
			}
			e, ok := q.peer.mrt.lookup(key)
			if !ok {
				continue
			}
			asked++
			q.sendMu.Lock()
			if _, err := q.peerMem(&e); err == nil {
				got++
			}
			q.sendMu.Unlock()
		}
		// Scan everything mapped of S, then overwrite it.
		found := false
		peerMaps.Lock()
		n := 0
		for _, m := range peerMaps.m {
			n += len(m.mem)
			if bytes.Contains(m.mem, []byte(isoCanary)) {
				found = true
			}
			for i := range m.mem {
				m.mem[i] = 0x5a
			}
		}
		peerMaps.Unlock()
		fmt.Printf("asked %d got %d mapped %d found %v\n", asked, got, n, found)
	}
	io.Copy(io.Discard, os.Stdin) // until S is done
	return nil
}

func startIso(t *testing.T, mode, addr string) (*bufio.Scanner, io.WriteCloser) {
	t.Helper()
	if os.Getenv(isoLauncher) != "" {
		return launchIso(t, mode, addr)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(os.Environ(), isoEnv+"="+mode, isoAddr+"="+addr)
	cmd.Stderr = os.Stderr
	out, _ := cmd.StdoutPipe()
	in, _ := cmd.StdinPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Wait() })
	return bufio.NewScanner(out), in
}

func TestIsolationBetweenPeerProcesses(t *testing.T) {
	p, _ := transport.Get(ProviderName)
	d, err := p.Open("")
	if err != nil {
		t.Fatal(err)
	}
	l, err := d.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	accept := func() (*isoSide, transport.QP) {
		t.Helper()
		r, err := l.Accept(ctx)
		if err != nil {
			t.Fatal(err)
		}
		dev := d
		if rd, ok := r.(transport.RequestDevice); ok {
			dev = rd.Device()
		}
		s, err := newIsoSide(dev)
		if err != nil {
			t.Fatal(err)
		}
		if os.Getenv(isoLauncher) != "" && r.(*connReq).peer.pid != 0 {
			t.Fatalf("in its own PID namespace the listener sees its client as pid %d", r.(*connReq).peer.pid)
		}
		qp, err := r.Accept(ctx, s.cfg(), s.private())
		if err != nil {
			t.Fatal(err)
		}
		return s, qp
	}
	addr := l.Addr().String()

	va, vaIn := startIso(t, "victim", addr)
	sa, qa := accept()
	if !va.Scan() || va.Text() != "written" {
		t.Fatalf("victim: %q", va.Text())
	}
	if !bytes.Contains(sa.mem, []byte(isoCanary)) {
		t.Fatal("the victim's canary did not arrive")
	}
	canary(sa.mem[32<<10 : 40<<10]) // ours, for the victim, too

	ho, hoIn := startIso(t, "hostile", addr)
	sb, _ := accept()
	if !ho.Scan() {
		t.Fatal("hostile helper said nothing")
	}
	report := ho.Text()
	t.Logf("hostile process: %s", report)
	if !strings.HasSuffix(report, "found false") {
		t.Errorf("the hostile process found the victim's canary in memory it was handed: %s", report)
	}
	hoIn.Close()
	if bytes.Contains(sb.mem, []byte(isoCanary)) {
		t.Error("the hostile connection's buffer holds the canary")
	}
	// The victim's memory here and its connection are untouched.
	want := make([]byte, 32<<10)
	canary(want)
	if !bytes.Equal(sa.mem[:32<<10], want) {
		t.Error("the hostile process's writes reached the victim's buffer")
	}
	raddr, rkey := remote(qa.PeerPrivate())
	copy(sa.mem[40<<10:], "after")
	if err := sa.write(qa, 40<<10, 5, raddr+40<<10, rkey); err != nil {
		t.Fatalf("the victim's connection after the attack: %v", err)
	}
	fmt.Fprintln(vaIn, "check")
	if !va.Scan() || va.Text() != "intact" {
		t.Errorf("victim after the attack: %q", va.Text())
	}
}

// A listener in a container sees its clients outside through namespaces:
// in its own PID namespace their pids read 0, and in its own user
// namespace their uids may all read as the overflow uid. Isolation must
// not rest on telling them apart by either. The same attack runs with
// the listener (this test binary, running TestIsolationBetweenPeerProcesses)
// in a PID namespace, then in a PID and a user namespace, and its clients
// outside both: started by a launcher process here, which hands each
// client's pipes to the listener over a unix socket.

const isoLauncher = "RDMAGRPC_SHM_ISO_LAUNCHER" // set: fd 3 reaches the launcher

func TestIsolationListenerInNamespaces(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to make PID and user namespaces")
	}
	for _, ns := range []struct {
		name  string
		flags uintptr
	}{
		{"pid", syscall.CLONE_NEWPID},
		{"pid+user", syscall.CLONE_NEWPID | syscall.CLONE_NEWUSER},
	} {
		t.Run(ns.name, func(t *testing.T) {
			fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			launcherEnd, listenerEnd := os.NewFile(uintptr(fds[0]), "launcher"), os.NewFile(uintptr(fds[1]), "listener")
			defer launcherEnd.Close()
			defer listenerEnd.Close()
			go launcher(t, launcherEnd)

			self, err := os.Executable()
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(self, "-test.run=^TestIsolationBetweenPeerProcesses$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), isoLauncher+"=1")
			cmd.ExtraFiles = []*os.File{listenerEnd}
			cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: ns.flags}
			if ns.flags&syscall.CLONE_NEWUSER != 0 {
				cmd.SysProcAttr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 0, Size: 1}}
				cmd.SysProcAttr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 0, Size: 1}}
			}
			out, err := cmd.CombinedOutput()
			if errors.Is(err, syscall.EPERM) && ns.flags&syscall.CLONE_NEWUSER != 0 {
				// A chroot (the tier without rdma-core runs in one) may
				// not make user namespaces; the tier outside runs this.
				t.Skipf("no user namespace here: %v", err)
			}
			if err != nil || !strings.Contains(string(out), "--- PASS: TestIsolationBetweenPeerProcesses") {
				t.Fatalf("the listener in a %s namespace: %v\n%s", ns.name, err, out)
			}
			for _, line := range strings.Split(string(out), "\n") {
				if strings.Contains(line, "hostile process:") {
					t.Log(strings.TrimSpace(line))
				}
			}
		})
	}
}

// launcher starts a client of the isolation test for each request on s
// ("mode addr") and sends back its stdout and stdin.
func launcher(t *testing.T, s *os.File) {
	self, err := os.Executable()
	if err != nil {
		t.Error(err)
		return
	}
	buf := make([]byte, 512)
	for {
		n, err := s.Read(buf)
		if err != nil || n == 0 {
			return
		}
		mode, addr, _ := strings.Cut(string(buf[:n]), " ")
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(os.Environ(), isoEnv+"="+mode, isoAddr+"="+addr)
		cmd.Stderr = os.Stderr
		outR, outW, err := os.Pipe()
		if err != nil {
			t.Error(err)
			return
		}
		inR, inW, err := os.Pipe()
		if err != nil {
			t.Error(err)
			return
		}
		cmd.Stdout, cmd.Stdin = outW, inR
		if err := cmd.Start(); err != nil {
			t.Error(err)
			return
		}
		outW.Close()
		inR.Close()
		go cmd.Wait()
		rights := unix.UnixRights(int(outR.Fd()), int(inW.Fd()))
		err = unix.Sendmsg(int(s.Fd()), []byte("ok"), rights, nil, 0)
		outR.Close()
		inW.Close()
		if err != nil {
			t.Error(err)
			return
		}
	}
}

// launchIso asks the launcher outside this process's namespaces for a
// client of the isolation test.
func launchIso(t *testing.T, mode, addr string) (*bufio.Scanner, io.WriteCloser) {
	t.Helper()
	s := os.NewFile(3, "launcher")
	if _, err := s.Write([]byte(mode + " " + addr)); err != nil {
		t.Fatal(err)
	}
	buf, oob := make([]byte, 16), make([]byte, unix.CmsgSpace(8))
	_, oobn, _, _, err := unix.Recvmsg(int(s.Fd()), buf, oob, 0)
	if err != nil {
		t.Fatal(err)
	}
	fds := parseRights(oob[:oobn])
	if len(fds) != 2 {
		t.Fatalf("launcher sent %d descriptors", len(fds))
	}
	out, in := os.NewFile(uintptr(fds[0]), "client stdout"), os.NewFile(uintptr(fds[1]), "client stdin")
	t.Cleanup(func() {
		// As startIso waits for its client: the client exits once its
		// stdin closes, and its stdout ends with it.
		in.Close()
		out.SetReadDeadline(time.Now().Add(10 * time.Second))
		io.Copy(io.Discard, out)
		out.Close()
	})
	return bufio.NewScanner(out), in
}
