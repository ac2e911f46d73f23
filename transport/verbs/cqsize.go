package verbs

// The sizes a CQ starts at (cqgrow.go) and shares a device CQ by
// (sharedcq.go); here, not beside them, because the settings read them
// in builds without cgo too.
const (
	// initialCQE fills the first page of an rxe CQ (16 slots of 128
	// bytes after its 384-byte header) and holds an idle small-phase
	// connection's receives (conn posts 11).
	initialCQE = 15
	// defaultCQShare is how many views one device CQ serves unless
	// CQShareEnv says otherwise: as many idle ones as fill 4,096 entries
	// (a power of two, as rxe and mlx5 round a CQ to), ≈1.9 KiB of an
	// rxe CQ per view.
	defaultCQShare = (4096 - 1) / initialCQE
)
