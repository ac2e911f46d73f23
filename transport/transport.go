package transport

import (
	"context"
	"errors"
	"net"
	"time"
)

// Provider opens devices. One Provider value is registered per name.
type Provider interface {
	// Name is the registered name ("verbs", "shm", "fault", ...).
	Name() string
	// Open opens a device. name "" selects the provider's default device.
	// When the provider cannot work on this machine the error says what is
	// missing (no device, no library, no permission) and wraps
	// ErrUnavailable.
	Open(name string) (Device, error)
}

// Wrapper is a provider that wraps another (transport/fault): on the wire
// it is the provider it wraps.
type Wrapper interface {
	Inner() Provider
}

// Family is the name of the provider that name's provider is, or wraps:
// the providers whose endpoints can connect to each other share it.
func Family(name string) string {
	p, err := Get(name)
	if err != nil {
		return name
	}
	for {
		w, ok := p.(Wrapper)
		if !ok {
			return p.Name()
		}
		p = w.Inner()
	}
}

// DeviceAttr are the limits of a device, as ibv_query_device reports them.
type DeviceAttr struct {
	MaxQPWR     int    // max outstanding work requests per queue
	MaxSGE      int    // max scatter-gather entries per work request
	MaxCQE      int    // max entries of one completion queue
	MaxInline   int    // max inline data of one send
	MaxMRSize   uint64 // largest single registration
	MaxQPRdAtom int    // max outstanding RDMA READs per QP (responder side)
}

// Device is an opened device context (ibv_context plus the rdma_cm entry points).
type Device interface {
	Name() string
	Provider() string
	Attr() DeviceAttr

	// AllocMemory returns size bytes of page-aligned memory outside the Go
	// heap that this provider can register and, for shm, share with a peer
	// process. Free it with FreeMemory after every MR over it is deregistered.
	AllocMemory(size int) ([]byte, error)
	FreeMemory(mem []byte) error

	AllocPD() (PD, error)
	// CreateCQ creates a completion queue of at least entries entries.
	CreateCQ(entries int) (CQ, error)

	// Listen binds the connection manager to addr ("host:port"; port 0 picks
	// a free port). Incoming requests are created on this device.
	Listen(addr string) (Listener, error)
	// Connect resolves addr, creates a QP from cfg and connects it, sending
	// private data (at most MaxPrivateData bytes). The returned QP carries
	// the peer's private data from its accept. A rejection returns a
	// *RejectError carrying the peer's reject private data; nothing
	// listening returns an error wrapping ErrConnRefused.
	Connect(ctx context.Context, addr string, cfg QPConfig, private []byte) (QP, error)

	Close() error
}

// MaxPrivateData is the private data limit honoured by every provider
// (rdma_cm allows 56 bytes on RC connect over RoCE/IB).
const MaxPrivateData = 56

// Private data arrives zero-padded to the size of the IB CM message that
// carried it, as rdma_rxe and real HCAs deliver it: what the peer sent is a
// prefix, so protocols must carry their own length. Every provider pads to
// these lengths.
const (
	PrivateLenConnect = 56  // REQ
	PrivateLenAccept  = 196 // REP
	PrivateLenReject  = 148 // REJ
)

// PadPrivate returns p zero-padded to n bytes (a copy; p is not changed).
func PadPrivate(p []byte, n int) []byte {
	out := make([]byte, max(n, len(p)))
	copy(out, p)
	return out
}

// PD is a protection domain. An rkey is valid only for QPs of the PD that
// registered it.
type PD interface {
	// RegMR registers mem (which must come from Device.AllocMemory for
	// providers that need it, such as shm) with the given access.
	RegMR(mem []byte, access Access) (MR, error)
	Close() error
}

// Access are memory region access flags (IBV_ACCESS_*).
type Access uint32

const (
	AccessLocalWrite Access = 1 << iota
	AccessRemoteWrite
	AccessRemoteRead
)

// MR is a registered memory region. Addr is the address remote peers use
// (the virtual address, as with ibv_reg_mr).
type MR interface {
	Addr() uint64
	Len() int
	LKey() uint32
	RKey() uint32
	Access() Access
	Bytes() []byte
	// Dereg deregisters the region (ibv_dereg_mr). Its rkey becomes
	// invalid at once: later remote accesses fail with StatusRemAccessErr.
	Dereg() error
}

// PageReleaser is an MR whose pages can go back to the system while it
// stays registered: they read as zeros afterwards, and the next write to
// them, local or a peer's, takes fresh pages. The caller guarantees that
// nobody writes into the region while ReleasePages runs (conn's idle
// park). shm's memfd arenas can; pinned verbs memory cannot (the HCA
// would keep writing into the pages it pinned).
type PageReleaser interface {
	ReleasePages() error
}

