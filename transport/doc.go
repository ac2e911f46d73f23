// Package transport is the provider interface of rdmagrpc: a small model of
// RDMA verbs (device, protection domain, memory region, completion queue,
// reliable-connected queue pair) plus an rdma_cm-like connection manager keyed
// by "host:port".
//
// The semantics are those of libibverbs and the InfiniBand specification, so
// that code written against this package behaves the same on a real NIC
// (transport/verbs), on Soft-RoCE, and on the software provider
// (transport/shm). Where the two disagree, the real NIC (rdma_rxe) is the
// truth and transport/transporttest holds the case.
//
// Providers register themselves on import, like database/sql drivers:
//
//	import _ "github.com/rdmagrpc/rdmagrpc/transport/shm"
//	p, err := transport.Get("shm")
//
// # Optional capabilities
//
// Beside the interfaces every provider implements (Provider, Device, PD,
// MR, CQ, QP, Listener, ConnRequest), a provider may implement optional
// ones, which callers find by type assertion and do without when absent.
// The providers here implement them as follows (fault: only where
// marked, and then only as the provider it wraps does):
//
//	capability           on           adds                                       shm  verbs  fault       asserted by
//	Wrapper              Provider     Inner: the provider wrapped, for Family    -    -      yes         transport.Family
//	PageReleaser         MR           ReleasePages: pages back to the system,    yes  -      if inner    bufpool (Buffer.CanReleasePages,
//	                                  registration kept (parking)                                         ReleasePages); fault (RegMR)
//	NotifyCQ             CQ           SetNotify: a callback instead of a         yes  yes    -           conn (startPolling, stopPolling:
//	                                  goroutine blocked in Wait                                           poll.go)
//	PathQP               QP           Path: the route on the fabric              -    yes    -           conn (lookUpPathLocked: Stats().Path)
//	SetupTimer           QP           SetupSteps: the timed steps of a set-up    -    yes    -           conn (Conn.SetupSteps: stats.go)
//	RequestHandler       Listener     HandleRequests: requests handed to a       yes  -      -           conn (Listen)
//	                                  function instead of Accept
//	EarlyConnector       Device       ConnectEarly: a dial that returns once     yes  -      if inner    conn (dialRDMA); fault (Injector.Open,
//	                                  its request is queued (with EarlyQP)                                earlyDevice.ConnectEarly)
//	DeadlineEstablisher  EarlyQP      EstablishedBy: the wait for the answer     yes  -      -           conn (Conn.establish)
//	                                  with a deadline instead of a context
//	Router               Device       DeviceFor: the device a route to an        yes  yes    -           conn (dialRDMA)
//	                                  address goes through
//	DeviceWrapper        Device       Unwrap: the device it stands for           yes  -      -           conn (underlying: kit.go)
//	RequestDevice        ConnRequest  Device: the device a request came          yes  yes    -           conn (Listener.handshake)
//	                                  through
//	PeerChecker          Listener     SetPeerCheck: admit peer processes by      yes  -      -           conn (Listen: WithPeerCheck)
//	                                  pid, uid, gid
//
// EarlyQP is not asserted: ConnectEarly returns it. The fault provider
// wraps devices, CQs, QPs and listeners in types of its own, so a
// capability it does not forward is absent under it even when its inner
// provider has it (over fault, a connection's completion loop is a
// goroutine that waits in CQ.Wait, as without NotifyCQ).
package transport
