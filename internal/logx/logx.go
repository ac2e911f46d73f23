// Package logx holds rdmagrpc's process-wide logger. A library must not
// write to a program's output unasked, so the default discards everything;
// conn.SetLogger replaces it, and RDMAGRPC_LOG=debug|info|warn|error sends
// records at that level and above to standard error (the way grpc-go reads
// GRPC_GO_LOG_SEVERITY_LEVEL).
package logx

import (
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
)

// Env is the environment variable read once at start-up.
const Env = "RDMAGRPC_LOG"

var current atomic.Pointer[slog.Logger]

func init() { current.Store(fromEnv(os.Getenv(Env))) }

// fromEnv is the logger RDMAGRPC_LOG asks for: stderr at the named level,
// else (unset, empty or unknown) one that discards.
func fromEnv(v string) *slog.Logger {
	var level slog.Level
	if v == "" || level.UnmarshalText([]byte(strings.TrimSpace(v))) != nil {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// L is the current logger, never nil.
func L() *slog.Logger { return current.Load() }

// Set replaces the logger; nil restores the discarding default.
func Set(l *slog.Logger) {
	if l == nil {
		l = slog.New(slog.DiscardHandler)
	}
	current.Store(l)
}
