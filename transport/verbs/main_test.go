package verbs

import (
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport/transporttest"
	"go.uber.org/goleak"
)

// Every goroutine of the provider (rdma_cm dispatcher, async event
// reader) must be gone once the tests closed their devices. A process
// started as a conformance peer never returns from MaybeRunPeer.
func TestMain(m *testing.M) {
	transporttest.MaybeRunPeer()
	goleak.VerifyTestMain(m)
}
