package bpf

// Module is the import path prefix of rdmagrpc's own functions.
const Module = "github.com/rdmagrpc/rdmagrpc"

// NoReg marks an argument or result a Go function does not have.
const NoReg = -1

// GoFunc describes a Go function to probe and how to read its registers.
//
// Register indices count Go's ABIInternal integer registers in order
// (RAX, RBX, RCX, RDI, RSI, R8, R9, R10, R11), for arguments and results
// alike: a method receiver comes first, a slice takes three registers
// (pointer, length, capacity), a string two, an interface or error two
// (type word, data word). Functions with float or struct arguments that
// spill to the stack are out of scope.
type GoFunc struct {
	Symbol string // full symbol, e.g. Module + "/transport/shm.regMR"
	Kind   Kind

	// For KindRegister / KindDeregister: registers holding the region's
	// address, length and access flags, or NoReg.
	Addr, Len, Access int
	// Err is the result register that is non-zero when the call failed
	// (an errno, or an error's type word), or NoReg when it cannot fail.
	// ErrBytes is its width: Go leaves the upper bits of a register holding
	// a narrower value undefined, so only the low ErrBytes count (0 = 8).
	Err, ErrBytes int
	// Key is the result register holding the new region's key, or NoReg.
	Key int
}

// Enlargement marker layout, fixed by conn's marker function:
//
//	func enlargementMarker(connID uint64, fromSize, toSize uint32,
//		durationNanos int64, outcome uint32)
//
// so connID is RAX, fromSize RBX, toSize RCX, durationNanos RDI and
// outcome RSI.
const (
	markerConnID = iota
	markerFrom
	markerTo
	markerDuration
	markerOutcome
)

// KnownGoFuncs are rdmagrpc's probe points: the shm provider's
// registration pair and conn's enlargement marker. Each is a //go:noinline
// function kept for tracing; see transport/shm and conn.
var KnownGoFuncs = []GoFunc{
	// func regMR(addr, length uint64, access uint32, pdID uint32) (key uint32, errno int32)
	{Symbol: Module + "/transport/shm.regMR", Kind: KindRegister,
		Addr: 0, Len: 1, Access: 2, Err: 1, ErrBytes: 4, Key: 0},
	// func deregMR(addr, length uint64, key uint32, pdID uint32) (errno int32)
	{Symbol: Module + "/transport/shm.deregMR", Kind: KindDeregister,
		Addr: 0, Len: 1, Access: NoReg, Err: 0, ErrBytes: 4, Key: NoReg},
	{Symbol: Module + "/conn.enlargementMarker", Kind: KindEnlargement,
		Addr: NoReg, Len: NoReg, Access: NoReg, Err: NoReg, Key: NoReg},
}
