// Package conn is rdmagrpc's net.Conn and net.Listener over RDMA: a
// grpc-go transport drop-in.
//
//	lis, err := conn.Listen(ctx, "10.0.0.1:7000")                // server: srv.Serve(lis)
//	grpc.NewClient(addr, grpc.WithContextDialer(conn.Dialer())) // client
//
// The provider is verbs when transport/verbs is imported and an RDMA
// device is usable, else shm (shared memory between the processes of one
// host); WithProvider or RDMAGRPC_PROVIDER choose (verbs or shm, either
// case), Stats says which and why, and ProviderChoice says it before any
// connection. A device that is present but cannot be used is an error, not
// a silent fallback.
//
// Settings: RDMAGRPC_PROVIDER, RDMAGRPC_LOG, RDMAGRPC_REG_BUDGET and the
// RDMAGRPC_VERBS_* of transport/verbs are checked together at the first
// Listen or Dial, whatever the provider: a bad value fails them with
// ErrBadSetting, and an RDMAGRPC_ name that is no setting is logged as a
// warning, on standard error when no logger is set. rdmatrace doctor runs
// the same check.
//
// Mixed fleets: Listen also serves plain gRPC clients over TCP on the same
// address, and Dial reaches plain gRPC servers over TCP. Every connection
// starts over TCP and is upgraded to RDMA in band when both ends are
// rdmagrpc with the same provider (negotiate.go, SMC-R's scheme over an
// HTTP/2 SETTINGS extension); otherwise it stays TCP, with no time-out on
// the way, and Stats().Provider says "tcp". WithoutTCP, WithoutFallback.
// The negotiation runs behind Dial, which returns once TCP is connected;
// its outcome comes with the first Read, Write or Stats, or from
// Handshake (lazy.go).
//
// Each connection owns a protection domain, so a peer's queue pair can
// never reach another connection's memory.
//
// M1, small phase: a few pre-registered slots (WithSmallBuffers) the peer
// writes into with RDMA WRITE_WITH_IMM, and a send staging area of the
// same shape. Every message consumes one credit (a slot of the peer's
// ring); the reader returns credits piggybacked on its own data or, when
// half the window is free, in a zero-length credit message, so no message
// ever meets a receiver that is not ready. Data is copied into and out of
// registered memory: no DMA touches a caller's slice after Read or Write
// returned.
//
// M2–M4, enlargement: the first write above the threshold (WithThreshold)
// asks the peer, in a control message, for large buffers
// (WithLargeBuffers); the peer registers them and answers with their
// address and remote key; the writer moves to them when the answer
// arrives, and no message is lost or reordered on the way (enlarge.go). Each direction enlarges on
// its own; a refusal or an answer that does not come (WithAckTimeout)
// leaves the direction small, and says why in Stats. WithFreeSmallOnEnlarge
// releases the small ring once the large one is in use.
//
// M5, rendezvous: a write above WithRendezvousThreshold is not pushed
// through the rings; the reader's request for it is served by the writer's
// RDMA WRITE straight into the reader's registered destination
// (rendezvous.go), in chunks of WithRendezvousChunk.
//
// Memory follows traffic back down: a direction whose large buffers
// carried nothing for WithIdleShrink shrinks to its small ring, and a
// small direction idle as long parks, its ring's pages given back to the
// system until its next write (park.go; shm only, as verbs pins memory).
//
// Registered memory is bounded by a process-wide budget (bufpool); when it
// is spent, enlargements are refused and rendezvous falls back to the
// rings rather than failing. OpenTelemetry spans mark each connection,
// enlargement and rendezvous (WithTracerProvider, WithMeterProvider), and
// the library prints nothing unless asked (SetLogger, WithLogger,
// RDMAGRPC_LOG).
package conn
