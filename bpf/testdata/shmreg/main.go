// Command shmreg registers memory through the real shm provider, for the
// bpf tests: after a line on stdin it makes n successful registrations
// (each deregistered) and fail failing ones (remote write without local
// write, which the provider refuses), prints "done" and exits.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
)

func main() {
	n := flag.Int("n", 10, "successful registrations (each then deregistered)")
	fail := flag.Int("fail", 0, "registrations the provider refuses")
	size := flag.Int("size", 1<<16, "bytes per region")
	flag.Parse()
	if err := run(*n, *fail, *size); err != nil {
		fmt.Fprintln(os.Stderr, "shmreg:", err)
		os.Exit(1)
	}
}

func run(n, fail, size int) error {
	p, err := transport.Get("shm")
	if err != nil {
		return err
	}
	dev, err := p.Open("")
	if err != nil {
		return fmt.Errorf("open shm device: %w", err)
	}
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

	fmt.Println("ready")
	if !bufio.NewScanner(os.Stdin).Scan() {
		return fmt.Errorf("stdin closed before the start line")
	}
	start := time.Now()
	for i := range n {
		mr, err := pd.RegMR(mem, transport.AccessLocalWrite|transport.AccessRemoteWrite)
		if err != nil {
			return fmt.Errorf("registration %d: %w", i, err)
		}
		if err := mr.Dereg(); err != nil {
			return fmt.Errorf("deregistration %d: %w", i, err)
		}
	}
	if n > 0 {
		fmt.Fprintf(os.Stderr, "shmreg: %.0f ns per RegMR+Dereg pair\n", float64(time.Since(start).Nanoseconds())/float64(n))
	}
	for i := range fail {
		if mr, err := pd.RegMR(mem, transport.AccessRemoteWrite); err == nil {
			mr.Dereg()
			return fmt.Errorf("refused registration %d was accepted", i)
		}
	}
	fmt.Println("done")
	return nil
}
