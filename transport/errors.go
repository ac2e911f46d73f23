package transport

import "errors"

var (
	// ErrUnavailable wraps every error saying a provider cannot work on
	// this machine (no device, no library, no permission).
	ErrUnavailable = errors.New("transport: provider unavailable")
	// ErrUnusable wraps the errors of a provider whose hardware is here
	// but cannot be used (permissions, a missing kernel module, a port
	// down, the memlock limit). It is an ErrUnavailable too, but a caller
	// choosing a provider must report it instead of silently picking
	// another: the operator meant this device to work.
	ErrUnusable error = unusable{}
	// ErrBadSetting wraps the error of an RDMAGRPC_* environment variable
	// whose value cannot be used; the error names the variable, the value
	// and what is accepted.
	ErrBadSetting = errors.New("rdmagrpc: bad setting")
	// ErrCQOverflow is returned by CQ.Poll once completions were lost
	// because the queue was full; the QPs using it are in ERROR.
	ErrCQOverflow = errors.New("transport: completion queue overflow")
	// ErrQueueFull is returned by PostSend/PostRecv when the work queue
	// has no room (ENOMEM from ibv_post_send).
	ErrQueueFull = errors.New("transport: work queue full")
	// ErrInvalidWR is returned for a malformed work request (too many
	// SGEs, inline too large, unknown opcode): EINVAL from ibv_post_send.
	ErrInvalidWR = errors.New("transport: invalid work request")
	// ErrQPState is returned when posting to a QP in a state that refuses it.
	ErrQPState = errors.New("transport: queue pair in wrong state")
	// ErrConnRefused is returned by Connect when nothing listens at addr.
	ErrConnRefused = errors.New("transport: connection refused")
)

type unusable struct{}

func (unusable) Error() string        { return "transport: device present but unusable" }
func (unusable) Is(target error) bool { return target == ErrUnavailable }
