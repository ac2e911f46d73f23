package verbs

// The sizes a CQ starts at (cqgrow.go) and shares a device CQ by
// (sharedcq.go); here, not beside them, because the settings read them
// in builds without cgo too.
const (
	// initialCQE fills the first page of an rxe CQ (16 slots of 128
	// bytes after its 384-byte header) and holds an idle small-phase
	// connection's receives (conn posts 11).
	initialCQE = 15
	// defaultRecvPool is the receives the device's shared receive queue
	// keeps posted unless RecvPoolEnv says otherwise (pool.go): 511
	// messages in flight to the process at once, over all connections,
	// before a peer meets receiver-not-ready.
	defaultRecvPool = 511
	// defaultCQShare is how many views one device CQ serves unless
	// CQShareEnv says otherwise: as many idle ones as fill 4,096 entries
	// (a power of two, as rxe and mlx5 round a CQ to) beside the room
	// kept for the pool's receives (sharedcq.go), ≈2.2 KiB of an rxe CQ
	// per view.
	defaultCQShare = (4096 - 1 - defaultRecvPool) / initialCQE
)
