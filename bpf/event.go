package bpf

import (
	"bytes"
	"time"
)

// Event is one completed probed call.
type Event struct {
	Kind Kind
	Func string // "ibv_reg_mr_iova2", or the Go symbol
	PID  uint32
	TID  uint32 // thread that returned
	// EntryTID is the thread that entered; for a Go function it differs
	// from TID when the goroutine moved between threads mid-call.
	EntryTID uint32
	Comm     string

	Time     time.Time     // when the call started (wall clock)
	Duration time.Duration // entry to return, as seen by the probes
	OK       bool          // the call succeeded
	Result   uint64        // C: the raw return value (mr pointer or int); Go: the failure register (errno)

	// The registered region. For a deregistration, the region released;
	// for a reregistration, the region after the call, with the region
	// before it in PrevAddr/PrevLength.
	Addr, Length         uint64
	PrevAddr, PrevLength uint64
	Access               uint32 // IBV_ACCESS_* bits
	LKey, RKey           uint32 // libibverbs registrations only

	// KindEnlargement and KindConnection (conn.enlargementMarker arguments).
	ConnID          uint64
	FromSize        uint32
	ToSize          uint32
	EnlargeDuration time.Duration
	Outcome         uint32
}

// ibv_rereg_mr flag: the region's address and length change.
const ibvReregChangeTranslation = 1

// probe is what the tracer knows about one probed function; its index
// in Tracer.probes is the probe id in the attach cookie.
type probe struct {
	shape probeShape
	name  string
	kind  Kind
	goFn  GoFunc
}

func decode(raw *probesEvent, p *probe, monoToWall time.Duration) Event {
	ev := Event{
		Kind:     p.kind,
		Func:     p.name,
		PID:      raw.Pid,
		TID:      raw.Tid,
		EntryTID: raw.EntryTid,
		Comm:     string(bytes.TrimRight(raw.Comm[:], "\x00")),
		Time:     time.Unix(0, int64(raw.StartNs)).Add(monoToWall),
		Duration: time.Duration(raw.DurationNs),
		Result:   raw.Rets[0],
	}
	a := &raw.Args
	switch p.shape {
	case shapeIbvRegMR: // (pd, addr, length, iova, access) -> mr
		ev.OK = raw.Rets[0] != 0
		ev.Addr, ev.Length, ev.Access = a[1], a[2], uint32(a[4])
		ev.LKey, ev.RKey = raw.MrLkey, raw.MrRkey
	case shapeIbvRegDmabuf: // (pd, offset, length, iova, fd, access) -> mr
		ev.OK = raw.Rets[0] != 0
		ev.Addr, ev.Length, ev.Access = a[3], a[2], uint32(a[5])
		ev.LKey, ev.RKey = raw.MrLkey, raw.MrRkey
	case shapeIbvReregMR: // (mr, flags, pd, addr, length, access) -> int
		ev.OK = int32(raw.Rets[0]) == 0
		ev.PrevAddr, ev.PrevLength = raw.MrAddr, raw.MrLen
		ev.Addr, ev.Length, ev.Access = raw.MrAddr, raw.MrLen, uint32(a[5])
		if a[1]&ibvReregChangeTranslation != 0 {
			ev.Addr, ev.Length = a[3], a[4]
		}
	case shapeIbvDeregMR: // (mr) -> int
		ev.OK = int32(raw.Rets[0]) == 0
		ev.Addr, ev.Length = raw.MrAddr, raw.MrLen
	case shapeGoFunc:
		decodeGo(&ev, raw, &p.goFn)
	}
	return ev
}

func decodeGo(ev *Event, raw *probesEvent, fn *GoFunc) {
	reg := func(regs []uint64, i int) uint64 {
		if i < 0 || i >= len(regs) {
			return 0
		}
		return regs[i]
	}
	args := raw.Args[:]
	ev.Result = 0 // RAX at a RET of a function without results is garbage
	if fn.Kind == KindEnlargement {
		ev.OK = true
		ev.ConnID = args[markerConnID]
		ev.FromSize = uint32(args[markerFrom])
		ev.ToSize = uint32(args[markerTo])
		ev.EnlargeDuration = time.Duration(int64(args[markerDuration]))
		ev.Outcome = uint32(args[markerOutcome])
		switch {
		case ev.Outcome >= OutcomeOpenedRDMA && ev.Outcome <= OutcomeClosed:
			ev.Kind = KindConnection
		case ev.Outcome == OutcomeShrunk || ev.Outcome == OutcomeShrinkServed:
			ev.Kind = KindShrink
		case ev.Outcome == OutcomeParked || ev.Outcome == OutcomeParkServed:
			ev.Kind = KindPark
		}
		return
	}
	ev.Addr = reg(args, fn.Addr)
	ev.Length = reg(args, fn.Len)
	ev.Access = uint32(reg(args, fn.Access))
	rets := raw.Rets[:]
	failed := reg(rets, fn.Err)
	if fn.ErrBytes > 0 && fn.ErrBytes < 8 {
		failed &= 1<<(8*fn.ErrBytes) - 1
	}
	ev.OK = fn.Err == NoReg || failed == 0
	ev.Result = failed
	if ev.OK && fn.Key != NoReg {
		k := uint32(reg(rets, fn.Key))
		ev.LKey, ev.RKey = k, k
	}
}
