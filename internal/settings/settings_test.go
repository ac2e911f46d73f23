package settings

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		env     string
		err     string // a bad value: the error contains it
		warning string // an unknown name: the warning contains it
	}{
		{env: "RDMAGRPC_PROVIDER=verbs"},
		{env: "RDMAGRPC_PROVIDER=VERBS"},
		{env: "RDMAGRPC_PROVIDER= Shm "},
		{env: "RDMAGRPC_PROVIDER="},
		{env: "RDMAGRPC_PROVIDER=bogus", err: `RDMAGRPC_PROVIDER="bogus": want verbs or shm`},
		{env: "RDMAGRPC_PROVIDER=tcp", err: "tcp is not a provider"},
		{env: "RDMAGRPC_LOG=warn"},
		{env: "RDMAGRPC_LOG=DEBUG"},
		{env: "RDMAGRPC_LOG=verbose", err: `RDMAGRPC_LOG="verbose": want debug, info, warn or error`},
		{env: "RDMAGRPC_REG_BUDGET=512m"},
		{env: "RDMAGRPC_REG_BUDGET=0"},
		{env: "RDMAGRPC_REG_BUDGET=garbage", err: `RDMAGRPC_REG_BUDGET="garbage": want a number of bytes`},
		{env: "RDMAGRPC_REG_BUDGET=-1k", err: "RDMAGRPC_REG_BUDGET"},
		{env: "RDMAGRPC_REG_BUDGET=99999999999g", err: "overflows"},
		{env: "RDMAGRPC_VERBS_TC=106"},
		{env: "RDMAGRPC_VERBS_TC=0x68"},
		{env: "RDMAGRPC_VERBS_TC=abc", err: `RDMAGRPC_VERBS_TC="abc": want a traffic class from 0 to 255`},
		{env: "RDMAGRPC_VERBS_TC=256", err: "RDMAGRPC_VERBS_TC"},
		{env: "RDMAGRPC_VERBS_DEVICES=mlx5_0:1,mlx5_1"},
		{env: "RDMAGRPC_VERBS_DEVICES=^", err: "RDMAGRPC_VERBS_DEVICES"},
		{env: "RDMAGRPC_VERBS_DEVICES=mlx5_0:x", err: "a port number from 1 to 255"},
		{env: "RDMAGRPC_VERBS_TIMEOUT=20"},
		{env: "RDMAGRPC_VERBS_TIMEOUT=32", err: `RDMAGRPC_VERBS_TIMEOUT="32": want a number from 0 to 31`},
		{env: "RDMAGRPC_VERBS_RETRY_CNT=8", err: "from 0 to 7"},
		{env: "RDMAGRPC_VERBS_RNR_RETRY=-1", err: "from 0 to 7"},
		{env: "RDMAGRPC_VERBS_MIN_RNR_TIMER=fast", err: "from 0 to 31"},
		{env: "RDMAGRPC_VERBS_SL=16", err: "from 0 to 15"},
		{env: "RDMAGRPC_VERBS_GID_INDEX=256", err: "from 0 to 255"},
		{env: "RDMAGRPC_VERBS_ROCE_VERSION=3", err: "from 1 to 2"},
		{env: "RDMAGRPC_VERBS_ROCE_VERSION=2"},
		{env: "RDMAGRPC_PROVDER=shm", warning: "RDMAGRPC_PROVDER is not an rdmagrpc setting, ignored; did you mean RDMAGRPC_PROVIDER?"},
		{env: "RDMAGRPC_VERBS_DEVICE=mlx5_0", warning: "did you mean RDMAGRPC_VERBS_DEVICES?"},
		{env: "RDMAGRPC_TC=106", warning: "did you mean RDMAGRPC_VERBS_TC?"},
		{env: "rdmagrpc_log=debug", warning: "did you mean RDMAGRPC_LOG?"},
		{env: "RDMAGRPC_FROBNICATE=1", warning: "RDMAGRPC_FROBNICATE is not an rdmagrpc setting, ignored"},
		{env: "RDMAGRPC_DEMO_ADDR=x"},
		{env: "RDMAGRPC_RXE_CACHE=/tmp"},
		{env: "RDMAGRPC_CONN_TEST_SERVER=1"},
		{env: "OTHER_PROVIDER=bogus"},
	} {
		ps := Check([]string{tc.env})
		switch {
		case tc.err == "" && tc.warning == "":
			if len(ps) != 0 {
				t.Errorf("%s: %v, want no problem", tc.env, ps)
			}
		case len(ps) != 1:
			t.Errorf("%s: %d problems %v, want 1", tc.env, len(ps), ps)
		case tc.err != "":
			if ps[0].Warning || !strings.Contains(ps[0].String(), tc.err) || !errors.Is(ps[0].Err, transport.ErrBadSetting) {
				t.Errorf("%s: %+v, want an ErrBadSetting containing %q", tc.env, ps[0], tc.err)
			}
			if !errors.Is(Err(ps), transport.ErrBadSetting) {
				t.Errorf("%s: Err(%v) is not an ErrBadSetting", tc.env, ps)
			}
		default:
			if !ps[0].Warning || !strings.Contains(ps[0].String(), tc.warning) {
				t.Errorf("%s: %+v, want a warning containing %q", tc.env, ps[0], tc.warning)
			}
			if Err(ps) != nil {
				t.Errorf("%s: an unknown name is an error: %v", tc.env, Err(ps))
			}
		}
	}
}

func TestParseProvider(t *testing.T) {
	for in, want := range map[string]string{"verbs": "verbs", "VERBS": "verbs", "Shm": "shm", " shm\n": "shm"} {
		if got, err := ParseProvider(in); got != want || err != nil {
			t.Errorf("ParseProvider(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	t.Setenv(Provider, "")
	if n, err := ProviderName(); n != "" || err != nil {
		t.Errorf("unset: %q, %v", n, err)
	}
	t.Setenv(VerbsSL, " 3 ")
	if n, set, err := Range(VerbsSL); n != 3 || !set || err != nil {
		t.Errorf("Range(%s) = %d, %v, %v", VerbsSL, n, set, err)
	}
}

// Every RDMAGRPC_* name in the module's Go files is a setting or a tool's
// variable: a variable added to a test or a tool without a line in Tools
// would be warned about in every process that has it set.
func TestEveryNameKnown(t *testing.T) {
	// Not in Tools on purpose: the misspelling tests use, and the verbs
	// device tests' RDMAGRPC_VERBS_DEVICE, which an operator is more
	// likely to set meaning RDMAGRPC_VERBS_DEVICES.
	misspelt := map[string]bool{"RDMAGRPC_PROVDER": true, "RDMAGRPC_VERBS_DEVICE": true}
	re := regexp.MustCompile(`"(RDMAGRPC_[A-Z0-9_]+)"`)
	root := filepath.Join("..", "..")
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			if _, ok := Lookup(m[1]); !ok && !IsTool(m[1]) && !misspelt[m[1]] {
				t.Errorf("%s: %s is neither a setting nor in Tools", path, m[1])
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
