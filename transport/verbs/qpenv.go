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
)

// qpEnv holds the overrides; -1: unset.
type qpEnv struct{ timeout, retry, rnr int }

func readQPEnv() (qpEnv, error) {
	e := qpEnv{-1, -1, -1}
	for _, x := range []struct {
		name string
		max  uint64
		dst  *int
	}{{TimeoutEnv, 31, &e.timeout}, {RetryCountEnv, 7, &e.retry}, {RNRRetryEnv, 7, &e.rnr}} {
		v, ok := os.LookupEnv(x.name)
		if !ok || strings.TrimSpace(v) == "" {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 8)
		if err != nil || n > x.max {
			return e, unusable("%s=%q: want a number from 0 to %d", x.name, v, x.max)
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
}
