package bpf

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
)

// Builds of testdata/connenlarge the way services ship: stripped
// (-ldflags='-s -w': no ELF symbol table, the probes are found through
// .gopclntab), with -trimpath, and as PIE; and each of those linked by the
// system linker, as every cgo program is, which puts C code at the start
// of .text, before runtime.text.
var connBuilds = []struct {
	name      string
	flags     []string
	toolchain string // GOTOOLCHAIN for the build; "": this test's own Go
}{
	{"default", nil, ""},
	{"stripped", []string{"-ldflags=-s -w"}, ""},
	{"pie-trimpath", []string{"-buildmode=pie", "-trimpath"}, ""},
	{"pie-trimpath-stripped", []string{"-buildmode=pie", "-trimpath", "-ldflags=-s -w"}, ""},
	{"ext", []string{"-ldflags=-linkmode=external"}, ""},
	{"ext-stripped", []string{"-ldflags=-linkmode=external -s -w"}, ""},
	{"ext-pie-trimpath", []string{"-buildmode=pie", "-trimpath", "-ldflags=-linkmode=external"}, ""},
	{"ext-pie-trimpath-stripped", []string{"-buildmode=pie", "-trimpath", "-ldflags=-linkmode=external -s -w"}, ""},
	// The next Go release's linker, which the module proxy serves as a
	// toolchain: a service may be built with it before this tree moves.
	{"next-ext", []string{"-ldflags=-linkmode=external"}, nextGo},
	{"next-ext-stripped", []string{"-ldflags=-linkmode=external -s -w"}, nextGo},
}

// nextGo is the Go release after the one go.mod names.
const nextGo = "go1.27.3"

// connPairs are the builds whose probes must be found at the same file
// offsets: each unstripped build (first) and its stripped twin.
var connPairs = [][2]string{
	{"default", "stripped"},
	{"pie-trimpath", "pie-trimpath-stripped"},
	{"ext", "ext-stripped"},
	{"ext-pie-trimpath", "ext-pie-trimpath-stripped"},
	{"next-ext", "next-ext-stripped"},
}

var connBuilt sync.Map // name → path, built once per run

func buildConn(t *testing.T, name string, flags []string, toolchain ...string) string {
	t.Helper()
	if p, ok := connBuilt.Load(name); ok {
		return p.(string)
	}
	bin := filepath.Join(helpers(t), "connenlarge-"+name)
	args := append(append([]string{"build", "-o", bin}, flags...), "./testdata/connenlarge")
	cmd := exec.Command("go", args...)
	if len(toolchain) > 0 && toolchain[0] != "" {
		// The go command fetches that toolchain from the module proxy.
		cmd.Env = append(os.Environ(), "GOTOOLCHAIN="+toolchain[0])
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build testdata/connenlarge %v with %v: %v\n%s", flags, toolchain, err, out)
	}
	connBuilt.Store(name, bin)
	return bin
}

// Stripped builds resolve to the very entries and RETs their unstripped
// twins resolve to, and those entries are where the unstripped symbol
// table puts each function, including in binaries whose runtime.text is
// not the start of .text.
func TestLocateGoFuncStripped(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ten binaries")
	}
	locs := map[string]map[string]goFunc{}
	for _, b := range connBuilds {
		bin := buildConn(t, b.name, b.flags, b.toolchain)
		if b.toolchain != "" {
			// The binary says which Go linked it: the build above did
			// not fall back to this test's own toolchain.
			out, err := exec.Command("go", "version", bin).CombinedOutput()
			if err != nil || !strings.Contains(string(out), b.toolchain) {
				t.Fatalf("%s: built by %q, want %s (%v)", b.name, strings.TrimSpace(string(out)), b.toolchain, err)
			}
		}
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatal(err)
		}
		stripped := f.Section(".symtab") == nil
		if want := strings.Contains(strings.Join(b.flags, " "), "-s"); stripped != want {
			t.Errorf("%s: symbol table present = %v", b.name, !stripped)
		}
		locs[b.name] = map[string]goFunc{}
		for _, fn := range KnownGoFuncs {
			loc, err := locateGoFunc(f, fn.Symbol)
			if err != nil {
				t.Fatalf("%s: %v", b.name, err)
			}
			locs[b.name][fn.Symbol] = loc
		}
		if !stripped {
			checkAgainstSymtab(t, b.name, f, locs[b.name])
		}
		f.Close()
	}
	for _, pair := range connPairs {
		if !reflect.DeepEqual(locs[pair[0]], locs[pair[1]]) {
			t.Errorf("%s and %s differ:\n%v\n%v", pair[0], pair[1], locs[pair[0]], locs[pair[1]])
		}
	}
}

