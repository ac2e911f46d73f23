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

// printSlowestRPC prints, from the export, the slowest client RPC span
// that carries an enlargement event (conn.StatsHandler's): what an operator
// sees in a trace viewer of the RPC that paid for an enlargement, with its
// transport events and the spans its links lead to. The slowest RPC with
// any transport event, and the slowest of all, are named too when they are
// other ones: on a busy machine a scheduling hiccup can outlast the
// enlargement.
func printSlowestRPC(spans []exportedSpan) {
	byID := map[string]exportedSpan{}
	var enlarged, eventful, slowest *exportedSpan
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
		if hasEvent(s, "rdmagrpc.") && longer(eventful, s) {
			eventful = &spans[i]
		}
		if hasEvent(s, "rdmagrpc.enlargement") && longer(enlarged, s) {
			enlarged = &spans[i]
		}
	}
	if eventful == nil {
		fmt.Println("  no client RPC span carries transport events")
		return
	}
	if enlarged == nil {
		fmt.Println("  no client RPC span carries an enlargement event")
		enlarged = eventful
	} else {
		fmt.Print("  the slowest client RPC that paid for an enlargement")
	}
	fmt.Printf(", from the exported trace: %s, %v, trace %s span %s\n",
		enlarged.Name, duration(*enlarged), enlarged.SpanContext.TraceID, enlarged.SpanContext.SpanID)
	printRPC(*enlarged, byID)
	if eventful != enlarged {
		fmt.Printf("  the slowest client RPC with any transport event: %v, span %s\n", duration(*eventful), eventful.SpanContext.SpanID)
		printRPC(*eventful, byID)
	}
	if slowest != eventful {
		fmt.Printf("  (the slowest of all, %v, span %s, had none: nothing of the transport's ended while it ran)\n",
			duration(*slowest), slowest.SpanContext.SpanID)
	}
}

func duration(s exportedSpan) time.Duration {
	return s.EndTime.Sub(s.StartTime).Round(time.Microsecond)
}

// printRPC prints one RPC span's transport events and links.
func printRPC(s exportedSpan, byID map[string]exportedSpan) {
	fmt.Printf("    on rdmagrpc conn %v (%v), phase %v at its start\n",
		s.attr("rdmagrpc.connection.id"), s.attr("rdmagrpc.provider"), s.attr("rdmagrpc.buffer.phase"))
	for _, e := range s.Events {
		if !strings.HasPrefix(e.Name, "rdmagrpc.") {
			continue // otelgrpc's message events
		}
		fmt.Printf("    +%-10v %s", e.Time.Sub(s.StartTime).Round(time.Microsecond), e.Name)
		for _, a := range e.Attributes {
			fmt.Printf("  %s=%v", a.Key[len("rdmagrpc."):], a.Value.Value)
		}
		fmt.Println()
	}
	for _, l := range s.Links {
		if t, ok := byID[l.SpanContext.SpanID]; ok {
			fmt.Printf("    linked: %s, %v, outcome %v\n", t.Name, duration(t), t.attr("rdmagrpc.enlargement.outcome"))
		}
	}
}

// hasEvent says whether s has an event whose name starts with prefix.
func hasEvent(s exportedSpan, prefix string) bool {
	return slices.ContainsFunc(s.Events, func(e exportedEvent) bool { return strings.HasPrefix(e.Name, prefix) })
}
