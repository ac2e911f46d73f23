package verbs

import (
	"os"
	"strconv"
	"strings"
)

// Environment overrides of the reliable-connection attributes
// (qpattr.go), named after the knobs operators of RoCE fabrics already
// set for NCCL (NCCL_IB_TIMEOUT, NCCL_IB_RETRY_CNT) and UCX: they win over
// what the code asked for, since they describe the fabric, which the code
// cannot know. Read at Open; a bad value is an error, never ignored.
const (
	// TimeoutEnv: the local ACK timeout exponent t, 4.096 µs × 2^t
	// (0–31; default 14, ≈ 67 ms). A long lossy path wants more.
	TimeoutEnv = "RDMAGRPC_VERBS_TIMEOUT"
	// RetryCountEnv: transport retries before "retry counter exceeded"
	// (0–7; default 7).
	RetryCountEnv = "RDMAGRPC_VERBS_RETRY_CNT"
	// RNRRetryEnv: receiver-not-ready retries (0–7, 7 meaning forever;
	// default 6).
	RNRRetryEnv = "RDMAGRPC_VERBS_RNR_RETRY"
	// MinRNRTimerEnv: the RNR NAK timer a receiver asks its sender to
	// wait before a retry, as the IB code (1–31: 1 is 10 µs, 14 the
	// default 1.28 ms, 31 is 491.52 ms; 0 is 655.36 ms).
	MinRNRTimerEnv = "RDMAGRPC_VERBS_MIN_RNR_TIMER"
	// ServiceLevelEnv: the service level of the address vector (0–15;
	// default: rdma_cm's, from the path record on InfiniBand, 0 on
	// RoCE, where drivers map it to the 802.1p priority), as NCCL_IB_SL.
	ServiceLevelEnv = "RDMAGRPC_VERBS_SL"
	// GIDIndexEnv: the source GID index (0–255; default: the one
	// rdma_cm picks for the address), as NCCL_IB_GID_INDEX. Both ends of
	// a connection must use GIDs of the same RoCE version.
	GIDIndexEnv = "RDMAGRPC_VERBS_GID_INDEX"
	// RoCEVersionEnv: 1 or 2, the RoCE version of the source GID: the
	// GID of the address rdma_cm picked, in the table entry of that
	// version (default: rdma_cm's, which follows the kernel's
	// default_roce_mode, normally v2). GIDIndexEnv wins over it.
	RoCEVersionEnv = "RDMAGRPC_VERBS_ROCE_VERSION"
)

// qpEnv holds the overrides; -1: unset.
type qpEnv struct{ timeout, retry, rnr, rnrTimer, sl, gidIndex, roce int }

func readQPEnv() (qpEnv, error) {
	e := qpEnv{-1, -1, -1, -1, -1, -1, -1}
	for _, x := range []struct {
		name     string
		min, max uint64
		dst      *int
	}{
		{TimeoutEnv, 0, 31, &e.timeout}, {RetryCountEnv, 0, 7, &e.retry}, {RNRRetryEnv, 0, 7, &e.rnr}, {MinRNRTimerEnv, 0, 31, &e.rnrTimer},
		{ServiceLevelEnv, 0, 15, &e.sl}, {GIDIndexEnv, 0, 255, &e.gidIndex}, {RoCEVersionEnv, 1, 2, &e.roce},
	} {
		v, ok := os.LookupEnv(x.name)
		if !ok || strings.TrimSpace(v) == "" {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 8)
		if err != nil || n < x.min || n > x.max {
			return e, unusable("%s=%q: want a number from %d to %d", x.name, v, x.min, x.max)
		}
		*x.dst = int(n)
	}
	return e, nil
}

func (e qpEnv) apply(a *qpAttrs) {
	if e.timeout >= 0 {
		a.timeout = uint8(e.timeout)
	}
	if e.retry >= 0 {
		a.retryCnt = uint8(e.retry)
	}
	if e.rnr >= 0 {
		a.rnrRetry = uint8(e.rnr)
	}
	if e.rnrTimer >= 0 {
		a.minRNRTimer = uint8(e.rnrTimer)
	}
}
