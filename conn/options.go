package conn

import (
	"fmt"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
)

// Option configures Listen, Dial and Dialer.
type Option func(*options)

type options struct {
	provider   string
	slotSize   int
	slotCount  int
	threshold  int
	largeSize  int
	largeCount int
	ackTimeout time.Duration
	ackRetries int
	budget     *bufpool.Budget
}

// Defaults, for grpc-go's write pattern (at most 32 KiB per Write, 16 KiB
// frames): control frames and small RPCs are far below 1 KiB, so a small
// phase of four 1 KiB slots to receive into plus the same to stage sends
// keeps an idle connection at 8 KiB of registered memory per side
// (rsockets registers 256 KiB). The first write above the threshold
// enlarges that direction to four 32 KiB slots, so one grpc-go write
// fills one slot.
const (
	DefaultSlotSize   = 1024
	DefaultSlotCount  = 4
	DefaultLargeSize  = 32 << 10
	DefaultLargeCount = 4
	DefaultAckTimeout = time.Second
	DefaultAckRetries = 2
)

func defaults() options {
	return options{
		slotSize: DefaultSlotSize, slotCount: DefaultSlotCount,
		largeSize: DefaultLargeSize, largeCount: DefaultLargeCount,
		ackTimeout: DefaultAckTimeout, ackRetries: DefaultAckRetries,
	}
}

// WithProvider picks the transport provider ("verbs" or "shm").
func WithProvider(name string) Option { return func(o *options) { o.provider = name } }

// WithSmallBuffers sets the slot size and count of the small phase (M1):
// the receive ring and the send staging area each connection starts with.
func WithSmallBuffers(size, count int) Option {
	return func(o *options) { o.slotSize, o.slotCount = size, count }
}

// WithThreshold sets the write size above which a direction is enlarged
// (M2); default: the small slot size.
func WithThreshold(n int) Option { return func(o *options) { o.threshold = n } }

// WithLargeBuffers sets the slot size and count of the large phase (M4).
func WithLargeBuffers(size, count int) Option {
	return func(o *options) { o.largeSize, o.largeCount = size, count }
}

// WithAckTimeout sets how long a writer waits for the enlargement
// acknowledgement, and how many times it asks again before going on with
// the small buffers.
func WithAckTimeout(d time.Duration, retries int) Option {
	return func(o *options) { o.ackTimeout, o.ackRetries = d, retries }
}

// WithBudget charges registered memory to b instead of bufpool.Default().
func WithBudget(b *bufpool.Budget) Option { return func(o *options) { o.budget = b } }

func (o *options) validate() error {
	if err := checkRing(uint32(o.slotSize), uint32(o.slotCount)); err != nil {
		return fmt.Errorf("conn: small buffers: %w", err)
	}
	if o.slotCount < 3 {
		return fmt.Errorf("conn: small buffers: %d slots, want at least 3 (one is kept for control records)", o.slotCount)
	}
	if err := checkRing(uint32(o.largeSize), uint32(o.largeCount)); err != nil {
		return fmt.Errorf("conn: large buffers: %w", err)
	}
	if o.threshold == 0 {
		o.threshold = o.slotSize
	}
	if o.ackTimeout <= 0 || o.ackRetries < 0 {
		return fmt.Errorf("conn: ack timeout %v with %d retries", o.ackTimeout, o.ackRetries)
	}
	return nil
}
