package bpf_test

import (
	"fmt"
	"log"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bpf"
)

// Trace every libibverbs registration on the machine for ten seconds.
func Example() {
	tr, err := bpf.Open(bpf.Options{}) // PID 0: all processes
	if err != nil {
		log.Fatal(err) // not root, or no BPF
	}
	defer tr.Close()
	lib, err := bpf.FindLibibverbs(0)
	if err != nil {
		log.Fatal(err)
	}
	if err := tr.AttachLibibverbs(lib); err != nil {
		log.Print(err) // some entry points missing; the others are attached
	}
	tr.SetDeadline(time.Now().Add(10 * time.Second))
	for {
		ev, err := tr.Read()
		if err != nil {
			break // deadline passed
		}
		fmt.Printf("%s pid %d %s %d bytes in %v ok=%v\n", ev.Kind, ev.PID, ev.Func, ev.Length, ev.Duration, ev.OK)
	}
}

// Trace rdmagrpc's shm registrations and enlargements in one Go program.
func ExampleTracer_AttachGoFuncs() {
	tr, err := bpf.Open(bpf.Options{PID: 4242})
	if err != nil {
		log.Fatal(err)
	}
	defer tr.Close()
	found, err := tr.AttachGoFuncs("/proc/4242/exe", bpf.KnownGoFuncs)
	if err != nil {
		log.Fatal(err) // not an rdmagrpc binary, or stripped
	}
	fmt.Println("probing", found)
}
