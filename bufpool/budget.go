package bufpool

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/internal/logx"
	"github.com/rdmagrpc/rdmagrpc/internal/settings"
)

// ErrBudget is returned, wrapped with the figures, when registering more
// memory would exceed the registered-memory budget.
var ErrBudget = errors.New("bufpool: registered-memory budget exceeded")

// BudgetEnv is the environment variable Default reads its limit from.
const BudgetEnv = settings.RegBudget

// DefaultBudget is the limit of Default when BudgetEnv is unset: enough for
// thousands of connections in the small phase, small enough that a leak
// shows up as ErrBudget long before the host runs out of pinnable memory.
const DefaultBudget = 1 << 30

// Budget bounds the bytes registered by all pools that share it. Registered
// memory is pinned: it can neither be swapped nor reclaimed, so it is the
// resource a process must ration, not the Go heap.
type Budget struct {
	limit int64
	used  atomic.Int64

	// pools charging this budget, so that one that needs memory can make
	// the others give back what they hold unused (reclaim).
	mu    sync.Mutex
	pools map[*Pool]struct{}
}

// NewBudget returns a budget of limit bytes; limit <= 0 means unlimited.
func NewBudget(limit int64) *Budget {
	if limit < 0 {
		limit = 0
	}
	return &Budget{limit: limit, pools: map[*Pool]struct{}{}}
}

var defaultBudget = sync.OnceValue(func() *Budget {
	v, ok := settings.Get(BudgetEnv)
	if !ok {
		return NewBudget(DefaultBudget)
	}
	n, err := settings.ParseSize(v)
	if err != nil {
		// A typo must not silently mean "unlimited". conn refuses to
		// Listen or Dial with it (settings.Check); a program using
		// bufpool alone is told once and keeps the safe default.
		logx.Warn("rdmagrpc bufpool: ignoring a bad budget; using the default", "env", BudgetEnv, "value", v, "err", err, "default", DefaultBudget)
		return NewBudget(DefaultBudget)
	}
	return NewBudget(n)
})

// Default returns the process-wide budget. Its limit comes from the
// environment variable RDMAGRPC_REG_BUDGET (bytes, with an optional k, m or
// g suffix, powers of 1024; 0 means unlimited), read once, else 1 GiB.
func Default() *Budget { return defaultBudget() }

// Limit returns the limit in bytes, 0 when unlimited.
func (b *Budget) Limit() int64 { return b.limit }

// Used returns the bytes currently registered by all pools using b.
func (b *Budget) Used() int64 { return b.used.Load() }

// reserve charges n bytes or returns an error wrapping ErrBudget.
func (b *Budget) reserve(n int64) error {
	for {
		used := b.used.Load()
		if b.limit > 0 && used+n > b.limit {
			return fmt.Errorf("%w: need %d, used %d of %d", ErrBudget, n, used, b.limit)
		}
		if b.used.CompareAndSwap(used, used+n) {
			return nil
		}
	}
}

func (b *Budget) release(n int64) { b.used.Add(-n) }

// force charges n bytes whatever the limit (GetOverdraft).
func (b *Budget) force(n int64) { b.used.Add(n) }

func (b *Budget) join(p *Pool) {
	b.mu.Lock()
	if b.pools == nil {
		b.pools = map[*Pool]struct{}{}
	}
	b.pools[p] = struct{}{}
	b.mu.Unlock()
}

func (b *Budget) leave(p *Pool) {
	b.mu.Lock()
	delete(b.pools, p)
	b.mu.Unlock()
}

// reclaim makes pools other than p deregister free buffers they cache
// until need bytes fit, or none is left; it reports whether any was
// given back. A connection's pool keeps its free buffers for its next
// transfer; under pressure another connection's, or a new dial's, need
// comes first: an idle cache must not refuse live traffic.
func (b *Budget) reclaim(need int64, p *Pool) bool {
	b.mu.Lock()
	others := make([]*Pool, 0, len(b.pools))
	for q := range b.pools {
		if q != p {
			others = append(others, q)
		}
	}
	b.mu.Unlock()
	freed := false
	for _, q := range others {
		if b.limit-b.Used() >= need {
			break
		}
		if q.trimFor(need) {
			freed = true
		}
	}
	return freed
}

// ParseSize parses a byte count with an optional k, m or g suffix (powers
// of 1024, case-insensitive, an optional trailing "b" or "ib"), as
// RDMAGRPC_REG_BUDGET is read; its error is a transport.ErrBadSetting
// naming that variable.
func ParseSize(s string) (int64, error) { return settings.ParseSize(s) }
