package rxe

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// exitGrace is how long qemu may take to power off after the payload's
// exit marker before it is killed.
const exitGrace = 10 * time.Second

// guestSpec is one qemu process to start.
type guestSpec struct {
	payload Payload
	net     netConfig
	nic     []string // extra qemu arguments for the NIC, if any
}

// kvmFailed is set once qemu failed to run a guest under KVM: some hosts
// (nested virtualization) expose /dev/kvm yet reject the vCPU set-up
// ("failed to set MSR ..."). Every later guest then runs under TCG.
var kvmFailed atomic.Bool

// kvmBootLimit: a guest boots to READY in about a second under KVM and 3 s
// under TCG here; one that has not after this under KVM never will.
const kvmBootLimit = 30 * time.Second

var errKVMHang = errors.New("kvm guest hung before boot")

// accelArgs uses KVM when this host has it and TCG otherwise;
// RDMAGRPC_RXE_ACCEL=tcg or =kvm forces one.
func accelArgs() []string {
	tcg := []string{"-accel", "tcg"}
	switch os.Getenv("RDMAGRPC_RXE_ACCEL") {
	case "tcg":
		return tcg
	case "kvm":
		return []string{"-accel", "kvm", "-cpu", "host"}
	}
	if kvmFailed.Load() {
		return tcg
	}
	if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err == nil {
		f.Close()
		return []string{"-accel", "kvm", "-cpu", "host"}
	}
	return tcg
}

