package fault

import "sync/atomic"

// Live counts the resources opened through an Injector's devices and not
// yet closed: what a leak check after Close wants to see at zero. A
// double close counts once.
type Live struct {
	PDs, CQs, QPs, MRs int64
	MRBytes            int64 // bytes under live registrations
	Memory             int64 // bytes from AllocMemory not yet freed
}

type liveCounters struct {
	pds, cqs, qps, mrs, mrBytes, memory atomic.Int64
}

// Live returns the resources currently open through this injector.
func (inj *Injector) Live() Live {
	l := &inj.live
	return Live{PDs: l.pds.Load(), CQs: l.cqs.Load(), QPs: l.qps.Load(), MRs: l.mrs.Load(),
		MRBytes: l.mrBytes.Load(), Memory: l.memory.Load()}
}

// Zero reports whether nothing is open.
func (l Live) Zero() bool { return l == Live{} }

// once runs f the first time it is called for a resource.
type once struct{ done atomic.Bool }

func (o *once) do(f func()) {
	if !o.done.Swap(true) {
		f()
	}
}
