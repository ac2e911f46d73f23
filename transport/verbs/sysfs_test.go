package verbs

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The RoCE version preference finds the entry of the other version for
// the same address, and says clearly when there is none.
func TestGIDOfVersion(t *testing.T) {
	root := t.TempDir()
	port := filepath.Join(root, "class", "infiniband", "mlx5_0", "ports", "1")
	for _, g := range []struct{ idx, gid, typ string }{
		{"0", "fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1"},
		{"1", "fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"},
		{"2", "0000:0000:0000:0000:0000:ffff:0a00:0001", "IB/RoCE v1"},
		{"3", "0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2"},
		{"4", "0000:0000:0000:0000:0000:ffff:0a00:0002", "RoCE v2"},
	} {
		for dir, v := range map[string]string{"gids": g.gid, filepath.Join("gid_attrs", "types"): g.typ} {
			if err := os.MkdirAll(filepath.Join(port, dir), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(port, dir, g.idx), []byte(v+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, c := range []struct{ from, v, want int }{{2, 2, 3}, {3, 1, 2}, {3, 2, 3}, {1, 1, 0}} {
		got, err := gidOfVersion(root, "mlx5_0", 1, c.from, c.v)
		if err != nil || got != c.want {
			t.Errorf("GID %d as RoCE v%d: %d, %v; want %d", c.from, c.v, got, err, c.want)
		}
	}
	if _, err := gidOfVersion(root, "mlx5_0", 1, 4, 1); err == nil || !strings.Contains(err.Error(), "no IB/RoCE v1 GID for 10.0.0.2") {
		t.Errorf("no v1 entry for 10.0.0.2: %v", err)
	}
	for a, want := range map[string]string{
		"10.0.0.1": "", "10.0.0.2": "", "0.0.0.0": "",
		"10.0.0.3": "no RDMA port has a GID for 10.0.0.3: the address must be on the network device of an RDMA port; the ports' GIDs: mlx5_0/1: 10.0.0.1, mlx5_0/1: 10.0.0.2, mlx5_0/1: fe80::1)",
	} {
		if got := gidHint(root, netip.MustParseAddr(a)); !strings.HasSuffix(got, want) || (want == "") != (got == "") {
			t.Errorf("gidHint(%s) = %q, want %q", a, got, want)
		}
	}
	if err := os.WriteFile(filepath.Join(port, "state"), []byte("1: DOWN\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := gidHint(root, netip.MustParseAddr("10.0.0.2")); !strings.Contains(got, "1: DOWN, not ACTIVE") {
		t.Errorf("gidHint on a port down: %q", got)
	}
	if gidType(root, "mlx5_0", 1, 3) != "RoCE v2" {
		t.Errorf("gidType(3) = %q", gidType(root, "mlx5_0", 1, 3))
	}
}
