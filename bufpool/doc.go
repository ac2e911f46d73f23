// Package bufpool hands out registered memory for connections.
//
// Memory comes from Device.AllocMemory (outside the Go heap, so the NIC may
// DMA into it at any time without racing the garbage collector) and is
// registered once with PD.RegMR. Sizes are rounded up to power-of-two
// classes. A released buffer keeps its registration and waits on a free
// list of its class and access flags for the next Get, whoever asks: as
// SMC-R reuses its RMBs from per-size lists, a connection set-up in steady
// state costs no registration at all, which matters because registration
// pins pages and costs tens of microseconds to milliseconds per call.
//
// Every registered byte is charged to a Budget (one per process by
// default), so that many connections cannot pin unbounded memory, and to
// the owner (connection) holding it, exactly, so that per-connection
// figures (8 KiB per side of an idle connection) can be
// measured rather than estimated.
package bufpool
