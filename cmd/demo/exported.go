package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"
)

// exportedSpan is a span as the stdout trace exporter wrote it, as far as
// the demo (and its test) read it back.
type exportedSpan struct {
	Name        string
	SpanKind    int
	SpanContext struct{ TraceID, SpanID string }
	Parent      struct{ TraceID, SpanID string }
	StartTime   time.Time
	EndTime     time.Time
	Attributes  []exportedAttr
	Events      []exportedEvent
	Links       []struct {
		SpanContext struct{ TraceID, SpanID string }
	}
}

type exportedEvent struct {
	Name       string
	Time       time.Time
	Attributes []exportedAttr
}

type exportedAttr struct {
	Key   string
	Value struct{ Value any }
}

// Span kinds as the exporter numbers them (trace.SpanKind).
const (
	kindServer = 2
	kindClient = 3
)

func (s exportedSpan) attr(k string) any { return attrValue(s.Attributes, k) }

func attrValue(as []exportedAttr, k string) any {
	for _, a := range as {
		if a.Key == k {
			return a.Value.Value
		}
	}
	return nil
}

// readExported reads every span of an exported traces.json.
func readExported(path string) ([]exportedSpan, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var spans []exportedSpan
	for dec := json.NewDecoder(f); ; {
		var s exportedSpan
		if err := dec.Decode(&s); err == io.EOF {
			return spans, nil
		} else if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		spans = append(spans, s)
	}
}

// printSlowestRPC prints the slowest client RPC span of the export that
// carries transport events (conn.StatsHandler's), with them and the spans
// its links lead to: what an operator sees of a slow RPC in a trace
// viewer. The slowest of all is named too when it is another one.
func printSlowestRPC(spans []exportedSpan) {
	byID := map[string]exportedSpan{}
	var slow, slowest *exportedSpan
	longer := func(a *exportedSpan, b exportedSpan) bool {
		return a == nil || b.EndTime.Sub(b.StartTime) > a.EndTime.Sub(a.StartTime)
	}
	for i, s := range spans {
		byID[s.SpanContext.SpanID] = s
		if s.SpanKind != kindClient {
			continue
		}
		if longer(slowest, s) {
			slowest = &spans[i]
		}
		if hasTransportEvents(s) && longer(slow, s) {
			slow = &spans[i]
		}
	}
	if slow == nil {
		fmt.Println("  no client RPC span carries transport events")
		return
	}
	fmt.Printf("  the slowest client RPC with transport events, from the exported trace: %s, %v, trace %s span %s\n",
		slow.Name, slow.EndTime.Sub(slow.StartTime).Round(time.Microsecond), slow.SpanContext.TraceID, slow.SpanContext.SpanID)
	if slowest != slow {
		fmt.Printf("    (the slowest of all, %v, span %s, had none: nothing of the transport's ended while it ran)\n",
			slowest.EndTime.Sub(slowest.StartTime).Round(time.Microsecond), slowest.SpanContext.SpanID)
	}
	fmt.Printf("    on rdmagrpc connection %v (%v), phase %v at its start\n",
		slow.attr("rdmagrpc.connection.id"), slow.attr("rdmagrpc.provider"), slow.attr("rdmagrpc.buffer.phase"))
	for _, e := range slow.Events {
		if !strings.HasPrefix(e.Name, "rdmagrpc.") {
			continue // otelgrpc's message events
		}
		fmt.Printf("    +%-10v %s", e.Time.Sub(slow.StartTime).Round(time.Microsecond), e.Name)
		for _, a := range e.Attributes {
			fmt.Printf("  %s=%v", a.Key[len("rdmagrpc."):], a.Value.Value)
		}
		fmt.Println()
	}
	for _, l := range slow.Links {
		if t, ok := byID[l.SpanContext.SpanID]; ok {
			fmt.Printf("    linked: %s, %v, outcome %v\n", t.Name, t.EndTime.Sub(t.StartTime).Round(time.Microsecond), t.attr("rdmagrpc.enlargement.outcome"))
		}
	}
}

func hasTransportEvents(s exportedSpan) bool {
	return slices.ContainsFunc(s.Events, func(e exportedEvent) bool { return strings.HasPrefix(e.Name, "rdmagrpc.") })
}
