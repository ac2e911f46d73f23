// Package conn is rdmagrpc's net.Conn and net.Listener over RDMA: a
// grpc-go transport drop-in.
//
//	lis, err := conn.Listen(ctx, "10.0.0.1:7000")          // server: srv.Serve(lis)
//	grpc.NewClient(addr, grpc.WithContextDialer(conn.Dialer())) // client
//
// Each connection owns a protection domain, so a peer's queue pair can
// never reach another connection's memory, and a small set of
// pre-registered buffers (M1): a receive ring of slots the peer writes into
// with RDMA WRITE_WITH_IMM, and a send staging area of the same shape.
// Every message consumes one credit (a slot of the peer's ring); the
// reader returns credits piggybacked on its own data or, when half the
// window is free, in a zero-length credit message, so no message ever
// meets a receiver that is not ready. Data is copied into and out of the
// registered memory: no DMA ever touches a caller's slice after Read or
// Write returned.
//
// Not yet here: the enlargement of a connection's buffers (M2–M4) and the
// rendezvous for large messages (M5); a write larger than a slot is
// fragmented into slots.
package conn
