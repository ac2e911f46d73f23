//go:build !386 && !amd64

package bpf

import (
	"fmt"
	"runtime"

	"github.com/cilium/ebpf"
)

// The probes read x86-64 registers (Go's register ABI and the System V
// calling convention), so bpf2go output exists for x86 only. Elsewhere the
// package builds and Open says why it cannot work.

type probesEvent struct {
	StartNs, DurationNs, Cookie uint64
	Args, Rets                  [9]uint64
	MrAddr, MrLen               uint64
	MrLkey, MrRkey              uint32
	Pid, Tid, EntryTid, Pad     uint32
	Comm                        [16]uint8
}

type probesObjects struct {
	LibEntry, LibReturn, GoEntry, GoReturn *ebpf.Program
	Events, Stats, Calls                   *ebpf.Map
}

func (*probesObjects) Close() error { return nil }

func loadProbesObjects(*probesObjects, *ebpf.CollectionOptions) error {
	return fmt.Errorf("the probes exist for x86-64 only, not %s: %w", runtime.GOARCH, ebpf.ErrNotSupported)
}
