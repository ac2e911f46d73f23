package verbs

import "github.com/rdmagrpc/rdmagrpc/internal/settings"

// TrafficClassEnv names the IP traffic class (DSCP << 2 | ECN, 0–255) of
// rdmagrpc's RoCE traffic: rdma_cm's RDMA_OPTION_ID_TOS, set on every id
// this provider creates, which RoCE carries in the GRH and the IP header.
// It is how a PFC/ECN fabric puts the traffic into its lossless class
// (NCCL_IB_TC and UCX_IB_TRAFFIC_CLASS do the same). Unset: rdma_cm's
// default, 0, best effort: on a lossy class, drops surface as "transport
// retry counter exceeded". Read at Open.
const TrafficClassEnv = settings.VerbsTC

// trafficClass parses TrafficClassEnv: -1 when unset. A bad value is an
// error (a misconfigured fabric setting must not pass silently).
func trafficClass() (int, error) {
	v, ok := settings.Get(TrafficClassEnv)
	if !ok {
		return -1, nil
	}
	return parseTrafficClass(v)
}

func parseTrafficClass(v string) (int, error) {
	n, err := settings.ParseTrafficClass(v)
	if err != nil {
		return 0, badSetting(err)
	}
	return n, nil
}
