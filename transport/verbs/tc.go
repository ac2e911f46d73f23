package verbs

import (
	"os"
	"strconv"
	"strings"
)

// TrafficClassEnv names the IP traffic class (DSCP << 2 | ECN, 0–255) of
// rdmagrpc's RoCE traffic: rdma_cm's RDMA_OPTION_ID_TOS, set on every id
// this provider creates, which RoCE carries in the GRH and the IP header.
// It is how a PFC/ECN fabric puts the traffic into its lossless class
// (NCCL_IB_TC and UCX_IB_TRAFFIC_CLASS do the same). Unset: rdma_cm's
// default, 0, best effort: on a lossy class, drops surface as "transport
// retry counter exceeded". Read at Open.
const TrafficClassEnv = "RDMAGRPC_VERBS_TC"

// trafficClass parses TrafficClassEnv: -1 when unset. A bad value is an
// error (a misconfigured fabric setting must not pass silently).
func trafficClass() (int, error) {
	v, ok := os.LookupEnv(TrafficClassEnv)
	if !ok || strings.TrimSpace(v) == "" {
		return -1, nil
	}
	return parseTrafficClass(v)
}

func parseTrafficClass(v string) (int, error) {
	n, err := strconv.ParseUint(strings.TrimSpace(v), 0, 8)
	if err != nil {
		return 0, unusable("%s=%q: want a traffic class from 0 to 255 (DSCP × 4, e.g. 106 for DSCP 26 with ECN)", TrafficClassEnv, v)
	}
	return int(n), nil
}
