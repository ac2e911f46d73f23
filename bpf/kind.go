package bpf

// Kind is what a probed call did.
type Kind uint8

const (
	KindRegister Kind = iota + 1
	KindDeregister
	KindReregister
	KindEnlargement
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