// CQ is a completion queue with verbs' arm-then-notify semantics:
// ReqNotify arms the queue; the next completion added after arming makes
// Wait return (once); Wait does not consume completions. The canonical
// loop is: Poll until empty, ReqNotify, Poll again, then Wait.
type CQ interface {
	// Poll moves up to len(wc) completions into wc and returns how many.
	// After an overflow it returns ErrCQOverflow.
	Poll(wc []WorkCompletion) (int, error)
	// ReqNotify arms the queue for the next completion
	// (ibv_req_notify_cq with solicited_only = 0).
	ReqNotify() error
	// Wait blocks until an armed queue has been notified, ctx is done, or
	// the queue is closed. It parks no OS thread: the wait is on a file
	// descriptor in Go's netpoller (completion channel or eventfd).
	Wait(ctx context.Context) error
	// Cap is the number of entries the queue holds.
	Cap() int
	Close() error
}

// NotifyCQ is a CQ that can call a function where it would wake a waiter
// in Wait: a consumer then needs no goroutine per queue while the queue is
// idle (a verbs completion channel shared by many CQs, or shm's wake-ups).
type NotifyCQ interface {
	CQ
	// SetNotify makes every event that would end a Wait (a completion
	// added to an armed queue, the QP's peer gone, the queue failing) call
	// fn instead, on a goroutine of the provider's, possibly with its
	// locks held: fn must not block or call into the queue. nil restores
	// Wait.
	SetNotify(fn func())
}

// PooledRecvID is the work request ID a provider's shared receives carry
// (QPConfig.RecvImmOnly). An error completion does not say whether a send
// or a receive ended; this ID does.
const PooledRecvID = 0xffff_fe00_7265_6376

// QPConfig are the attributes of a new RC queue pair.
type QPConfig struct {
	PD         PD
	SendCQ     CQ
	RecvCQ     CQ
	MaxSendWR  int
	MaxRecvWR  int
	MaxSendSGE int
	MaxRecvSGE int
	MaxInline  int
	// RecvImmOnly says that no receive posted to the QP has an SGE: each
	// only takes a message's immediate (an RDMA write with immediate, or
	// a zero-length send). A provider may then serve them from receives
	// shared with other such QPs, in their order of posting; a receive
	// with an SGE is refused (ErrInvalidWR). PooledRecvID must not be
	// the ID of any send WR of the QP.
	RecvImmOnly bool
	// RetryCount is the transport retry count (0–7).
	RetryCount int
	// RNRRetry is the receiver-not-ready retry count (0–7, 7 = infinite).
	RNRRetry int
	// MinRNRTimer is the delay between RNR retries.
	MinRNRTimer time.Duration
	// Timeout is the local ACK timeout of one transmission.
	Timeout time.Duration
	// InitialRecvs are posted as soon as the QP exists, before the peer
	// can learn of it (as rsockets posts its receives before rdma_accept).
	// A peer may send the moment it sees the connection established;
	// receives posted only after Connect or Accept return can come after
	// that first message, which then waits out an RNR timer (a millisecond
	// or more) on every new connection.
	InitialRecvs []RecvWR
}

// Path is the route a connected QP's traffic takes on an RDMA fabric, as
// the QP was programmed.
type Path struct {
	Port         int    // the device's port
	GIDIndex     int    // the source GID's index in the port's table
	GIDType      string // "RoCE v2", "IB/RoCE v1"; "" on InfiniBand
	MTU          int    // the path MTU in bytes
	TrafficClass int    // the GRH traffic class (DSCP × 4 + ECN)
	ServiceLevel int
}

// PathQP is a QP that says which path it takes (verbs).
type PathQP interface {
	Path() (Path, error)
}

// QPState is a queue pair state (IBV_QPS_*).
type QPState uint8

const (
	QPSReset QPState = iota
	QPSInit
	QPSRTR
	QPSRTS
	QPSSQD
	QPSSQE
	QPSErr
)

func (s QPState) String() string {
	switch s {
	case QPSReset:
		return "RESET"
	case QPSInit:
		return "INIT"
	case QPSRTR:
		return "RTR"
	case QPSRTS:
		return "RTS"
	case QPSSQD:
		return "SQD"
	case QPSSQE:
		return "SQE"
	case QPSErr:
		return "ERROR"
	}
	return "QPState(?)"
}

