package main

import (
	"bytes"
	"io"
	"sync"
)

// prefixWriter labels each line, so the two guests of a pair can share a
// terminal. Both guests write through the same os.Stdout, hence the lock.
type prefixWriter struct {
	prefix string
	w      io.Writer
	bol    bool
	begun  bool
}

var outMu sync.Mutex

func (p *prefixWriter) Write(b []byte) (int, error) {
	if p.prefix == "" {
		return p.w.Write(b)
	}
	outMu.Lock()
	defer outMu.Unlock()
	if !p.begun {
		p.begun, p.bol = true, true
	}
	var buf bytes.Buffer
	for _, c := range b {
		if p.bol {
			buf.WriteString(p.prefix)
			p.bol = false
		}
		buf.WriteByte(c)
		if c == '\n' {
			p.bol = true
		}
	}
	if _, err := p.w.Write(buf.Bytes()); err != nil {
		return 0, err
	}
	return len(b), nil
}
