// Package bpf watches memory registration and buffer enlargement from
// outside the traced processes, with eBPF uprobes.
//
// It probes libibverbs' registration entry points (ibv_reg_mr_iova2, which
// every classic ibv_reg_mr path funnels into, ibv_reg_dmabuf_mr,
// ibv_rereg_mr, ibv_dereg_mr) and, in Go binaries, rdmagrpc's shm
// registration functions and its enlargement marker. Events arrive through
// one BPF ring buffer:
//
//	t, err := bpf.Open(bpf.Options{PID: 0}) // 0: every process
//	defer t.Close()
//	lib, _ := bpf.FindLibibverbs(0)
//	err = t.AttachLibibverbs(lib)
//	err = t.AttachGoFuncs("/usr/local/bin/server", bpf.KnownGoFuncs)
//	for {
//		ev, err := t.Read()
//		...
//	}
//
// Go functions are not probed with uretprobes: a uretprobe replaces the
// return address on the goroutine stack and the Go runtime crashes when it
// copies or unwinds that stack. Instead every RET instruction of the
// function gets its own uprobe (found by disassembling the function), and a
// call is matched to its return by goroutine pointer (R14 in Go's register
// ABI), since a goroutine may move between threads mid-call.
//
// Cost: every probe hit is a trap into the kernel, and on x86 most probed
// instructions are then single-stepped out of line, a second trap. On the
// development VM (2 vCPUs, nested virtualisation, shared with a qemu
// guest) one uprobe hit costs about 19 µs with an empty BPF program; these
// programs add 1–2 µs. A probed libibverbs call (uprobe + uretprobe) costs
// about 21 µs more, a probed Go function (entry + RET uprobes, both
// single-stepped) about 40 µs more. See overhead_test.go to measure it.
//
// Registration latencies include part of that cost (the single-step of
// the first instruction), so they are upper bounds.
package bpf
