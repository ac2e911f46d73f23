// Command goreg is a test target for bpf's Go probes: it defines functions
// with the exact shapes of rdmagrpc's probe points (transport/shm regMR and
// deregMR, conn's enlargementMarker) under package main, so the probes'
// register layouts are tested without depending on those packages, waits for a line
// on stdin so the tracer can attach first, makes a scripted number of
// calls, prints "done" and waits for stdin to close.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// park makes regMR block mid-call so its goroutine can resume on another
// OS thread before it returns: probes must match calls by goroutine.
var park time.Duration

const einval = 22

var nextKey atomic.Uint32

//go:noinline
func regMR(addr, length uint64, access uint32, pdID uint32) (key uint32, errno int32) {
	if length == 0 || pdID == 0 {
		return 0, einval
	}
	if park > 0 {
		time.Sleep(park)
	}
	return nextKey.Add(1), 0
}

//go:noinline
func deregMR(addr, length uint64, key uint32, pdID uint32) (errno int32) {
	if key == 0 {
		return einval
	}
	return 0
}

//go:noinline
func enlargementMarker(connID uint64, fromSize, toSize uint32, durationNanos int64, outcome uint32) {
	_, _, _, _, _ = connID, fromSize, toSize, durationNanos, outcome
}

func main() {
	n := flag.Int("n", 10, "successful registrations per goroutine (each then deregistered)")
	fail := flag.Int("fail", 0, "failing registrations per goroutine (empty region)")
	enl := flag.Int("enlarge", 0, "enlargement markers per goroutine")
	gs := flag.Int("g", 1, "goroutines")
	size := flag.Int("size", 4096, "bytes per region")
	flag.DurationVar(&park, "park", 0, "sleep inside regMR (forces goroutine migration)")
	repeat := flag.Bool("repeat", false, "repeat the script for every stdin line until EOF")
	bench := flag.Int("bench", 0, "instead: time this many regMR+deregMR pairs, print ns per pair")
	flag.Parse()

	mem := make([]byte, *size)
	addr := uint64(uintptr(unsafe.Pointer(&mem[0])))
	length := uint64(len(mem))
	in := bufio.NewScanner(os.Stdin)
	fmt.Println("ready")
	if *bench > 0 {
		if !in.Scan() {
			return
		}
		start := time.Now()
		for range *bench {
			key, _ := regMR(addr, length, 7, 1)
			deregMR(addr, length, key, 1)
		}
		fmt.Printf("%.1f\n", float64(time.Since(start).Nanoseconds())/float64(*bench))
		return
	}
	for in.Scan() {
		var wg sync.WaitGroup
		for g := range *gs {
			wg.Go(func() {
				for i := range *n {
					key, errno := regMR(addr, length, 7, 1)
					if errno != 0 {
						panic(fmt.Sprintf("regMR %d: errno %d", i, errno))
					}
					deregMR(addr, length, key, 1)
				}
				for range *fail {
					regMR(addr, 0, 7, 1)
				}
				for i := range *enl {
					enlargementMarker(uint64(g)<<32|uint64(i), 1024, 65536, int64(1500+i), 1)
				}
			})
		}
		wg.Wait()
		fmt.Println("done")
		if !*repeat {
			break
		}
	}
}
