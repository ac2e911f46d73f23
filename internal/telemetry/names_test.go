package telemetry

import (
	"context"
	"errors"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// collectAll makes every instrument report at least once and returns
// what a reader collects: name → (instrument kind, unit).
func collectAll(t *testing.T) map[string][2]string {
	t.Helper()
	rd := sdkmetric.NewManualReader()
	s := newSet(sdktrace.NewTracerProvider(), sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)))
	c := s.StartConn(context.Background(), Client, 1, "shm", "test")
	c.Connected(nil, nil, func() Snapshot { return Snapshot{SmallBytes: 1} })
	c.Registered(4096, time.Microsecond, nil)
	c.Registered(4096, time.Microsecond, errors.New("x"))
	c.CreditStall()
	c.RendezvousOut(1)
	c.RendezvousIn()
	c.ReadLanded(1)
	c.StartEnlargement(Sender, time.Now(), 1, 2, 3).End(Enlarged, Large, time.Millisecond, nil)
	c.Shrunk(Sender, ReasonIdle, time.Now(), time.Millisecond, 2, 1, nil)
	c.Parked(Sender)
	var rm metricdata.ResourceMetrics
	if err := rd.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	c.End()
	got := map[string][2]string{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			kind := "?"
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				kind = "up-down counter"
				if d.IsMonotonic {
					kind = "counter"
				}
			case metricdata.Sum[float64]:
				kind = "up-down counter"
				if d.IsMonotonic {
					kind = "counter"
				}
			case metricdata.Histogram[float64], metricdata.Histogram[int64]:
				kind = "histogram"
			}
			got[m.Name] = [2]string{kind, m.Unit}
		}
	}
	return got
}

// The semantic conventions' naming rules, checked on what is exported:
// counters are not named ".count" (kept for up-down counters), units are
// UCUM or an {annotation}, histograms measure seconds, byte counters By.
func TestMetricNamesFollowConventions(t *testing.T) {
	got := collectAll(t)
	if len(got) != 12 {
		t.Errorf("%d metrics collected, want 12: %v", len(got), got)
	}
	annotation := regexp.MustCompile(`^\{[a-z_]+\}$`)
	for name, ku := range got {
		kind, unit := ku[0], ku[1]
		if !strings.HasPrefix(name, "rdmagrpc.") {
			t.Errorf("%s: not in the rdmagrpc namespace", name)
		}
		if strings.HasSuffix(name, ".count") && kind != "up-down counter" {
			t.Errorf("%s: a %s named .count", name, kind)
		}
		if kind == "histogram" && unit != "s" {
			t.Errorf("%s: histogram in %q, want s", name, unit)
		}
		if strings.HasSuffix(name, ".bytes") || strings.HasPrefix(name, "rdmagrpc.memory.") {
			if unit != "By" {
				t.Errorf("%s: bytes in %q, want By", name, unit)
			}
		} else if kind != "histogram" && !annotation.MatchString(unit) {
			t.Errorf("%s: unit %q, want an {annotation}", name, unit)
		}
	}
}

// README's table of metrics lists every metric with its instrument and
// unit, and no other.
func TestReadmeListsEveryMetric(t *testing.T) {
	got := collectAll(t)
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `(rdmagrpc\\.[a-z._]+)` \\| ([a-z -]+) \\| `([^`]+)` \\|")
	listed := map[string]bool{}
	for _, m := range row.FindAllStringSubmatch(string(b), -1) {
		name, kind, unit := m[1], m[2], m[3]
		listed[name] = true
		want, ok := got[name]
		if !ok {
			t.Errorf("README lists %s, which is not exported", name)
			continue
		}
		if !strings.HasSuffix(kind, want[0]) || unit != want[1] {
			t.Errorf("README: %s is a %s in %s; exported: %s in %s", name, kind, unit, want[0], want[1])
		}
	}
	for name := range got {
		if !listed[name] {
			t.Errorf("README's table of metrics lacks %s", name)
		}
	}
}
