// Command verbsreg registers memory through rdmagrpc's verbs provider on
// a real RDMA device, for bpf's guest tests (the rxe qemu guest has no Go
// toolchain: tests/rxe builds this on the host and ships it in). It
// prints "nodevice" and exits 0 where no device is usable; otherwise
// "ready", then waits for a line on stdin. With -mode probe it stops
// after "ready": a check that a device is usable.
//
//	verbsreg -mode reg -n N -size S -pool K
//
// makes N PD.RegMR + MR.Dereg pairs of S bytes, then takes K buffers of S
// bytes from a bufpool at once and discards them (K registrations and K
// deregistrations through the pool), prints one JSON line saying what it
// registered, then "done".
//
//	verbsreg -mode conn -n N -addr IP:0
//
// opens N rdmagrpc connection pairs over verbs and writes one message
// above the threshold on each (the writer enlarges, the reader
// provisions), prints one JSON line with the registered bytes every
// connection reports, waits for a second line on stdin, closes them all
// and prints "done".
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime/debug"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/transport"
	"github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

// Region is one registration the provider returned.
type Region struct {
	Addr   uint64 `json:"addr"`
	Len    int    `json:"len"`
	LKey   uint32 `json:"lkey"`
	RKey   uint32 `json:"rkey"`
	Access uint32 `json:"access"`
	Via    string `json:"via"` // "pd" or "bufpool"
}

// RegReport is what -mode reg did.
type RegReport struct {
	Regions  []Region `json:"regions"`
	Deregs   int      `json:"deregs"`
	PoolRegs uint64   `json:"pool_registrations"`
	PoolDone uint64   `json:"pool_deregistrations"`
}

// ConnReport is what -mode conn did: per connection, its Stats.
type ConnReport struct {
	Pairs           int   `json:"pairs"`
	RegisteredBytes int64 `json:"registered_bytes"` // all connections, both ends
	Enlargements    int   `json:"enlargements"`
	Served          int   `json:"served"`
	FromSize        int   `json:"from_size"`
	ToSize          int   `json:"to_size"`
}

func main() {
	mode := flag.String("mode", "reg", "reg, conn or probe")
	n := flag.Int("n", 10, "reg: PD.RegMR+Dereg pairs; conn: connection pairs")
	size := flag.Int("size", 1<<16, "reg: bytes per region")
	pool := flag.Int("pool", 0, "reg: buffers taken from a bufpool at once, then discarded")
	addr := flag.String("addr", "", "conn: listen address (IP:0 of the RDMA netdev)")
	limit := flag.Duration("limit", 2*time.Minute, "exit with every goroutine's stack after this long: a hung helper names where it hangs instead of stalling its test")
	flag.Parse()
	debug.SetTraceback("all")
	time.AfterFunc(*limit, func() { panic(fmt.Sprintf("verbsreg -mode %s: still running after %v", *mode, *limit)) })
	p, err := transport.Get(verbs.Name)
	if err != nil {
		fail(err)
	}
	dev, err := p.Open(os.Getenv("RDMAGRPC_VERBS_DEVICE"))
	if errors.Is(err, transport.ErrUnavailable) {
		fmt.Println("nodevice")
		fmt.Fprintln(os.Stderr, "verbsreg:", err)
		return
	}
	if err != nil {
		fail(err)
	}
	in := bufio.NewScanner(os.Stdin)
	switch *mode {
	case "probe":
		dev.Close()
		fmt.Println("ready")
		return
	case "reg":
		err = regs(dev, in, *n, *size, *pool)
	case "conn":
		dev.Close() // conn opens its own
		err = conns(in, *n, *addr)
	default:
		err = fmt.Errorf("unknown -mode %q", *mode)
	}
	if err != nil {
		fail(err)
	}
	fmt.Println("done")
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "verbsreg:", err)
	os.Exit(1)
}

func report(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	fmt.Println(string(b))
	return nil
}

