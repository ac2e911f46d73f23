// Package rxe is the harness of the Soft-RoCE test tier: it builds a qemu
// guest from Debian packages only (Debian's kernel with rdma_rxe, busybox,
// rdma-core), boots it under TCG (KVM when the host has it), brings up
// rxe0 and runs host binaries inside, one guest or two joined by an
// emulated Ethernet link.
//
// The guest is cached under a directory keyed by the package versions; a
// run appends a small cpio archive (the payload files, its command line
// and environment) to the cached base initramfs. Output comes back over
// a second serial port between marker lines carrying a per-run nonce, so
// it is byte-exact and the exit status is the payload's own. qemu runs in
// its own process group with a parent-death signal and is killed on every
// return path: when the context ends, when the payload has exited, or
// when the calling process dies.
//
// See README.md for how to run a package's tests inside the guest.
package rxe
