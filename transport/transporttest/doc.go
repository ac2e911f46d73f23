// Package transporttest is the conformance suite every transport provider
// must pass, in the manner of golang.org/x/net/nettest: one list of cases,
// expressed only through the transport interface, run against shm in one
// process and across two, and against verbs inside the Soft-RoCE guest.
//
// Each case has a local half (the test, which listens) and usually a peer
// half (which connects). The peer runs in a goroutine with its own device,
// or, when Harness.CrossProcess is set, in a child process: the test
// binary re-executed with an environment variable, which TestMain hands to
// MaybeRunPeer. The halves talk over a line-based control channel
// (channels in one process, the child's stdin and stdout across two) to
// exchange addresses and keys and to order their steps. With
// Harness.PeerAgent the peer halves run on another host: a ServeAgent
// there starts each one as a child process and relays its control
// channel over TCP (the two-guest run of the rxe tier).
//
// Where verbs semantics are subtle the cases follow what rdma_rxe does
// (drivers/infiniband/sw/rxe: rxe_req.c, rxe_resp.c, rxe_comp.c): rxe is
// the truth, and the software provider is fixed to match it.
package transporttest
