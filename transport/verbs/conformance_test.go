package verbs

import (
	"net"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport/transporttest"
)

// The shared conformance suite over real verbs; it runs where a device
// exists (the tests/rxe guest) and skips elsewhere.
func TestConformance(t *testing.T) {
	for _, cross := range []bool{false, true} {
		name := map[bool]string{false: "OneProcess", true: "TwoProcesses"}[cross]
		t.Run(name, func(t *testing.T) {
			d := openOrSkip(t)
			addr := net.JoinHostPort(hostIP(t, d), "0")
			transporttest.Run(t, transporttest.Harness{Provider: Name, Device: d.Name(), ListenAddr: addr, CrossProcess: cross})
		})
	}
}
