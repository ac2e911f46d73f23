package verbs

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine of the provider (rdma_cm dispatcher, async event
// reader) must be gone once the tests closed their devices.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
