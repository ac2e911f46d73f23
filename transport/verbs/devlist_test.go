package verbs

import (
	"strings"
	"testing"
)

func TestDevList(t *testing.T) {
	for _, c := range []struct {
		v     string
		dev   string
		port  int
		allow bool
	}{
		{"", "mlx5_0", 1, true},
		{"mlx5_0", "mlx5_0", 1, true},
		{"mlx5_0", "mlx5_1", 1, false},
		{"mlx5_0:1,mlx5_1", "mlx5_0", 2, false},
		{"mlx5_0:1,mlx5_1", "mlx5_0", 1, true},
		{"mlx5_0:1,mlx5_1", "mlx5_0", 0, true},
		{"mlx5_0:1,mlx5_1", "mlx5_1", 2, true},
		{"^mlx5_2", "mlx5_2", 1, false},
		{"^mlx5_2", "mlx5_2", 0, false},
		{"^mlx5_2", "mlx5_0", 1, true},
		{"^mlx5_2:2", "mlx5_2", 1, true},
		{"^mlx5_2:2", "mlx5_2", 2, false},
		{"^mlx5_2:2", "mlx5_2", 0, true}, // port 1 remains
		{" rxe0 , rxe1:1 ", "rxe1", 1, true},
	} {
		l, err := parseDevList(c.v)
		if err != nil {
			t.Fatalf("%q: %v", c.v, err)
		}
		if got := l.allows(c.dev, c.port); got != c.allow {
			t.Errorf("%q allows(%s, %d) = %v, want %v", c.v, c.dev, c.port, got, c.allow)
		}
	}
	for _, bad := range []string{"^", "mlx5_0:x", "mlx5_0:0", ",mlx5_0", "mlx5_0:256"} {
		if _, err := parseDevList(bad); err == nil || !strings.Contains(err.Error(), DevicesEnv) {
			t.Errorf("%q: %v, want an error naming %s", bad, err, DevicesEnv)
		}
	}
	if l, _ := parseDevList("^a:1,b"); l.String() != "^a:1,b" {
		t.Errorf("String() = %q", l.String())
	}
}