// checkAgainstSymtab checks located entries against the file offsets of
// the symbol table's addresses, and that externally linked builds do
// have C code before runtime.text, which is what makes them a test of
// finding runtime.text.
func checkAgainstSymtab(t *testing.T, name string, f *elf.File, locs map[string]goFunc) {
	t.Helper()
	syms, err := f.Symbols()
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	addr := map[string]uint64{}
	for _, s := range syms {
		addr[s.Name] = s.Value
	}
	for sym, loc := range locs {
		off, err := fileOffset(f, addr[sym])
		if err != nil || off != loc.entry {
			t.Errorf("%s: %s located at file offset %#x; the symbol table's %#x is at %#x (%v)", name, sym, loc.entry, addr[sym], off, err)
		}
	}
	text := f.Section(".text")
	if ext := strings.Contains(name, "ext"); ext != (addr["runtime.text"] != text.Addr) {
		t.Errorf("%s: runtime.text %#x, .text %#x: external linking should put C code first", name, addr["runtime.text"], text.Addr)
	}
}

// The enlargement marker of a real rdmagrpc binary (conn over shm), as
// built by default and as shipped (stripped PIE with -trimpath): each
// connection pair enlarges once, seen as two events, the writer's
// (outcome 1, enlarged) and the reader's (outcome 5, served), with the
// slot sizes of conn's defaults.
func TestConnEnlargementMarker(t *testing.T) {
	requireRoot(t)
	for _, b := range []int{0, 3, len(connBuilds) - 1} {
		b := connBuilds[b]
		t.Run(b.name, func(t *testing.T) {
			bin := buildConn(t, b.name, b.flags, b.toolchain)
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
			regs, opened := 0, 0
			for _, ev := range drain(t, tr) {
				if ev.Kind == KindRegister {
					regs++
				}
				if ev.Kind == KindConnection && ev.Outcome == OutcomeOpenedRDMA {
					opened++
					if ev.FromSize != OpenedShm || ev.ToSize < WhyPinned || ev.ToSize > WhyDefault {
						t.Errorf("opened event %+v: want shm (%d) and a reason code (%d-%d)", ev, OpenedShm, WhyPinned, WhyDefault)
					}
				}
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
			if regs == 0 {
				t.Errorf("no shm registration seen")
			}
			if opened != 2*n { // both ends of each pair
				t.Errorf("%d connections seen opening over RDMA, want %d", opened, 2*n)
			}
		})
	}
}

// Idle shrinks reach the marker too: one per direction's writer and one
// per reader that dropped its large ring, as KindShrink.
func TestConnShrinkMarker(t *testing.T) {
	const n = 4
	outcomes := map[uint32]int{}
	for _, ev := range markerEvents(t, "-n", "4", "-shrink") {
		if ev.Kind != KindShrink {
			continue
		}
		outcomes[ev.Outcome]++
		if ev.FromSize != 32<<10 || ev.ToSize != 1024 || ev.ConnID == 0 {
			t.Errorf("shrink event %+v: want 32768 → 1024 on a connection", ev)
		}
	}
	if outcomes[OutcomeShrunk] != n || outcomes[OutcomeShrinkServed] != n || len(outcomes) != 2 {
		t.Fatalf("shrink outcomes %v, want %d shrunk and %d served", outcomes, n, n)
	}
}

// Parks reach the marker too: the writer's, once the reader released its
// ring and answered, and the reader's release, as KindPark.
func TestConnParkMarker(t *testing.T) {
	const n = 4
	outcomes := map[uint32]int{}
	for _, ev := range markerEvents(t, "-n", "4", "-park") {
		if ev.Kind == KindEnlargement || ev.Kind == KindShrink {
			t.Errorf("%v event %+v: the pairs only wrote 100 bytes", ev.Kind, ev)
		}
		if ev.Kind != KindPark {
			continue
		}
		outcomes[ev.Outcome]++
		if ev.FromSize != 1024 || ev.ToSize != 0 || ev.ConnID == 0 {
			t.Errorf("park event %+v: want 1024 → 0 on a connection", ev)
		}
	}
	if outcomes[OutcomeParked] != n || outcomes[OutcomeParkServed] != n || len(outcomes) != 2 {
		t.Fatalf("park outcomes %v, want %d parked and %d served", outcomes, n, n)
	}
}

// markerEvents runs the connenlarge target with args under the Go
// probes and returns every event they saw.
func markerEvents(t *testing.T, args ...string) []Event {
	t.Helper()
	requireRoot(t)
	b := connBuilds[0]
	bin := buildConn(t, b.name, b.flags)
	tg := startTarget(t, bin, args...)
	tr, err := Open(Options{PID: tg.cmd.Process.Pid})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer tr.Close()
	if _, err := tr.AttachGoFuncs(bin, KnownGoFuncs); err != nil {
		t.Fatalf("AttachGoFuncs: %v", err)
	}
	tg.run(t)
	return drain(t, tr)
}
