package verbs

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// abi.h is our own declaration of rdma-core's ABI; where rdma-core's
// headers are installed, every offset, size and constant we rely on must
// match theirs.
func TestABIMatchesSystemHeaders(t *testing.T) {
	for _, h := range []string{"/usr/include/infiniband/verbs.h", "/usr/include/rdma/rdma_cma.h"} {
		if _, err := os.Stat(h); err != nil {
			t.Skipf("rdma-core headers not installed (%v): nothing to compare abi.h with", err)
		}
	}
	cc := strings.Fields(goEnv(t, "CC"))
	if len(cc) == 0 {
		cc = []string{"cc"}
	}
	run := func(name string, flags ...string) string {
		bin := filepath.Join(t.TempDir(), name)
		args := append(append(cc[1:], flags...), "-o", bin, "testdata/abi_layout.c")
		if out, err := exec.Command(cc[0], args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", cc[0], args, err, out)
		}
		out, err := exec.Command(bin).Output()
		if err != nil {
			t.Fatalf("%s: %v", bin, err)
		}
		return string(out)
	}
	system, ours := run("system", "-DSYSTEM"), run("ours")
	if system == "" {
		t.Fatal("the layout program printed nothing")
	}
	sys, our := strings.Split(system, "\n"), strings.Split(ours, "\n")
	if len(sys) != len(our) {
		t.Fatalf("layout outputs differ in length: %d lines with rdma-core's headers, %d with abi.h", len(sys), len(our))
	}
	for i := range sys {
		if sys[i] != our[i] {
			t.Errorf("rdma-core: %s\nabi.h:    %s", sys[i], our[i])
		}
	}
	t.Logf("%d offsets, sizes and constants match rdma-core's headers", len(sys)-1)
}

func goEnv(t *testing.T, key string) string {
	out, err := exec.Command("go", "env", key).Output()
	if err != nil {
		t.Fatalf("go env %s: %v", key, err)
	}
	return strings.TrimSpace(string(out))
}

// Without the libraries, load names the missing one and lets conn fall
// back; with them, it resolves every function abi.h lists.
func TestLoadLibraries(t *testing.T) {
	err := load()
	if !cgoBuilt {
		if err == nil || !strings.Contains(err.Error(), "built without cgo") || !errors.Is(err, transport.ErrUnavailable) {
			t.Fatalf("built without cgo, load = %v; want the \"built without cgo\" ErrUnavailable", err)
		}
		return
	}
	if err != nil {
		if !strings.Contains(err.Error(), "libibverbs.so.1") && !strings.Contains(err.Error(), "librdmacm.so.1") {
			t.Fatalf("load failed without naming the library: %v", err)
		}
		if !errors.Is(err, transport.ErrUnavailable) {
			t.Fatalf("load error does not wrap transport.ErrUnavailable: %v", err)
		}
		t.Logf("rdma-core not loadable here, as reported: %v", err)
		return
	}
	if !libLoaded() {
		t.Fatal("load returned nil but the function table is incomplete")
	}
	t.Log("libibverbs.so.1 and librdmacm.so.1 loaded; every function resolved")
}