// QP is a connected reliable-connected queue pair together with its
// connection-manager identity (an rdma_cm_id with its QP).
type QP interface {
	Num() uint32
	State() QPState
	// PostSend posts work requests in order (ibv_post_send). An immediate
	// error (queue full, too many SGEs, inline too large, QP in RESET) is
	// returned and nothing from the failing request on is posted; the
	// returned int is how many were posted. In ERROR state requests are
	// accepted and complete with StatusWRFlushErr.
	PostSend(wrs ...SendWR) (int, error)
	// PostRecv posts receive requests (ibv_post_recv), same rules.
	PostRecv(wrs ...RecvWR) (int, error)
	// SetError moves the QP to ERROR: outstanding and later work requests
	// complete with StatusWRFlushErr. The peer is not told.
	SetError() error

	LocalAddr() net.Addr
	RemoteAddr() net.Addr
	// PeerPrivate is the peer's private data (from its connect or accept).
	PeerPrivate() []byte
	// Disconnected is closed when the connection manager learns that the
	// peer disconnected or vanished (RDMA_CM_EVENT_DISCONNECTED); by then
	// the QP is in ERROR and outstanding work is flushed.
	Disconnected() <-chan struct{}
	// Disconnect tells the peer and moves the QP to ERROR (rdma_disconnect)
	// without destroying it, so flushed completions can still be polled.
	Disconnect() error
	// Close disconnects if needed and destroys the QP (rdma_destroy_qp +
	// rdma_destroy_id). Its CQs are not closed.
	Close() error
}

// SetupTimer is a QP whose provider timed the steps of its connection's
// set-up on the dialing side, in order (verbs: rdma_cm's address and
// route resolution, the QP's creation, the CM's request and reply, the
// moves to RTS). What a dial costs beyond them is the caller's own.
type SetupTimer interface {
	SetupSteps() []SetupStep
}

// SetupStep is one timed step of a connection's set-up.
type SetupStep struct {
	Name string
	Took time.Duration
}

// Listener accepts connection requests (an rdma_cm listening id).
type Listener interface {
	// Accept returns the next connection request. It returns net.ErrClosed
	// after Close.
	Accept(ctx context.Context) (ConnRequest, error)
	Addr() net.Addr
	Close() error
}

// RequestHandler is implemented by a Listener that can hand each
// connection request to a function on the goroutine that read it, instead
// of queueing it for Accept: one hand-over between goroutines less per
// connection, and none of them waking a goroutine that waits in Accept.
// HandleRequests is called once, before the first request is read;
// Accept then returns none. fn may block until it has called the
// request's Accept or Reject, and beyond, until Close: the listener's
// Close waits for it to return.
type RequestHandler interface {
	HandleRequests(fn func(ConnRequest))
}

// ConnRequest is a pending incoming connection (RDMA_CM_EVENT_CONNECT_REQUEST).
// Exactly one of Accept or Reject must be called.
type ConnRequest interface {
	PeerPrivate() []byte
	RemoteAddr() net.Addr
	// Accept creates a QP from cfg, connects it and answers with private
	// data. It returns once the connection is established.
	Accept(ctx context.Context, cfg QPConfig, private []byte) (QP, error)
	// Reject refuses the request; the peer's Connect returns a *RejectError
	// carrying private.
	Reject(private []byte) error
}

// EarlyConnector is implemented by a Device whose connection requests can
// be sent without waiting for the answer, as a TCP connect returns once
// the kernel queued it for the listener and never waits for the server
// process: ConnectEarly sends the request and returns the QP at once,
// with its addresses known; Established waits for the answer. Until
// Established returned nil nothing may be posted on the QP and
// PeerPrivate is empty. Disconnect or Close ends the wait.
type EarlyConnector interface {
	ConnectEarly(ctx context.Context, addr string, cfg QPConfig, private []byte) (EarlyQP, error)
}

// EarlyQP is the QP of ConnectEarly.
type EarlyQP interface {
	QP
	// Established waits for the listener's answer, within ctx. An
	// error (a *RejectError for a rejection) leaves the QP unusable; it
	// must still be closed.
	Established(ctx context.Context) error
}

// DeadlineEstablisher is an EarlyQP that can also wait for the
// listener's answer until a time, with no context: a dial then pays for
// no context, timer or callback of its own (shm: the socket's read
// deadline bounds the wait). A wait that ends at deadline returns an
// error wrapping context.DeadlineExceeded, as Established's would.
type DeadlineEstablisher interface {
	EstablishedBy(deadline time.Time) error
}

// Router is implemented by a Device of a provider that may have several
// (verbs: one per HCA): DeviceFor names the device a connection to addr
// goes through, where its PD, CQ and memory must be made before Connect.
// A provider without it has one device.
type Router interface {
	DeviceFor(ctx context.Context, addr string) (Device, error)
}

// DeviceWrapper is implemented by a Device that stands for another for one
// connection (shm's DeviceFor: the listener's process's device, with a
// socket to it already connected): what is made on it (PDs, memory, CQs)
// is the underlying device's, and may serve that device's later
// connections.
type DeviceWrapper interface {
	Unwrap() Device
}

// RequestDevice is implemented by a ConnRequest that arrived through a
// device other than the listener's may: the connection's resources must
// be made on Device before Accept.
type RequestDevice interface {
	Device() Device
}

