package conn

import (
	"fmt"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
)

// Option configures Listen, Dial and Dialer.
type Option func(*options)

type options struct {
	provider  string
	slotSize  int
	slotCount int
	budget    *bufpool.Budget
}

// Defaults, for grpc-go's pattern: control frames and small RPCs are far
// below 1 KiB, and four slots of 1 KiB for receiving plus the same for
// staging sends keep an idle connection at 8 KiB of registered memory per
// side (rsockets registers 256 KiB).
const (
	DefaultSlotSize  = 1024
	DefaultSlotCount = 4
)

func defaults() options {
	return options{slotSize: DefaultSlotSize, slotCount: DefaultSlotCount}
}

// WithProvider picks the transport provider ("verbs" or "shm").
func WithProvider(name string) Option { return func(o *options) { o.provider = name } }

// WithSmallBuffers sets the slot size and count of the receive ring and
// of the send staging area.
func WithSmallBuffers(size, count int) Option {
	return func(o *options) { o.slotSize, o.slotCount = size, count }
}

// WithBudget charges registered memory to b instead of bufpool.Default().
func WithBudget(b *bufpool.Budget) Option { return func(o *options) { o.budget = b } }

func (o *options) validate() error {
	if o.slotSize <= 0 || o.slotSize > maxLen || o.slotCount <= 1 || o.slotCount > maxCredits/2 {
		return fmt.Errorf("conn: small buffers of %d × %d bytes: want 2–%d slots of 1–%d bytes", o.slotCount, o.slotSize, maxCredits/2, maxLen)
	}
	return nil
}