// runGuest boots one guest, runs the payload and returns when qemu is
// gone. When KVM was chosen and qemu died on it before booting, it says so
// and runs the guest again under TCG.
func (img *Image) runGuest(ctx context.Context, g guestSpec) (Result, error) {
	accel := accelArgs()
	res, err := img.runGuestWith(ctx, g, accel)
	if err != nil && accel[1] == "kvm" && res.Boot == 0 && os.Getenv("RDMAGRPC_RXE_ACCEL") == "" &&
		(errors.Is(err, errKVMHang) || strings.Contains(err.Error(), "kvm")) && ctx.Err() == nil {
		if !kvmFailed.Swap(true) {
			fmt.Fprintf(os.Stderr, "rxe: qemu cannot run guests under KVM on this host, using TCG from now on: %v\n", firstLine(err.Error()))
		}
		return img.runGuestWith(ctx, g, accelArgs())
	}
	return res, err
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// runGuestWith boots one guest with the accelerator arguments accel. qemu runs in its own process group with a parent-death signal, and
// every return path kills the group, so no qemu outlives this call or the
// calling process.
func (img *Image) runGuestWith(ctx context.Context, g guestSpec, accel []string) (res Result, err error) {
	dir, err := os.MkdirTemp("", "rxe-run-")
	if err != nil {
		return res, fmt.Errorf("rxe: %w", err)
	}
	defer os.RemoveAll(dir)
	nonce := newNonce()
	initrd := filepath.Join(dir, "initrd")
	if err := img.writeInitrd(initrd, g, nonce); err != nil {
		return res, err
	}
	console := filepath.Join(dir, "console.log")
	mem, cpus := img.MemoryMiB, img.CPUs
	if mem <= 0 {
		mem = 2048
	}
	if cpus <= 0 {
		cpus = 2
	}
	args := []string{
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-m", fmt.Sprint(mem), "-smp", fmt.Sprint(cpus),
		"-kernel", img.Kernel, "-initrd", initrd,
		"-append", kernelArgs(),
		"-serial", "file:" + console, // ttyS0: kernel console
		"-serial", "stdio", // ttyS1: payload output and markers
	}
	args = append(args, accel...)
	args = append(args, g.nic...)
	cmd := exec.Command(img.Qemu, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return res, fmt.Errorf("rxe: %w", err)
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("rxe: start qemu: %w", err)
	}
	pgid := cmd.Process.Pid
	kill := sync.OnceFunc(func() { _ = syscall.Kill(-pgid, syscall.SIGKILL) })
	defer kill()

	sp := newSerialParser(nonce, g.payload.Stream)
	sp.start = start
	parsed := make(chan struct{})
	go func() {
		defer close(parsed)
		sp.consume(stdout)
	}()
	waited := make(chan error, 1)
	go func() {
		<-parsed // Wait closes stdout; read it all first
		waited <- cmd.Wait()
	}()

	// Some hosts (a microVM's nested KVM) open /dev/kvm, accept the vCPUs
	// and then run the guest at full CPU without it ever printing: a guest
	// not ready within kvmBootLimit under KVM is given up, and runGuest
	// falls back to TCG.
	var bootLimit <-chan time.Time
	if accel[1] == "kvm" {
		t := time.NewTimer(kvmBootLimit)
		defer t.Stop()
		bootLimit = t.C
	}
	var waitErr error
	for done := false; !done; {
		select {
		case <-bootLimit:
			bootLimit = nil
			select {
			case <-sp.ready:
				continue
			default:
			}
			kill()
			<-waited
			return res, fmt.Errorf("rxe: guest %s: not ready after %v under kvm: %w", g.net.role, kvmBootLimit, errKVMHang)
		case waitErr = <-waited:
			done = true
		case <-sp.exited:
			select {
			case waitErr = <-waited:
			case <-time.After(exitGrace):
				kill()
				waitErr = <-waited
			case <-ctx.Done():
				kill()
				<-waited
			}
			done = true
		case <-ctx.Done():
			kill()
			<-waited
			done = true
		}
	}
	res.Duration = time.Since(start)
	res.Boot, res.Run = sp.boot, sp.run
	res.Output = sp.out.Bytes()
	res.ExitCode = sp.exitCode
	if b, rerr := os.ReadFile(console); rerr == nil {
		res.Console = string(b)
	}
	switch {
	case sp.haveExit:
		return res, nil
	case ctx.Err() != nil:
		return res, fmt.Errorf("rxe: guest %s: %w (ready=%v, output so far %d bytes)%s",
			g.net.role, ctx.Err(), sp.boot > 0, len(res.Output), consoleTail(res.Console))
	case sp.failure != "":
		return res, fmt.Errorf("rxe: guest %s set-up failed: %s\ninit output:\n\t%s%s", g.net.role, sp.failure,
			strings.ReplaceAll(strings.TrimSpace(sp.setup.String()), "\n", "\n\t"), consoleTail(res.Console))
	default:
		return res, fmt.Errorf("rxe: guest %s: qemu exited (%v) without an exit marker: %s%s",
			g.net.role, waitErr, strings.TrimSpace(stderr.String()), consoleTail(res.Console))
	}
}

// writeInitrd concatenates the base initramfs and the per-run archive;
// the kernel unpacks concatenated cpio archives in order.
func (img *Image) writeInitrd(dst string, g guestSpec, nonce string) error {
	out, err := os.Create(dst)
	if err != nil {
		return fmt.Errorf("rxe: %w", err)
	}
	defer out.Close()
	base, err := os.Open(img.Initrd)
	if err != nil {
		return fmt.Errorf("rxe: base initramfs: %w", err)
	}
	defer base.Close()
	if _, err := io.Copy(out, base); err != nil {
		return fmt.Errorf("rxe: base initramfs: %w", err)
	}
	if err := writeRunArchive(out, g.payload, g.net, nonce); err != nil {
		return err
	}
	return out.Close()
}

func consoleTail(c string) string {
	lines := strings.Split(strings.TrimRight(c, "\n"), "\n")
	if len(lines) > 25 {
		lines = lines[len(lines)-25:]
	}
	if len(lines) == 0 || (len(lines) == 1 && lines[0] == "") {
		return ""
	}
	return "\nkernel console (tail):\n\t" + strings.Join(lines, "\n\t")
}

// serialParser reads ttyS1: set-up lines, the READY marker, payload
// output, and the EXIT marker.
type serialParser struct {
	nonce  string
	stream io.Writer
	start  time.Time

	out       bytes.Buffer
	setup     bytes.Buffer // ttyS1 lines before READY: the init's own messages
	boot, run time.Duration
	exitCode  int
	haveExit  bool
	failure   string
	exited    chan struct{} // closed when the EXIT marker arrives
	ready     chan struct{} // closed when the READY marker arrives
}

func newSerialParser(nonce string, stream io.Writer) *serialParser {
	return &serialParser{nonce: nonce, stream: stream, exited: make(chan struct{}), ready: make(chan struct{})}
}

// consume processes the stream until EOF. The init script prints a
// newline before the EXIT marker, so the line held back before the marker
// is written without its newline: Output is byte-exact.
func (p *serialParser) consume(r io.Reader) {
	br := bufio.NewReaderSize(r, 64<<10)
	ready, exitPfx := "@@RXE-"+p.nonce+"-READY@@", "@@RXE-"+p.nonce+"-EXIT "
	failPfx := "@@RXE-" + p.nonce + "-FAIL "
	var pending []byte
	havePending := false
	inPayload := false
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			body := bytes.TrimSuffix(line, []byte("\n"))
			// Markers are compared without a stray \r, in case stty failed.
			s := strings.TrimSuffix(string(body), "\r")
			switch {
			case !inPayload && s == ready:
				inPayload = true
				p.boot = time.Since(p.start)
				close(p.ready)
			case !inPayload && strings.HasPrefix(s, failPfx):
				p.failure = strings.TrimSuffix(strings.TrimPrefix(s, failPfx), "@@")
			case !inPayload && !p.haveExit:
				if p.setup.Len() < 64<<10 {
					p.setup.Write(line)
				}
			case inPayload && strings.HasPrefix(s, exitPfx):
				if havePending {
					p.emit(pending)
				}
				havePending = false
				var rc int
				if _, serr := fmt.Sscanf(strings.TrimPrefix(s, exitPfx), "%d@@", &rc); serr == nil {
					p.exitCode, p.haveExit = rc, true
					p.run = time.Since(p.start) - p.boot
					close(p.exited)
				}
				inPayload = false
			case inPayload:
				if havePending {
					p.emit(append(pending, '\n'))
				}
				pending, havePending = append([]byte(nil), body...), true
				if !strings.HasSuffix(string(line), "\n") {
					// EOF mid-line: the guest died; keep what we have.
					p.emit(pending)
					havePending = false
				}
			}
		}
		if err != nil {
			if havePending {
				p.emit(append(pending, '\n'))
			}
			return // io.EOF, or the pipe closed under us when qemu was killed
		}
	}
}

func (p *serialParser) emit(b []byte) {
	p.out.Write(b)
	if p.stream != nil && len(b) > 0 {
		_, _ = p.stream.Write(b)
	}
}

// kernelArgs is the guest kernel's command line, with RXE_APPEND's words
// after ours. tsc=reliable: under TCG the kernel finds the vCPUs' TSCs
// unsynchronised and falls back to the HPET, whose every read is a system
// call and an emulated device access; a real host reads its clock in the
// vDSO. TCG's TSC follows one virtual clock for every vCPU, so it is
// safe, and clock reads then cost what they cost on hardware: the Go
// runtime reads the clock far more often than perftest does, and an
// emulated HPET charged that to us alone.
func kernelArgs() string {
	return strings.TrimSpace("console=ttyS0 loglevel=4 panic=-1 rdinit=/init mitigations=off tsc=reliable " + os.Getenv("RXE_APPEND"))
}
