// Package logx holds rdmagrpc's process-wide logger. A library must not
// write to a program's output unasked, so the default discards everything;
// conn.SetLogger replaces it, and RDMAGRPC_LOG=debug|info|warn|error sends
// records at that level and above to standard error (the way grpc-go reads
// GRPC_GO_LOG_SEVERITY_LEVEL). Warn is the exception, for what the
// operator asked for and got wrong.
package logx

import (
	"io"
	"log/slog"
	"os"
	"sync/atomic"

	"github.com/rdmagrpc/rdmagrpc/internal/settings"
)

// Env is the environment variable read once at start-up.
const Env = settings.Log

var (
	current atomic.Pointer[slog.Logger]
	// discard is the default logger: Warn tells it from one set.
	discard = slog.New(slog.DiscardHandler)
	// stderr is where Warn writes when no logger was set (tests replace it).
	stderr io.Writer = os.Stderr
)

func init() { current.Store(fromEnv(os.Getenv(Env))) }

// fromEnv is the logger RDMAGRPC_LOG asks for: stderr at the named level,
// else (unset, empty or bad) the discarding default; a bad value is
// conn's error at the first Listen or Dial (settings.Check).
func fromEnv(v string) *slog.Logger {
	level, err := settings.ParseLogLevel(v)
	if v == "" || err != nil {
		return discard
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// L is the current logger, never nil.
func L() *slog.Logger { return current.Load() }

// Set replaces the logger; nil restores the discarding default.
func Set(l *slog.Logger) {
	if l == nil {
		l = discard
	}
	current.Store(l)
}

// Warn logs a warning the operator must see even when nothing asked for
// logs: to the logger set (conn.SetLogger, RDMAGRPC_LOG) when there is
// one, at its level, else to standard error. It is for a mistake in what
// the operator asked for, such as a misspelled setting, that would
// otherwise be silently ignored; not for what happens at run time.
func Warn(msg string, args ...any) {
	l := L()
	if l == discard {
		l = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	l.Warn(msg, args...)
}
