package verbs

import (
	"fmt"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Reliable-connection attributes. A zero field of transport.QPConfig means
// "use the default below"; what the trusted stacks do (REFERENCES.md §4):
//
//   - Timeout: local ACK timeout 4.096 µs·2^t. brpc and TensorFlow use
//     t = 14 (≈67 ms); rdma_cm's own RoCE default is ≈1 s. We take 14: long
//     enough for Soft-RoCE under emulation (measured ≈0.4 ms round trips
//     between two qemu guests), short enough that a dead peer is noticed
//     within 7·67 ms ≈ 0.5 s of retries rather than tens of seconds.
//   - RetryCount: 7, as rsockets, UCX and brpc all do; retransmission is
//     cheap and a lossy RoCE fabric needs it.
//   - RNRRetry: 6 (finite). rsockets and UCX use 7 (retry forever); brpc
//     uses 0 (fail at once). Like all three we run an explicit credit
//     window, so an RNR NAK means a credit bug: forever would hang the
//     connection silently, 0 would turn one late re-post into a dead
//     connection. Six retries surface the bug as StatusRNRRetryExcErr
//     after ≈8 ms.
//   - MinRNRTimer: 1.28 ms, the IB table entry nearest UCX's 1 ms.
//
// The QP is created by us (not rdma_create_qp) and driven through
// INIT/RTR/RTS with rdma_init_qp_attr plus these overrides, because
// librdmacm 44 offers no option for the RNR timer and applies the others
// only partly (retry counts travel in the CM REQ, the ACK timeout needs
// RDMA_OPTION_ID_ACK_TIMEOUT).
const (
	defaultTimeoutExp  = 14
	defaultRetryCount  = 7
	defaultRNRRetry    = 6
	defaultMinRNRTimer = 1280 * time.Microsecond

	defaultMaxWR  = 64
	defaultMaxSGE = 1
	// maxRdAtomic caps outstanding RDMA READs per QP in each direction.
	maxRdAtomic = 16
)

// rnrTimerTable is the IB encoding of the minimal RNR NAK timer
// (IBTA vol. 1, table 45): code i means rnrTimerTable[i]; code 0 is the
// longest delay, 655.36 ms.
var rnrTimerTable = [32]time.Duration{
	655360 * time.Microsecond,
	10 * time.Microsecond, 20 * time.Microsecond, 30 * time.Microsecond,
	40 * time.Microsecond, 60 * time.Microsecond, 80 * time.Microsecond,
	120 * time.Microsecond, 160 * time.Microsecond, 240 * time.Microsecond,
	320 * time.Microsecond, 480 * time.Microsecond, 640 * time.Microsecond,
	960 * time.Microsecond, 1280 * time.Microsecond, 1920 * time.Microsecond,
	2560 * time.Microsecond, 3840 * time.Microsecond, 5120 * time.Microsecond,
	7680 * time.Microsecond, 10240 * time.Microsecond, 15360 * time.Microsecond,
	20480 * time.Microsecond, 30720 * time.Microsecond, 40960 * time.Microsecond,
	61440 * time.Microsecond, 81920 * time.Microsecond, 122880 * time.Microsecond,
	163840 * time.Microsecond, 245760 * time.Microsecond, 327680 * time.Microsecond,
	491520 * time.Microsecond,
}

// encodeRNRTimer returns the smallest code whose delay is at least d.
func encodeRNRTimer(d time.Duration) uint8 {
	for code := 1; code < len(rnrTimerTable); code++ {
		if rnrTimerTable[code] >= d {
			return uint8(code)
		}
	}
	return 0 // 655.36 ms, the longest
}

// encodeTimeout returns the smallest t in 1..31 with 4.096 µs·2^t ≥ d.
// t = 0 (wait forever) is never produced.
func encodeTimeout(d time.Duration) uint8 {
	const unit = 4096 * time.Nanosecond
	for t := uint8(1); t < 31; t++ {
		if unit<<t >= d {
			return t
		}
	}
	return 31
}

// qpAttrs are the resolved attributes of one QP.
type qpAttrs struct {
	maxSendWR, maxRecvWR, maxSendSGE, maxRecvSGE, maxInline int
	timeout, retryCnt, rnrRetry, minRNRTimer                uint8
}

func resolveQPAttrs(cfg transport.QPConfig, attr transport.DeviceAttr) (qpAttrs, error) {
	a := qpAttrs{
		maxSendWR:   orDefault(cfg.MaxSendWR, defaultMaxWR),
		maxRecvWR:   orDefault(cfg.MaxRecvWR, defaultMaxWR),
		maxSendSGE:  orDefault(cfg.MaxSendSGE, defaultMaxSGE),
		maxRecvSGE:  orDefault(cfg.MaxRecvSGE, defaultMaxSGE),
		maxInline:   cfg.MaxInline,
		timeout:     defaultTimeoutExp,
		retryCnt:    defaultRetryCount,
		rnrRetry:    defaultRNRRetry,
		minRNRTimer: encodeRNRTimer(defaultMinRNRTimer),
	}
	if cfg.Timeout > 0 {
		a.timeout = encodeTimeout(cfg.Timeout)
	}
	if cfg.MinRNRTimer > 0 {
		a.minRNRTimer = encodeRNRTimer(cfg.MinRNRTimer)
	}
	switch {
	case cfg.RetryCount < 0 || cfg.RetryCount > 7:
		return a, fmt.Errorf("verbs: RetryCount %d out of range 0–7: %w", cfg.RetryCount, transport.ErrInvalidWR)
	case cfg.RetryCount > 0:
		a.retryCnt = uint8(cfg.RetryCount)
	}
	switch {
	case cfg.RNRRetry < 0 || cfg.RNRRetry > 7:
		return a, fmt.Errorf("verbs: RNRRetry %d out of range 0–7: %w", cfg.RNRRetry, transport.ErrInvalidWR)
	case cfg.RNRRetry > 0:
		a.rnrRetry = uint8(cfg.RNRRetry)
	}
	if a.maxSendWR < 0 || a.maxRecvWR < 0 || a.maxSendSGE < 0 || a.maxRecvSGE < 0 || a.maxInline < 0 {
		return a, fmt.Errorf("verbs: negative QP capacity in %+v", cfg)
	}
	if attr.MaxQPWR > 0 && (a.maxSendWR > attr.MaxQPWR || a.maxRecvWR > attr.MaxQPWR) {
		return a, fmt.Errorf("verbs: QP depth %d/%d exceeds device limit %d", a.maxSendWR, a.maxRecvWR, attr.MaxQPWR)
	}
	if attr.MaxSGE > 0 && (a.maxSendSGE > attr.MaxSGE || a.maxRecvSGE > attr.MaxSGE) {
		return a, fmt.Errorf("verbs: %d/%d SGEs exceed device limit %d", a.maxSendSGE, a.maxRecvSGE, attr.MaxSGE)
	}
	return a, nil
}

func orDefault(v, d int) int {
	if v == 0 {
		return d
	}
	return v
}
