// Package protodoc reads the test vectors of doc/protocol.md, for the
// tests that hold the encoders and decoders to that document.
//
// A vector is two fenced blocks of the document with the same name:
//
//	```hex vector:NAME
//	0a0b 0c   # bytes in hex; spaces and #-comments are ignored
//	```
//
//	```fields vector:NAME
//	name = 12          # decimal or 0x-hex, up to 64 bits
//	text = "quoted"    # a Go-quoted string
//	raw = hex:0a0b     # bytes
//	```
package protodoc

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// Vector is one test vector: its bytes and its decoded fields.
type Vector struct {
	Name   string
	Bytes  []byte
	Line   int // of its hex block
	fields map[string]string
	used   map[string]bool
}

// Doc is the path of doc/protocol.md, found from the working directory up
// to the module's root.
func Doc() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(dir, "doc", "protocol.md"), nil
		}
		up := filepath.Dir(dir)
		if up == dir {
			return "", fmt.Errorf("protodoc: no go.mod above the working directory")
		}
		dir = up
	}
}

// Load reads every vector of doc/protocol.md, failing t on a malformed one.
func Load(t testing.TB) map[string]*Vector {
	t.Helper()
	path, err := Doc()
	if err != nil {
		// A test binary run apart from the source tree (the rxe guest
		// carries binaries only) has no document to check.
		t.Skipf("%v: doc/protocol.md is read from the source tree, which is not here", err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	vs, err := Parse(bufio.NewScanner(f))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return vs
}

// Parse reads the vectors of a document.
func Parse(sc *bufio.Scanner) (map[string]*Vector, error) {
	vs := map[string]*Vector{}
	get := func(name string) *Vector {
		v := vs[name]
		if v == nil {
			v = &Vector{Name: name}
			vs[name] = v
		}
		return v
	}
	var (
		kind, name string
		start      int
		body       []string
	)
	for line := 1; sc.Scan(); line++ {
		l := sc.Text()
		if kind == "" {
			info, ok := strings.CutPrefix(l, "```")
			if !ok {
				continue
			}
			k, n, ok := strings.Cut(info, " vector:")
			if !ok || (k != "hex" && k != "fields") {
				continue
			}
			kind, name, start, body = k, strings.TrimSpace(n), line, nil
			continue
		}
		if strings.TrimSpace(l) != "```" {
			body = append(body, l)
			continue
		}
		v := get(name)
		switch kind {
		case "hex":
			if v.Bytes != nil {
				return nil, fmt.Errorf("line %d: second hex block of vector %s", start, name)
			}
			var h strings.Builder
			for _, b := range body {
				b, _, _ = strings.Cut(b, "#")
				h.WriteString(strings.Join(strings.Fields(b), ""))
			}
			bs, err := hex.DecodeString(h.String())
			if err != nil {
				return nil, fmt.Errorf("line %d: vector %s: %v", start, name, err)
			}
			v.Bytes, v.Line = bs, start
		case "fields":
			if v.fields != nil {
				return nil, fmt.Errorf("line %d: second fields block of vector %s", start, name)
			}
			v.fields, v.used = map[string]string{}, map[string]bool{}
			for i, b := range body {
				b = strings.TrimSpace(b)
				if b == "" || strings.HasPrefix(b, "#") {
					continue
				}
				k, val, ok := strings.Cut(b, "=")
				if !ok {
					return nil, fmt.Errorf("line %d: vector %s: %q is not name = value", start+1+i, name, b)
				}
				k, val = strings.TrimSpace(k), strings.TrimSpace(val)
				if _, dup := v.fields[k]; dup {
					return nil, fmt.Errorf("line %d: vector %s: field %s twice", start+1+i, name, k)
				}
				v.fields[k] = val
			}
		}
		kind = ""
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if kind != "" {
		return nil, fmt.Errorf("line %d: unterminated block of vector %s", start, name)
	}
	for _, v := range vs {
		if v.Bytes == nil || v.fields == nil {
			return nil, fmt.Errorf("vector %s: needs both a hex and a fields block", v.Name)
		}
	}
	return vs, nil
}

// Names returns the vectors' names, sorted, that start with prefix.
func Names(vs map[string]*Vector, prefix string) []string {
	var ns []string
	for n := range vs {
		if strings.HasPrefix(n, prefix) {
			ns = append(ns, n)
		}
	}
	slices.Sort(ns)
	return ns
}

// Has reports whether the vector lists field k.
func (v *Vector) Has(k string) bool {
	_, ok := v.fields[k]
	return ok
}

func (v *Vector) take(t testing.TB, k string) (string, bool) {
	t.Helper()
	s, ok := v.fields[k]
	if ok {
		v.used[k] = true
	}
	return s, ok
}

// Uint is numeric field k; a field the vector does not list is 0.
func (v *Vector) Uint(t testing.TB, k string) uint64 {
	t.Helper()
	s, ok := v.take(t, k)
	if !ok {
		return 0
	}
	n, err := strconv.ParseUint(s, 0, 64)
	if err != nil {
		t.Fatalf("vector %s: field %s = %s: %v", v.Name, k, s, err)
	}
	return n
}

// String is text field k, which the vector must list.
func (v *Vector) String(t testing.TB, k string) string {
	t.Helper()
	s, ok := v.take(t, k)
	if !ok {
		t.Fatalf("vector %s: no field %s", v.Name, k)
	}
	u, err := strconv.Unquote(s)
	if err != nil {
		t.Fatalf("vector %s: field %s = %s: not a quoted string: %v", v.Name, k, s, err)
	}
	return u
}

// Raw is byte field k (hex:…, or a quoted string), which the vector must
// list.
func (v *Vector) Raw(t testing.TB, k string) []byte {
	t.Helper()
	s, ok := v.fields[k]
	if !ok {
		t.Fatalf("vector %s: no field %s", v.Name, k)
	}
	if h, ok := strings.CutPrefix(s, "hex:"); ok {
		v.used[k] = true
		b, err := hex.DecodeString(h)
		if err != nil {
			t.Fatalf("vector %s: field %s: %v", v.Name, k, err)
		}
		return b
	}
	return []byte(v.String(t, k))
}

// Done fails t if the vector lists a field the test did not read: a field
// the document names that the code does not have.
func (v *Vector) Done(t testing.TB) {
	t.Helper()
	for k := range v.fields {
		if !v.used[k] {
			t.Errorf("vector %s (doc line %d): field %s is not checked against the code", v.Name, v.Line, k)
		}
	}
}
