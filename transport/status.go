package transport

import "fmt"

// Status is a work completion status, numbered and named as enum ibv_wc_status.
type Status uint8

const (
	StatusSuccess Status = iota
	StatusLocLenErr
	StatusLocQPOpErr
	StatusLocEECOpErr
	StatusLocProtErr
	StatusWRFlushErr
	StatusMWBindErr
	StatusBadRespErr
	StatusLocAccessErr
	StatusRemInvReqErr
	StatusRemAccessErr
	StatusRemOpErr
	StatusRetryExcErr
	StatusRNRRetryExcErr
	StatusLocRDDViolErr
	StatusRemInvRDReqErr
	StatusRemAbortErr
	StatusInvEECNErr
	StatusInvEECStateErr
	StatusFatalErr
	StatusRespTimeoutErr
	StatusGeneralErr
)

var statusNames = [...]string{
	StatusSuccess:        "success",
	StatusLocLenErr:      "local length error",
	StatusLocQPOpErr:     "local QP operation error",
	StatusLocEECOpErr:    "local EE context operation error",
	StatusLocProtErr:     "local protection error",
	StatusWRFlushErr:     "Work Request Flushed Error",
	StatusMWBindErr:      "memory management operation error",
	StatusBadRespErr:     "bad response error",
	StatusLocAccessErr:   "local access error",
	StatusRemInvReqErr:   "remote invalid request error",
	StatusRemAccessErr:   "remote access error",
	StatusRemOpErr:       "remote operation error",
	StatusRetryExcErr:    "transport retry counter exceeded",
	StatusRNRRetryExcErr: "RNR retry counter exceeded",
	StatusLocRDDViolErr:  "local RDD violation error",
	StatusRemInvRDReqErr: "remote invalid RD request",
	StatusRemAbortErr:    "aborted error",
	StatusInvEECNErr:     "invalid EE context number",
	StatusInvEECStateErr: "invalid EE context state",
	StatusFatalErr:       "fatal error",
	StatusRespTimeoutErr: "response timeout error",
	StatusGeneralErr:     "general error",
}

// String returns the text ibv_wc_status_str returns.
func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("unknown status %d", uint8(s))
}

// Err returns nil for StatusSuccess and a *CompletionError otherwise.
func (wc *WorkCompletion) Err() error {
	if wc.Status == StatusSuccess {
		return nil
	}
	return &CompletionError{Status: wc.Status, ID: wc.ID, QPNum: wc.QPNum, VendorErr: wc.VendorErr}
}

// CompletionError is a failed work completion as a Go error.
type CompletionError struct {
	Status    Status
	ID        uint64
	QPNum     uint32
	VendorErr uint32
}

func (e *CompletionError) Error() string {
	return fmt.Sprintf("transport: work request %d on QP %d: %v (vendor error %#x)", e.ID, e.QPNum, e.Status, e.VendorErr)
}