func regs(dev transport.Device, in *bufio.Scanner, n, size, k int) error {
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		return fmt.Errorf("alloc PD: %w", err)
	}
	defer pd.Close()
	mem, err := dev.AllocMemory(size)
	if err != nil {
		return fmt.Errorf("alloc memory: %w", err)
	}
	defer dev.FreeMemory(mem)
	// MaxFree -1: a returned buffer is deregistered at once, so every Get
	// below is one ibv_reg_mr and every Discard one ibv_dereg_mr.
	bp, err := bufpool.New(dev, pd, bufpool.Options{MaxFree: -1})
	if err != nil {
		return err
	}
	defer bp.Close()
	fmt.Println("ready")
	if !in.Scan() {
		return errors.New("stdin closed before the start line")
	}
	const access = transport.AccessLocalWrite | transport.AccessRemoteWrite
	var r RegReport
	for i := range n {
		mr, err := pd.RegMR(mem, access)
		if err != nil {
			return fmt.Errorf("registration %d: %w", i, err)
		}
		r.Regions = append(r.Regions, Region{Addr: mr.Addr(), Len: mr.Len(), LKey: mr.LKey(), RKey: mr.RKey(), Access: uint32(access), Via: "pd"})
		if err := mr.Dereg(); err != nil {
			return fmt.Errorf("deregistration %d: %w", i, err)
		}
		r.Deregs++
	}
	var held []*bufpool.Buffer
	for i := range k {
		b, err := bp.Get(bufpool.Owner(i+1), size, access)
		if err != nil {
			return fmt.Errorf("bufpool get %d: %w", i, err)
		}
		held = append(held, b)
		r.Regions = append(r.Regions, Region{Addr: b.Addr(), Len: b.Len(), LKey: b.LKey(), RKey: b.RKey(), Access: uint32(access), Via: "bufpool"})
	}
	for i, b := range held {
		if err := b.Discard(); err != nil {
			return fmt.Errorf("bufpool discard %d: %w", i, err)
		}
		r.Deregs++
	}
	st := bp.Stats()
	r.PoolRegs, r.PoolDone = st.Registrations, st.Deregistrations
	return report(r)
}

func conns(in *bufio.Scanner, n int, addr string) error {
	if addr == "" {
		return errors.New("-mode conn needs -addr")
	}
	fmt.Println("ready")
	if !in.Scan() {
		return errors.New("stdin closed before the start line")
	}
	var all []net.Conn
	defer func() {
		for _, c := range all {
			c.Close()
		}
	}()
	for i := range n {
		c, s, err := pair(addr)
		if err != nil {
			return fmt.Errorf("pair %d: %w", i, err)
		}
		all = append(all, c, s)
	}
	var r ConnReport
	r.Pairs = n
	for _, c := range all {
		st := c.(*conn.Conn).Stats()
		r.RegisteredBytes += st.RegisteredBytes
		r.Enlargements += st.Enlargements
		r.Served += st.EnlargementsServed
		if st.Enlargements > 0 {
			r.FromSize, r.ToSize = st.LastEnlargeFrom, st.LastEnlargeTo
		}
	}
	if err := report(r); err != nil {
		return err
	}
	if !in.Scan() {
		return errors.New("stdin closed before the close line")
	}
	var errs []error
	for _, c := range all {
		errs = append(errs, c.Close())
	}
	all = nil
	conn.ReleaseKits() // the closed connections' PDs and rings, kept for later ones otherwise
	return errors.Join(errs...)
}

// pair opens one connection over verbs and enlarges its client→server
// direction with one message above the threshold.
func pair(addr string) (client, server net.Conn, err error) {
	ctx := context.Background()
	l, err := conn.Listen(ctx, addr, conn.WithProvider(verbs.Name))
	if err != nil {
		return nil, nil, err
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	acceptErr := make(chan error, 1)
	go func() {
		s, err := l.Accept()
		if err != nil {
			acceptErr <- err
			return
		}
		accepted <- s
	}()
	c, err := conn.Dial(ctx, l.Addr().String(), conn.WithProvider(verbs.Name))
	if err != nil {
		return nil, nil, err
	}
	var s net.Conn
	select {
	case s = <-accepted:
	case err := <-acceptErr:
		c.Close()
		return nil, nil, fmt.Errorf("accept: %w", err)
	}
	msg := make([]byte, 64<<10)
	done := make(chan error, 1)
	go func() { _, err := io.ReadFull(s, make([]byte, len(msg))); done <- err }()
	if _, err := c.Write(msg); err != nil {
		c.Close()
		s.Close()
		return nil, nil, err
	}
	if err := <-done; err != nil {
		c.Close()
		s.Close()
		return nil, nil, err
	}
	return c, s, nil
}
