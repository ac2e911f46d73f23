package transporttest_test

import (
	"os"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport/transporttest"

	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
)

func TestMain(m *testing.M) {
	transporttest.MaybeRunPeer()
	os.Exit(m.Run())
}

func TestShmOneProcess(t *testing.T) {
	transporttest.Run(t, transporttest.Harness{Provider: "shm", ListenAddr: "127.0.0.1:0"})
}

func TestShmTwoProcesses(t *testing.T) {
	transporttest.Run(t, transporttest.Harness{Provider: "shm", ListenAddr: "127.0.0.1:0", CrossProcess: true})
}
