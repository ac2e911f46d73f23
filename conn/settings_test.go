package conn

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// resetSettingsCheck makes the next Listen or Dial check the settings
// again, as the first of a process does.
func resetSettingsCheck(t *testing.T) {
	settingsCheck.Lock()
	settingsCheck.done, settingsCheck.err = false, nil
	settingsCheck.Unlock()
	t.Cleanup(func() {
		settingsCheck.Lock()
		settingsCheck.done, settingsCheck.err = false, nil
		settingsCheck.Unlock()
	})
}

// A bad value of any setting, even one of a provider not chosen, makes
// Listen and Dial fail with ErrBadSetting, naming it.
func TestBadSettingFailsListenAndDial(t *testing.T) {
	for _, kv := range [][2]string{
		{"RDMAGRPC_REG_BUDGET", "garbage"},
		{"RDMAGRPC_LOG", "verbose"},
		{"RDMAGRPC_VERBS_TC", "abc"},
		{"RDMAGRPC_PROVIDER", "bogus"},
		{"RDMAGRPC_PROVIDER", "tcp"},
	} {
		t.Run(kv[0]+"="+kv[1], func(t *testing.T) {
			t.Setenv("RDMAGRPC_PROVIDER", "")
			t.Setenv(kv[0], kv[1])
			resetSettingsCheck(t)
			l, err := Listen(context.Background(), "127.0.0.1:0", WithProvider("shm"))
			if err == nil {
				l.Close()
			}
			if !errors.Is(err, ErrBadSetting) || !strings.Contains(err.Error(), kv[0]+`="`+kv[1]+`"`) {
				t.Fatalf("Listen: %v, want an ErrBadSetting naming %s=%q", err, kv[0], kv[1])
			}
			for _, dial := range []func() error{
				func() error {
					c, err := Dial(context.Background(), "127.0.0.1:1")
					if err == nil {
						c.Close()
					}
					return err
				},
				func() error {
					c, err := Dialer()(context.Background(), "127.0.0.1:1")
					if err == nil {
						c.Close()
					}
					return err
				},
			} {
				if err := dial(); !errors.Is(err, ErrBadSetting) {
					t.Fatalf("Dial: %v, want ErrBadSetting", err)
				}
			}
			if _, _, err := ProviderChoice(); !errors.Is(err, ErrBadSetting) {
				t.Fatalf("ProviderChoice: %v, want ErrBadSetting", err)
			}
		})
	}
}

// A name that is no setting is logged once, as a warning, with the
// setting it was probably meant to be; Listen goes on.
func TestUnknownSettingWarnedOnce(t *testing.T) {
	var mu sync.Mutex
	var buf bytes.Buffer
	SetLogger(slog.New(slog.NewTextHandler(&lockedWriter{mu: &mu, w: &buf}, nil)))
	t.Cleanup(func() { SetLogger(nil) })
	t.Setenv("RDMAGRPC_PROVDER", "shm")
	resetSettingsCheck(t)
	for range 2 {
		l, err := Listen(context.Background(), "127.0.0.1:0", WithProvider("shm"))
		if err != nil {
			t.Fatal(err)
		}
		l.Close()
	}
	mu.Lock()
	out := buf.String()
	mu.Unlock()
	if n := strings.Count(out, "RDMAGRPC_PROVDER is not an rdmagrpc setting"); n != 1 || !strings.Contains(out, "level=WARN") || !strings.Contains(out, "did you mean RDMAGRPC_PROVIDER?") {
		t.Fatalf("logged %d times, want once, a warning with the likely name:\n%s", n, out)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// Provider names are case-insensitive, in the setting and the option;
// tcp is refused with the way to it.
func TestProviderNameCase(t *testing.T) {
	t.Setenv("RDMAGRPC_PROVIDER", "SHM")
	resetSettingsCheck(t)
	name, why, err := ProviderChoice()
	if name != "shm" || why != "RDMAGRPC_PROVIDER" || err != nil {
		t.Fatalf("ProviderChoice with RDMAGRPC_PROVIDER=SHM: %q, %q, %v", name, why, err)
	}
	a, _ := conns(t, WithProvider("Shm"))
	if p := a.Stats().Provider; p != "shm" {
		t.Fatalf("WithProvider(\"Shm\"): provider %q", p)
	}
	t.Setenv("RDMAGRPC_PROVIDER", "")
	if _, err := Listen(context.Background(), "127.0.0.1:0", WithProvider("tcp")); err == nil || !strings.Contains(err.Error(), "tcp is not a provider") {
		t.Fatalf("WithProvider(\"tcp\"): %v", err)
	}
}
