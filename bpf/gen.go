package bpf

// Regenerate with `make generate` (needs clang and llvm-strip; Debian 12:
// clang-14, llvm-14). BPF2GO_CC and BPF2GO_STRIP pick other binaries.
// ($DOLLAR is go generate's spelling of a literal dollar for the shell.)
//go:generate sh -c "go run github.com/cilium/ebpf/cmd/bpf2go -cc $DOLLAR{BPF2GO_CC:-clang-14} -strip $DOLLAR{BPF2GO_STRIP:-llvm-strip-14} -target amd64 -type event -go-package bpf probes rdmatrace.c -- -O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu"
