package main

import (
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// exported metric shapes of the stdout exporter, as far as the test reads
// them (spans: exportedSpan).
type jsonMetrics struct {
	ScopeMetrics []struct {
		Scope   struct{ Name string }
		Metrics []struct {
			Name string
			Data struct {
				DataPoints []struct {
					Attributes []struct {
						Key   string
						Value struct{ Value any }
					}
					Value any
				}
			}
		}
	}
}

// The demo as `make demo` runs it writes every span and metric: the
// enlargement spans of both directions beside otelgrpc's RPC spans, each
// a child of its connection's span, and the enlargement counter.
func TestDemoExportsOpenTelemetry(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the demo")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "demo")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build the demo: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "-otel", filepath.Join(dir, "otel"))
	cmd.Env = append(os.Environ(), "RDMAGRPC_PROVIDER=shm")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "OpenTelemetry: 846 spans in "+filepath.Join(dir, "otel", "traces.json")) {
		t.Errorf("the demo's output does not report its 846 spans:\n%s", out)
	}

	// The slow RPC with its transport events, read back from the export.
	for _, want := range []string{"the slowest client RPC that paid for an enlargement", "rdmagrpc.enlargement  enlargement.side=sender  enlargement.outcome=enlarged", "linked: rdmagrpc.enlargement.sender"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the demo's output lacks %q:\n%s", want, out)
		}
	}

	spans, err := readExported(filepath.Join(dir, "otel", "traces.json"))
	if err != nil {
		t.Fatal(err)
	}
	count := map[string]int{}
	connRole := map[string]string{}
	var enl []exportedSpan
	for _, s := range spans {
		count[s.Name]++
		switch s.Name {
		case "rdmagrpc.connection":
			connRole[s.SpanContext.SpanID], _ = s.attr("rdmagrpc.connection.role").(string)
		case "rdmagrpc.enlargement.sender", "rdmagrpc.enlargement.receiver":
			enl = append(enl, s)
		}
	}
	// 420 RPCs, a client and a server span each; two connections; each
	// direction enlarged once.
	want := map[string]int{"grpc.testing.TestService/UnaryCall": 840, "rdmagrpc.connection": 2,
		"rdmagrpc.enlargement.sender": 2, "rdmagrpc.enlargement.receiver": 2}
	if len(count) != len(want) {
		t.Errorf("spans %v, want %v", count, want)
	}
	for n, c := range want {
		if count[n] != c {
			t.Errorf("%d × %s, want %d", count[n], n, c)
		}
	}
	roles := map[string]int{}
	for _, s := range enl {
		role, ok := connRole[s.Parent.SpanID]
		if !ok {
			t.Errorf("%s %s: parent %s is no connection span", s.Name, s.SpanContext.SpanID, s.Parent.SpanID)
		}
		outcome := s.attr("rdmagrpc.enlargement.outcome")
		if s.Name == "rdmagrpc.enlargement.sender" && outcome != "enlarged" || s.Name == "rdmagrpc.enlargement.receiver" && outcome != "served" {
			t.Errorf("%s on the %s: outcome %v", s.Name, role, outcome)
		}
		roles[role+" "+s.Name]++
	}
	for _, k := range []string{"client rdmagrpc.enlargement.sender", "client rdmagrpc.enlargement.receiver", "server rdmagrpc.enlargement.sender", "server rdmagrpc.enlargement.receiver"} {
		if roles[k] != 1 {
			t.Errorf("enlargement spans by connection: %v, want one of each side on each connection", roles)
			break
		}
	}

	// Metrics: two exports, open (snapshot) and closed (shutdown).
	mf, err := os.Open(filepath.Join(dir, "otel", "metrics.json"))
	if err != nil {
		t.Fatal(err)
	}
	defer mf.Close()
	var exports []jsonMetrics
	for dec := json.NewDecoder(mf); ; {
		var m jsonMetrics
		if err := dec.Decode(&m); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		exports = append(exports, m)
	}
	if len(exports) != 2 {
		t.Fatalf("%d metric exports, want 2", len(exports))
	}
	points := func(m jsonMetrics, name string) map[string]float64 {
		out := map[string]float64{}
		for _, sm := range m.ScopeMetrics {
			for _, x := range sm.Metrics {
				if x.Name != name {
					continue
				}
				for _, p := range x.Data.DataPoints {
					var k []string
					for _, a := range p.Attributes {
						k = append(k, a.Key+"="+a.Value.Value.(string))
					}
					out[strings.Join(k, ",")], _ = p.Value.(float64)
				}
			}
		}
		return out
	}
	open := points(exports[0], "rdmagrpc.connection.count")
	if open["rdmagrpc.buffer.phase=large,rdmagrpc.connection.role=client,rdmagrpc.provider=shm"] != 1 || open["rdmagrpc.buffer.phase=large,rdmagrpc.connection.role=server,rdmagrpc.provider=shm"] != 1 {
		t.Errorf("open connections at the snapshot: %v, want one client and one server, both large", open)
	}
	enlargements := points(exports[1], "rdmagrpc.enlargements")
	if enlargements["rdmagrpc.enlargement.outcome=enlarged,rdmagrpc.enlargement.side=sender"] != 2 ||
		enlargements["rdmagrpc.enlargement.outcome=served,rdmagrpc.enlargement.side=receiver"] != 2 || len(enlargements) != 2 {
		t.Errorf("enlargement counter at exit: %v, want 2 enlarged, 2 served", enlargements)
	}
}
