// Package conn is rdmagrpc's net.Conn and net.Listener over RDMA: a
// kernel-bypass transport for grpc-go.
//
//	lis, err := conn.Listen(ctx, "10.0.0.1:7000")                // server: srv.Serve(lis)
//	grpc.NewClient(addr, grpc.WithContextDialer(conn.Dialer())) // client
//
// The provider is verbs when transport/verbs is imported and an RDMA
// device is usable, else shm (shared memory between the processes of one
// host); WithProvider or RDMAGRPC_PROVIDER choose, and Stats says which
// and why. A device that is present but cannot be used is an error, not
// a silent switch to shm.
//
// Listen also serves plain gRPC clients over TCP on the same address, and
// Dial reaches plain gRPC servers over TCP: a connection is upgraded to
// RDMA in band when both ends run rdmagrpc with the same provider, and
// otherwise stays on TCP with no time-out on the way (Stats().Provider is
// then "tcp"). Dial returns once TCP is connected; the outcome comes with
// the first Read or Write, or from Conn.Handshake (Stats never waits: it
// says ProviderNegotiating until then). WithoutTCP and WithoutFallback
// turn either side of this off.
//
// Guarantees: each connection has its own protection domain, so a peer
// reaches no other connection's memory; data is copied into and out of
// registered memory, so no DMA touches a caller's slice after Read or
// Write returned; a writer writes only into slots the reader gave it
// credits for, so no message meets a receiver that is not ready. A connection starts with small pre-registered
// buffers (8 KiB per side by default) and each direction moves to larger
// ones when its writes need them, and back when idle, without losing or
// reordering a byte. Registered memory is bounded by a budget (bufpool):
// when it is spent, streams slow down rather than fail. Close returns at
// once and keeps serving the peer's reads of what it wrote, for at most
// DefaultLinger (Conn.SetLinger).
//
// Connections report OpenTelemetry spans and metrics (WithTracerProvider,
// WithMeterProvider), StatsHandler puts transport events on RPC spans,
// and the library prints nothing unless asked (SetLogger, WithLogger,
// RDMAGRPC_LOG). How a connection works inside: doc/design.md.
package conn
