// Package conn is rdmagrpc's net.Conn and net.Listener over RDMA: a
// kernel-bypass transport for grpc-go.
//
//	lis, err := conn.Listen(ctx, "10.0.0.1:7000")                // server: srv.Serve(lis)
//	grpc.NewClient(addr, grpc.WithContextDialer(conn.Dialer())) // client
//
// Providers register when imported (transport/shm, transport/verbs;
// none: ErrNoProvider). The provider is verbs when an RDMA device is usable,
// else shm (shared memory between the processes of one host); WithProvider or RDMAGRPC_PROVIDER choose, Stats says which and
// why, ProviderChoice says it before any connection. A device that is
// present but cannot be used is an error, not a silent switch to shm. The
// RDMAGRPC_* settings are checked together at the first Listen or Dial: a
// bad value fails it with ErrBadSetting, an unknown name is warned about.
//
// Listen also serves plain gRPC clients over TCP on the same address, and
// Dial reaches plain gRPC servers over TCP: a connection is upgraded to
// RDMA when both ends run rdmagrpc with the same provider, and otherwise
// stays on TCP with no time-out on the way (Stats().Provider is "tcp").
// Dial returns once TCP is connected; the outcome comes with the first
// Read or Write, or from Conn.Handshake (Stats never waits). A failed dial
// is TCP's error, as net.Dialer's would be. WithoutTCP and
// WithoutFallback turn either side of this off.
//
// Guarantees: each connection has its own protection domain, so a peer
// reaches no other connection's memory; no DMA touches a caller's slice
// after Read or Write returned; a writer writes only into slots the
// reader gave it credits for. A connection starts with small
// pre-registered buffers (8 KiB per side) and each direction moves to
// larger ones when its writes need them, and back when idle, without
// losing or reordering a byte; registered memory is bounded by a budget
// (bufpool), and streams slow down rather than fail when it is spent.
// Close returns at once and serves the peer's reads of what it wrote for
// at most DefaultLinger (Conn.SetLinger).
//
// Connections report OpenTelemetry spans and metrics (WithTracerProvider,
// WithMeterProvider, StatsHandler); they log only when asked (SetLogger,
// RDMAGRPC_LOG). How a connection works inside: doc/design.md.
package conn
