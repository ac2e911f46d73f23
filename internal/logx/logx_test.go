package logx

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
)

func TestFromEnv(t *testing.T) {
	for _, tc := range []struct {
		env   string
		debug bool // enabled at debug level
		info  bool
	}{
		{"", false, false},
		{"nonsense", false, false},
		{"debug", true, true},
		{"DEBUG", true, true},
		{"info", false, true},
		{"warn", false, false},
	} {
		l := fromEnv(tc.env)
		ctx := context.Background()
		if got := l.Enabled(ctx, slog.LevelDebug); got != tc.debug {
			t.Errorf("RDMAGRPC_LOG=%q: debug enabled = %v, want %v", tc.env, got, tc.debug)
		}
		if got := l.Enabled(ctx, slog.LevelInfo); got != tc.info {
			t.Errorf("RDMAGRPC_LOG=%q: info enabled = %v, want %v", tc.env, got, tc.info)
		}
	}
}

func TestSet(t *testing.T) {
	defer Set(nil)
	var buf bytes.Buffer
	Set(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	L().Debug("hello", "k", 1)
	if !strings.Contains(buf.String(), "msg=hello k=1") {
		t.Fatalf("the set logger got %q", buf.String())
	}
	Set(nil)
	if L().Enabled(context.Background(), slog.LevelError) {
		t.Fatal("Set(nil) did not restore the discarding logger")
	}
}

// Warn reaches standard error when no logger was set, and the logger
// otherwise.
func TestWarn(t *testing.T) {
	defer Set(nil)
	var errOut bytes.Buffer
	real := stderr
	stderr = &errOut
	defer func() { stderr = real }()
	Set(nil)
	Warn("a setting is misspelled", "name", "RDMAGRPC_PROVDER")
	if !strings.Contains(errOut.String(), "level=WARN") || !strings.Contains(errOut.String(), "name=RDMAGRPC_PROVDER") {
		t.Fatalf("with the default logger, stderr got %q", errOut.String())
	}
	errOut.Reset()
	var buf bytes.Buffer
	Set(slog.New(slog.NewTextHandler(&buf, nil)))
	Warn("a setting is misspelled")
	if errOut.Len() != 0 || !strings.Contains(buf.String(), "a setting is misspelled") {
		t.Fatalf("with a logger set: stderr %q, logger %q", errOut.String(), buf.String())
	}
}
