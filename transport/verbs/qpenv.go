package verbs

import "github.com/rdmagrpc/rdmagrpc/internal/settings"

// Environment overrides of the reliable-connection attributes
// (qpattr.go), named after the knobs operators of RoCE fabrics already
// set for NCCL (NCCL_IB_TIMEOUT, NCCL_IB_RETRY_CNT) and UCX: they win over
// what the code asked for, since they describe the fabric, which the code
// cannot know. Read at Open; a bad value is an error, never ignored.
const (
	// TimeoutEnv: the local ACK timeout exponent t, 4.096 µs × 2^t
	// (0–31; default 14, ≈ 67 ms). A long lossy path wants more.
	TimeoutEnv = settings.VerbsTimeout
	// RetryCountEnv: transport retries before "retry counter exceeded"
	// (0–7; default 7).
	RetryCountEnv = settings.VerbsRetryCnt
	// RNRRetryEnv: receiver-not-ready retries (0–7, 7 meaning forever;
	// default 6).
	RNRRetryEnv = settings.VerbsRNRRetry
	// MinRNRTimerEnv: the RNR NAK timer a receiver asks its sender to
	// wait before a retry, as the IB code (1–31: 1 is 10 µs, 14 the
	// default 1.28 ms, 31 is 491.52 ms; 0 is 655.36 ms).
	MinRNRTimerEnv = settings.VerbsMinRNR
	// ServiceLevelEnv: the service level of the address vector (0–15;
	// default: rdma_cm's, from the path record on InfiniBand, 0 on
	// RoCE, where drivers map it to the 802.1p priority), as NCCL_IB_SL.
	ServiceLevelEnv = settings.VerbsSL
	// GIDIndexEnv: the source GID index (0–255; default: the one
	// rdma_cm picks for the address), as NCCL_IB_GID_INDEX. Both ends of
	// a connection must use GIDs of the same RoCE version.
	GIDIndexEnv = settings.VerbsGIDIndex
	// RoCEVersionEnv: 1 or 2, the RoCE version of the source GID: the
	// GID of the address rdma_cm picked, in the table entry of that
	// version (default: rdma_cm's, which follows the kernel's
	// default_roce_mode, normally v2). GIDIndexEnv wins over it.
	RoCEVersionEnv = settings.VerbsRoCEVer
	// SendDepthEnv: how many send WRs a QP keeps in the device's queue;
	// the rest of the depth asked for is held by the provider
	// (sendhold.go). 0 puts all of it on the device; default 7, one page
	// of rxe's send queue.
	SendDepthEnv = settings.VerbsSendDepth
	// RecvDepthEnv: the depth of the shared receive queue a QP starts
	// with, grown to the depth asked for when a post finds it full
	// (srq.go). 0 gives each QP a receive queue of its own, of the full
	// depth; default 31, one page of rxe's queue at one scatter entry.
	RecvDepthEnv = settings.VerbsRecvDepth
	// CQShareEnv: how many of the consumer's CQs one device CQ serves
	// (sharedcq.go); 1 gives each a device CQ of its own. Default 273,
	// as many idle connections as fill 4,096 entries.
	CQShareEnv = settings.VerbsCQShare
	// RecvPoolEnv: the receives one shared receive queue of the device
	// keeps posted for every QP whose receives carry no data (pool.go);
	// 0: none (RecvDepthEnv applies to them too).
	RecvPoolEnv = settings.VerbsRecvPool
)

// defaultSendDepth is the send queue a QP keeps on the device unless
// SendDepthEnv says otherwise (sendhold.go).
const defaultSendDepth = 7

// defaultRecvDepth is the shared receive queue a QP starts with unless
// RecvDepthEnv says otherwise (srq.go).
const defaultRecvDepth = 31

// qpEnv holds the overrides; -1: unset.
type qpEnv struct {
	timeout, retry, rnr, rnrTimer, sl, gidIndex, roce, sendDepth, recvDepth, cqShare, recvPool int
}

func readQPEnv() (qpEnv, error) {
	e := qpEnv{-1, -1, -1, -1, -1, -1, -1, defaultSendDepth, defaultRecvDepth, defaultCQShare, defaultRecvPool}
	for _, x := range []struct {
		name string
		dst  *int
	}{
		{TimeoutEnv, &e.timeout}, {RetryCountEnv, &e.retry}, {RNRRetryEnv, &e.rnr}, {MinRNRTimerEnv, &e.rnrTimer},
		{ServiceLevelEnv, &e.sl}, {GIDIndexEnv, &e.gidIndex}, {RoCEVersionEnv, &e.roce},
		{SendDepthEnv, &e.sendDepth}, {RecvDepthEnv, &e.recvDepth}, {CQShareEnv, &e.cqShare}, {RecvPoolEnv, &e.recvPool},
	} {
		n, set, err := settings.Range(x.name)
		if err != nil {
			return e, badSetting(err)
		}
		if set {
			*x.dst = n
		}
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
