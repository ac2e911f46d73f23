package bpf

// Kind is what a probed call did.
type Kind uint8

const (
	KindRegister Kind = iota + 1
	KindDeregister
	KindReregister
	KindEnlargement
	// KindConnection: a connection opened (over RDMA or TCP) or closed;
	// conn reports it on the enlargement marker with an outcome code of
	// its own (OutcomeOpenedRDMA...).
	KindConnection
	// KindShrink: a direction went back to its small buffers (conn's
	// idle shrink), on the enlargement marker too: our sending direction
	// (OutcomeShrunk) or the peer's, whose large ring was dropped here
	// (OutcomeShrinkServed).
	KindShrink
	// KindPark: an idle small direction parked and the pages of its ring
	// went back (conn's park.go), on the enlargement marker too: ours
	// (OutcomeParked) or the peer's, whose ring we released
	// (OutcomeParkServed).
	KindPark
)

// The enlargement marker's outcome codes of connection events (conn's
// outcomeOpenedRDMA, outcomeOpenedTCP, outcomeClosed).
const (
	OutcomeOpenedRDMA = 7
	OutcomeOpenedTCP  = 8
	OutcomeClosed     = 9

	// Shrink codes (conn's outcomeShrunk, outcomeShrinkServed).
	OutcomeShrunk       = 10
	OutcomeShrinkServed = 11

	// Park codes (conn's outcomeParked, outcomeParkServed).
	OutcomeParked     = 12
	OutcomeParkServed = 13

	// The provider of an OutcomeOpenedRDMA event, in its FromSize (conn's
	// providerCodes); 0: not said.
	OpenedShm   = 1
	OpenedVerbs = 2

	// Why the connection of an OutcomeOpenedRDMA event has its provider,
	// in its ToSize (conn's reasonPinned...); 0: not said.
	WhyPinned    = 1 // WithProvider or RDMAGRPC_PROVIDER
	WhySameHost  = 2 // the peer is on this host (same kernel): shared memory
	WhyOtherHost = 3 // the peer is on another host
	WhyDefault   = 4 // the process's provider: an RDMA device found, or none
)

func (k Kind) String() string {
	switch k {
	case KindRegister:
		return "reg"
	case KindDeregister:
		return "dereg"
	case KindReregister:
		return "rereg"
	case KindEnlargement:
		return "enlarge"
	case KindConnection:
		return "conn"
	case KindShrink:
		return "shrink"
	case KindPark:
		return "park"
	}
	return "unknown"
}

// probeShape is the low byte of an attach cookie; it tells the BPF program
// which registers and memory to read. Mirrors the KIND_* enum in
// rdmatrace.c.
type probeShape uint8

const (
	shapeIbvRegMR     probeShape = 1
	shapeIbvRegDmabuf probeShape = 2
	shapeIbvReregMR   probeShape = 3
	shapeIbvDeregMR   probeShape = 4
	shapeGoFunc       probeShape = 5
)
