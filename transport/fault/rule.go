package fault

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Op is the operation a rule watches.
type Op uint8

const (
	OpRegMR      Op = iota + 1 // PD.RegMR
	OpPostSend                 // each SendWR given to QP.PostSend
	OpPostRecv                 // each RecvWR given to QP.PostRecv
	OpCompletion               // each completion returned by CQ.Poll
)

func (o Op) String() string {
	switch o {
	case OpRegMR:
		return "RegMR"
	case OpPostSend:
		return "PostSend"
	case OpPostRecv:
		return "PostRecv"
	case OpCompletion:
		return "Completion"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Action is what a rule does when it fires. See the package documentation
// for how each is carried out.
type Action uint8

const (
	ActCount   Action = iota + 1 // nothing: count only
	ActFailReg                   // OpRegMR: RegMR fails with Rule.Err
	ActDrop                      // OpPostSend: the message is lost, success reported
	ActCorrupt                   // OpPostSend, OpCompletion: bits flipped in what arrives
	ActStatus                    // OpPostSend, OpCompletion: completion with Rule.Status, QP to ERROR
	ActQPError                   // OpPostSend, OpPostRecv, OpCompletion: QP to ERROR
	ActDelay                     // OpCompletion: completion held for Rule.Delay
)

func (a Action) String() string {
	switch a {
	case ActCount:
		return "count"
	case ActFailReg:
		return "fail registration"
	case ActDrop:
		return "drop"
	case ActCorrupt:
		return "corrupt"
	case ActStatus:
		return "error status"
	case ActQPError:
		return "QP error"
	case ActDelay:
		return "delay"
	}
	return fmt.Sprintf("Action(%d)", uint8(a))
}

// allowed lists the operations each action applies to.
var allowed = map[Action][]Op{
	ActCount:   {OpRegMR, OpPostSend, OpPostRecv, OpCompletion},
	ActFailReg: {OpRegMR},
	ActDrop:    {OpPostSend},
	ActCorrupt: {OpPostSend, OpCompletion},
	ActStatus:  {OpPostSend, OpCompletion},
	ActQPError: {OpPostSend, OpPostRecv, OpCompletion},
	ActDelay:   {OpCompletion},
}

// Rule selects events of one operation and acts on them. All predicates
// that are set must hold; among the events that match, Nth, Every,
// Probability and Limit choose which ones the rule fires on.
type Rule struct {
	Name   string // for Stats and error messages; default "<op> <action> #<n>"
	Op     Op
	Action Action

	// Predicates. Zero values match everything.
	QPNum     uint32               // only this QP (its Num)
	Opcodes   []transport.Opcode   // OpPostSend: only these opcodes
	WCOpcodes []transport.WCOpcode // OpCompletion: only these completion opcodes
	Statuses  []transport.Status   // OpCompletion: only these statuses
	MinLen    int                  // Event.Len >= MinLen
	MaxLen    int                  // Event.Len <= MaxLen (0: no maximum)
	Match     func(ev *Event) bool // any other condition (work request, completion, payload)

	// Selection among matching events (counted from 1). Nth alone fires
	// once, at the Nth match; Every alone fires on every Every-th; both
	// fire at Nth and every Every-th after it; neither fires on all.
	Nth, Every uint64
	// Probability in (0, 1] fires on a selected event with that chance,
	// drawn from a generator seeded with Seed, so runs repeat; 0 = always.
	Probability float64
	Seed        uint64
	// Limit caps the number of firings (0: no cap).
	Limit uint64

	// Parameters of the action.
	Err    error            // ActFailReg: the error (default ENOMEM)
	Status transport.Status // ActStatus: the status (must not be success)
	Offset int              // ActCorrupt: byte offset in the payload; negative counts from the end (-1: last byte)
	Mask   byte             // ActCorrupt: XOR mask (0: 0xff)
	Delay  time.Duration    // ActDelay: how long to hold the completion
}

func (r *Rule) validate() error {
	ops, ok := allowed[r.Action]
	if !ok {
		return fmt.Errorf("fault: rule %q: unknown action %v", r.Name, r.Action)
	}
	if !slices.Contains(ops, r.Op) {
		return fmt.Errorf("fault: rule %q: action %v does not apply to %v (only %v)", r.Name, r.Action, r.Op, ops)
	}
	switch {
	case r.Probability < 0 || r.Probability > 1:
		return fmt.Errorf("fault: rule %q: probability %v outside [0, 1]", r.Name, r.Probability)
	case r.Action == ActStatus && r.Status == transport.StatusSuccess:
		return fmt.Errorf("fault: rule %q: ActStatus needs an error status", r.Name)
	case r.Action == ActDelay && r.Delay <= 0:
		return fmt.Errorf("fault: rule %q: ActDelay needs a positive Delay", r.Name)
	case r.MaxLen > 0 && r.MaxLen < r.MinLen:
		return fmt.Errorf("fault: rule %q: MaxLen %d < MinLen %d", r.Name, r.MaxLen, r.MinLen)
	}
	return nil
}

// Event is what a rule's predicates see. Pointers are valid only during
// the call; do not keep them or write through them.
type Event struct {
	Op     Op
	Device string
	QPNum  uint32
	// Len is the size in bytes: of the registration (OpRegMR), of the
	// request's scatter/gather list (OpPostSend, OpPostRecv), or the
	// completion's ByteLen (OpCompletion).
	Len    int
	Access transport.Access          // OpRegMR
	Send   *transport.SendWR         // OpPostSend: as the caller posted it
	Recv   *transport.RecvWR         // OpPostRecv
	WC     *transport.WorkCompletion // OpCompletion: as the caller will see it (its own id)
	// For a completion, the request it completes (nil for receives).
	Request *transport.SendWR

	payload      func() []byte
	payloadDone  bool
	payloadBytes []byte
	corruptible  bool
}

// Payload returns the bytes of the event: what a send request sends
// (OpPostSend, not for READ) or what a successful RECV or READ completion
// landed (OpCompletion). It is nil when the bytes are not in memory
// registered through this provider. Read only.
func (e *Event) Payload() []byte {
	if !e.payloadDone {
		e.payloadDone = true
		if e.payload != nil {
			e.payloadBytes = e.payload()
		}
	}
	return e.payloadBytes
}

// offsetIn resolves a corruption offset against a payload of n bytes.
func offsetIn(off, n int) (int, bool) {
	if off < 0 {
		off += n
	}
	return off, off >= 0 && off < n
}

// rule is a Rule with its counters.
type rule struct {
	Rule
	mu      sync.Mutex
	rng     *rand.Rand
	seen    uint64
	fired   uint64
	removed bool
}

func (r *rule) matches(ev *Event) bool {
	if r.Op != ev.Op || (r.QPNum != 0 && r.QPNum != ev.QPNum) || ev.Len < r.MinLen || (r.MaxLen > 0 && ev.Len > r.MaxLen) {
		return false
	}
	if len(r.Opcodes) > 0 && (ev.Send == nil || !slices.Contains(r.Opcodes, ev.Send.Opcode)) {
		return false
	}
	if ev.WC != nil {
		if len(r.WCOpcodes) > 0 && !slices.Contains(r.WCOpcodes, ev.WC.Opcode) {
			return false
		}
		if len(r.Statuses) > 0 && !slices.Contains(r.Statuses, ev.WC.Status) {
			return false
		}
	}
	if r.Action == ActCorrupt {
		if _, ok := offsetIn(r.Offset, ev.Len); !ok || !ev.corruptible {
			return false
		}
	}
	return r.Match == nil || r.Match(ev)
}

// take counts a matching event and reports whether the rule fires on it.
func (r *rule) take() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.removed {
		return false
	}
	r.seen++
	k, first := r.seen, r.Nth
	if first == 0 {
		first = max(r.Every, 1)
	}
	if k < first {
		return false
	}
	if r.Every == 0 {
		if r.Nth > 0 && k != first {
			return false
		}
	} else if (k-first)%r.Every != 0 {
		return false
	}
	if r.Limit > 0 && r.fired >= r.Limit {
		return false
	}
	if r.Probability > 0 && r.rng.Float64() >= r.Probability {
		return false
	}
	r.fired++
	return true
}

// Handle is a rule added to an Injector.
type Handle struct {
	inj *Injector
	r   *rule
}

// Name returns the rule's name.
func (h *Handle) Name() string { return h.r.Name }

// Seen returns how many events matched the rule's predicates.
func (h *Handle) Seen() uint64 {
	h.r.mu.Lock()
	defer h.r.mu.Unlock()
	return h.r.seen
}

// Fired returns how many times the rule was selected to act. When several
// rules fire on one event the strongest action wins (status over drop over
// corrupt); each still counts its firing.
func (h *Handle) Fired() uint64 {
	h.r.mu.Lock()
	defer h.r.mu.Unlock()
	return h.r.fired
}

// Remove stops the rule; its counters stay readable.
func (h *Handle) Remove() { h.inj.remove(h.r) }

// RuleStats are a rule's counters.
type RuleStats struct {
	Name        string
	Op          Op
	Action      Action
	Seen, Fired uint64
}

// decision is what the rules chose for one event: the first firing rule
// of each action.
type decision struct {
	fail, drop, corrupt, status, qpErr, delay *rule
}

func (d *decision) set(r *rule) {
	var p **rule
	switch r.Action {
	case ActFailReg:
		p = &d.fail
	case ActDrop:
		p = &d.drop
	case ActCorrupt:
		p = &d.corrupt
	case ActStatus:
		p = &d.status
	case ActQPError:
		p = &d.qpErr
	case ActDelay:
		p = &d.delay
	}
	if p != nil && *p == nil {
		*p = r
	}
}

func (r *rule) failErr() error {
	if r.Err != nil {
		return r.Err
	}
	return unix.ENOMEM
}