// PeerChecker is implemented by a Listener whose peers are processes of
// this host, identified by the kernel (shm: SO_PEERCRED). check runs on
// every request before anything is handed to the peer; an error refuses
// the request. The default, before SetPeerCheck, admits only peers of
// the listener's own user, as a 0600 socket file would.
type PeerChecker interface {
	SetPeerCheck(check func(pid, uid, gid int) error)
}

// ErrListenerRefused is what a Connect wraps when every process that
// answered at addr failed the dial's peer check (ContextWithPeerCheck):
// none of them was sent a byte or a descriptor.
var ErrListenerRefused = errors.New("transport: the process listening there failed this dial's peer check")

type peerCheckKey struct{}

// ContextWithPeerCheck returns a context whose dials (Connect,
// ConnectEarly, Router.DeviceFor) admit a listening process only if check
// returns nil for its credentials as the kernel gives them, before
// anything is sent to it; a refused process is skipped, as a name with no
// listener is. Providers whose listeners are processes of this host
// (shm) apply it; without one they admit only listeners of the dialing
// process's effective user, or of root. A dial reaches a listener through a name any
// local user may bind, so who listens needs checking as much as who
// dials.
func ContextWithPeerCheck(ctx context.Context, check func(pid, uid, gid int) error) context.Context {
	return context.WithValue(ctx, peerCheckKey{}, check)
}

// PeerCheckFrom returns the check ContextWithPeerCheck put in ctx, or nil.
func PeerCheckFrom(ctx context.Context) func(pid, uid, gid int) error {
	check, _ := ctx.Value(peerCheckKey{}).(func(pid, uid, gid int) error)
	return check
}

// RejectError is returned by Connect when the peer rejected the request.
type RejectError struct {
	Addr    string
	Private []byte
}

func (e *RejectError) Error() string {
	return "transport: connection to " + e.Addr + " rejected by peer"
}

// Opcode is a send work request opcode (IBV_WR_*).
type Opcode uint8

const (
	OpSend Opcode = iota
	OpSendWithImm
	OpWrite
	OpWriteWithImm
	OpRead
)

func (o Opcode) String() string {
	switch o {
	case OpSend:
		return "SEND"
	case OpSendWithImm:
		return "SEND_WITH_IMM"
	case OpWrite:
		return "RDMA_WRITE"
	case OpWriteWithImm:
		return "RDMA_WRITE_WITH_IMM"
	case OpRead:
		return "RDMA_READ"
	}
	return "Opcode(?)"
}

// Completion is the opcode a send WR of opcode o completes with.
func (o Opcode) Completion() WCOpcode {
	switch o {
	case OpWrite, OpWriteWithImm:
		return WCRDMAWrite
	case OpRead:
		return WCRDMARead
	}
	return WCSend
}

// SGE is a scatter-gather element in local registered memory.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// SendWR is a send work request (struct ibv_send_wr).
type SendWR struct {
	ID     uint64
	Opcode Opcode
	SG     []SGE
	// Imm is the immediate data of *_WITH_IMM opcodes.
	Imm uint32
	// Signaled requests a completion on success. Unsignaled requests
	// complete silently unless they fail; an error completion is always
	// generated.
	Signaled bool
	// Inline copies the data at post time; SG keys are not checked.
	Inline bool
	// Data, with Inline, is the payload itself instead of SG: it is
	// copied before PostSend returns, so it may be any memory, registered
	// or not (a caller's slice). A provider whose requester is the CPU
	// (shm) offers a MaxInline as large as its rings, which saves the
	// copy into registered staging memory that a NIC needs.
	Data []byte
	// RemoteAddr and RKey name the peer memory of WRITE, WRITE_WITH_IMM and READ.
	RemoteAddr uint64
	RKey       uint32
}

// RecvWR is a receive work request (struct ibv_recv_wr).
type RecvWR struct {
	ID uint64
	SG []SGE
}

// WCOpcode is the opcode of a completion (IBV_WC_*).
type WCOpcode uint8

const (
	WCSend WCOpcode = iota
	WCRDMAWrite
	WCRDMARead
	WCRecv
	WCRecvRDMAWithImm
)

func (o WCOpcode) String() string {
	switch o {
	case WCSend:
		return "SEND"
	case WCRDMAWrite:
		return "RDMA_WRITE"
	case WCRDMARead:
		return "RDMA_READ"
	case WCRecv:
		return "RECV"
	case WCRecvRDMAWithImm:
		return "RECV_RDMA_WITH_IMM"
	}
	return "WCOpcode(?)"
}

// WorkCompletion is struct ibv_wc. On error only ID, Status, QPNum and
// VendorErr are defined (as in verbs).
type WorkCompletion struct {
	ID        uint64
	Status    Status
	Opcode    WCOpcode
	ByteLen   uint32
	Imm       uint32
	HasImm    bool
	QPNum     uint32
	VendorErr uint32
}
