package fault

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Injector is a transport.Provider wrapping another and applying rules.
type Injector struct {
	name  string
	inner transport.Provider

	rules atomic.Pointer[[]*rule] // copy-on-write: read on every event

	mu      sync.Mutex // guards rule changes and devices
	added   int
	devices map[*device]struct{}

	live liveCounters

	maxInline atomic.Int64 // SetMaxInline's cap, -1: none
}

var _ transport.Provider = (*Injector)(nil)

// Wrap returns a provider named name that opens inner's devices wrapped
// with the given rules. An invalid rule is a programming error in test
// set-up and panics, as regexp.MustCompile does; use Add to get an error.
func Wrap(inner transport.Provider, name string, rules ...Rule) *Injector {
	inj := &Injector{name: name, inner: inner, devices: map[*device]struct{}{}}
	inj.rules.Store(&[]*rule{})
	inj.maxInline.Store(-1)
	for _, r := range rules {
		inj.MustAdd(r)
	}
	return inj
}

// Name returns the name given to Wrap.
func (inj *Injector) Name() string { return inj.name }

// Inner returns the wrapped provider (transport.Wrapper: on the wire the
// injector's endpoints are the inner provider's).
func (inj *Injector) Inner() transport.Provider { return inj.inner }

// Open opens a device of the inner provider and wraps it.
func (inj *Injector) Open(name string) (transport.Device, error) {
	d, err := inj.inner.Open(name)
	if err != nil {
		return nil, fmt.Errorf("fault: %w", err)
	}
	w := &device{inj: inj, inner: d, qps: map[uint32]*qp{}}
	inj.mu.Lock()
	inj.devices[w] = struct{}{}
	inj.mu.Unlock()
	if _, ok := d.(transport.EarlyConnector); ok {
		return earlyDevice{w}, nil
	}
	return w, nil
}

// SetMaxInline makes the devices report at most n bytes of inline data
// (DeviceAttr.MaxInline), as a NIC does, whose limit is far below a ring
// slot: a consumer that sizes its sends by it then stages them in
// registered memory, so that a provider which sends everything inline
// (shm) serves tests of the staged path. A QP asking for more inline
// data than n is not refused: the cap only informs. n < 0: the inner
// device's figure again.
func (inj *Injector) SetMaxInline(n int) { inj.maxInline.Store(int64(max(n, -1))) }

// Add adds a rule, effective for the next event.
func (inj *Injector) Add(r Rule) (*Handle, error) {
	inj.mu.Lock()
	defer inj.mu.Unlock()
	inj.added++
	if r.Name == "" {
		r.Name = fmt.Sprintf("%v %v #%d", r.Op, r.Action, inj.added)
	}
	if err := r.validate(); err != nil {
		return nil, err
	}
	rs := &rule{Rule: r, rng: rand.New(rand.NewPCG(r.Seed, r.Seed^0x9e3779b97f4a7c15))}
	old := *inj.rules.Load()
	next := make([]*rule, len(old), len(old)+1)
	copy(next, old)
	next = append(next, rs)
	inj.rules.Store(&next)
	return &Handle{inj: inj, r: rs}, nil
}

// MustAdd is Add for test set-up: it panics on an invalid rule.
func (inj *Injector) MustAdd(r Rule) *Handle {
	h, err := inj.Add(r)
	if err != nil {
		panic(err)
	}
	return h
}

func (inj *Injector) remove(r *rule) {
	inj.mu.Lock()
	defer inj.mu.Unlock()
	r.mu.Lock()
	r.removed = true
	r.mu.Unlock()
	old := *inj.rules.Load()
	next := make([]*rule, 0, len(old))
	for _, x := range old {
		if x != r {
			next = append(next, x)
		}
	}
	inj.rules.Store(&next)
}

// Clear removes every rule: from now on the provider behaves as the inner one.
func (inj *Injector) Clear() {
	for _, r := range *inj.rules.Load() {
		inj.remove(r)
	}
}

// Stats returns the counters of the active rules, in the order added.
func (inj *Injector) Stats() []RuleStats {
	var out []RuleStats
	for _, r := range *inj.rules.Load() {
		r.mu.Lock()
		out = append(out, RuleStats{Name: r.Name, Op: r.Op, Action: r.Action, Seen: r.seen, Fired: r.fired})
		r.mu.Unlock()
	}
	return out
}

// SetError moves the queue pair numbered qpNum, of any device opened
// through inj, to ERROR now, as a NIC does on a fatal error: outstanding
// and later work requests complete with StatusWRFlushErr and the peer is
// not told.
func (inj *Injector) SetError(qpNum uint32) error {
	inj.mu.Lock()
	var found []*qp
	for d := range inj.devices {
		if q := d.lookup(qpNum); q != nil {
			found = append(found, q)
		}
	}
	inj.mu.Unlock()
	if len(found) == 0 {
		return fmt.Errorf("fault: set error: no live QP %d", qpNum)
	}
	for _, q := range found {
		if err := q.inner.SetError(); err != nil {
			return fmt.Errorf("fault: set error on QP %d: %w", qpNum, err)
		}
	}
	return nil
}

// decide runs the rules over one event.
func (inj *Injector) decide(ev *Event) decision {
	var d decision
	for _, r := range *inj.rules.Load() {
		if r.matches(ev) && r.take() {
			d.set(r)
		}
	}
	return d
}

func (inj *Injector) forget(d *device) {
	inj.mu.Lock()
	delete(inj.devices, d)
	inj.mu.Unlock()
}
