package bpf

import (
	"os/exec"
	"path/filepath"
	"testing"
)

// The enlargement marker of a real rdmagrpc binary (conn over shm): each
// connection pair enlarges once, seen as two events, the writer's
// (outcome 1, enlarged) and the reader's (outcome 5, served), with the
// slot sizes of conn's defaults.
func TestConnEnlargementMarker(t *testing.T) {
	requireRoot(t)
	dir := helpers(t)
	bin := filepath.Join(dir, "connenlarge")
	if out, err := exec.Command("go", "build", "-o", bin, "./testdata/connenlarge").CombinedOutput(); err != nil {
		t.Fatalf("build testdata/connenlarge: %v\n%s", err, out)
	}
	const n = 6
	tg := startTarget(t, bin, "-n", "6")
	tr, err := Open(Options{PID: tg.cmd.Process.Pid})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	got, err := tr.AttachGoFuncs(bin, KnownGoFuncs)
	if err != nil {
		t.Fatalf("AttachGoFuncs: %v", err)
	}
	if len(got) != 3 {
		t.Fatalf("attached %v, want shm regMR, deregMR and conn.enlargementMarker", got)
	}
	tg.run(t)
	outcomes := map[uint32]int{}
	for _, ev := range drain(t, tr) {
		if ev.Kind != KindEnlargement {
			continue
		}
		outcomes[ev.Outcome]++
		if ev.FromSize != 1024 || ev.ToSize != 32<<10 || ev.ConnID == 0 {
			t.Errorf("enlargement event %+v: want 1024 → 32768 on a connection", ev)
		}
	}
	if outcomes[1] != n || outcomes[5] != n || len(outcomes) != 2 {
		t.Fatalf("enlargement outcomes %v, want %d enlarged (1) and %d served (5)", outcomes, n, n)
	}
}
