package conn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/rdmagrpc/rdmagrpc/internal/logx"
	"github.com/rdmagrpc/rdmagrpc/internal/settings"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Devices are opened once per provider and shared by every connection of
// the process, as one ibv_context is.
var (
	devMu   sync.Mutex
	devices = map[string]transport.Device{}
)

// verbsLinked reports whether the program imported transport/verbs; tests
// replace it to play a program that did not.
var verbsLinked = func() bool { return transport.Registered("verbs") }

// openDevice is device; tests replace it to play a broken device.
var openDevice = device

func device(name string) (transport.Device, error) {
	devMu.Lock()
	defer devMu.Unlock()
	if d, ok := devices[name]; ok {
		return d, nil
	}
	p, err := transport.Get(name)
	if err != nil {
		return nil, err
	}
	d, err := p.Open("")
	if err != nil {
		return nil, fmt.Errorf("conn: open %s device: %w", name, err)
	}
	devices[name] = d
	return d, nil
}

// ErrNoProvider is what Listen and Dial wrap when the program imported
// no provider that can serve: providers register on import, as
// database/sql drivers do, so that conn depends on none of them.
var ErrNoProvider = errors.New(`conn: no transport provider in this program: import _ "github.com/rdmagrpc/rdmagrpc/transport/shm" (processes of this host) and _ "github.com/rdmagrpc/rdmagrpc/transport/verbs" (RDMA devices)`)

// ErrBadSetting is what Listen and Dial wrap when an RDMAGRPC_*
// environment variable has a value that cannot be used; the error names
// the variable, the value and what is accepted.
var ErrBadSetting = transport.ErrBadSetting

// settingsCheck holds the outcome of checkSettings, once per process.
var settingsCheck struct {
	sync.Mutex
	done bool
	err  error
}

// checkSettings checks the RDMAGRPC_* settings at the first Listen or
// Dial, whatever the provider: a bad value is the error of every Listen
// and Dial, and a name that is no setting (a misspelling) is logged once,
// visibly even with no logger set (logx.Warn).
func checkSettings() error {
	settingsCheck.Lock()
	defer settingsCheck.Unlock()
	if !settingsCheck.done {
		ps := settings.Check(nil)
		for _, p := range ps {
			if p.Warning {
				logx.Warn("rdmagrpc: "+p.String(), "name", p.Name)
			}
		}
		settingsCheck.err = badSettings(ps)
		settingsCheck.done = true
	}
	return settingsCheck.err
}

func badSettings(ps []settings.Problem) error {
	if err := settings.Err(ps); err != nil {
		return fmt.Errorf("conn: bad setting: %w", err)
	}
	return nil
}

// ProviderChoice says which provider Listen and Dial would use on this
// host without WithProvider, and why, or the error they would return. It
// checks the settings (as they are now) and opens the provider's device
// as they do (devices are shared by the process and stay open), but
// connects nothing.
func ProviderChoice() (name, reason string, err error) {
	if err := badSettings(settings.Check(nil)); err != nil {
		return "", "", err
	}
	o := defaults()
	name, _, err = chooseProvider(&o)
	return name, o.providerWhy, err
}

// pickProvider checks the settings (once), then chooses.
func pickProvider(o *options) (string, transport.Device, error) {
	if err := checkSettings(); err != nil {
		return "", nil, err
	}
	return chooseProvider(o)
}

// chooseProvider: the option, else RDMAGRPC_PROVIDER, else verbs when a
// usable device exists (and transport/verbs was imported), else shm (if
// transport/shm was imported: ErrNoProvider otherwise). Only
// the absence of RDMA selects shm: a device that is here but fails to open
// (permissions, memlock, a port down) is the caller's error, because shm
// reaches local processes only and would quietly turn every remote dial
// into a refusal.
func chooseProvider(o *options) (string, transport.Device, error) {
	name, why := o.provider, "option"
	if name != "" {
		if strings.EqualFold(name, "tcp") {
			return "", nil, fmt.Errorf("conn: WithProvider(%q): %s", name, settings.NotTCP)
		}
		if l := strings.ToLower(name); !transport.Registered(name) && transport.Registered(l) {
			name = l
		}
	} else {
		env, err := settings.ProviderName()
		if err != nil {
			return "", nil, fmt.Errorf("conn: bad setting: %w", err)
		}
		name, why = env, settings.Provider
	}
	if name == "" {
		if !verbsLinked() && !transport.Registered("shm") {
			return "", nil, ErrNoProvider
		}
		name, why = "shm", `no RDMA provider in this program (import _ "github.com/rdmagrpc/rdmagrpc/transport/verbs" to use RDMA devices)`
		if verbsLinked() {
			_, err := openDevice("verbs")
			switch {
			case err == nil:
				name, why = "verbs", "RDMA device found"
			case errors.Is(err, transport.ErrUnusable) || !errors.Is(err, transport.ErrUnavailable):
				return "", nil, fmt.Errorf("%w (set RDMAGRPC_PROVIDER=shm to use shared memory between local processes instead)", err)
			case !transport.Registered("shm"):
				return "", nil, fmt.Errorf("%w (and no RDMA device: %w)", ErrNoProvider, err)
			default:
				why = err.Error()
			}
		}
	}
	d, err := openDevice(name)
	if err != nil {
		return "", nil, err
	}
	o.providerWhy = why
	o.pinned = why == "option" || why == settings.Provider
	if l := o.log(); l.Enabled(context.Background(), slog.LevelDebug) {
		l.Debug("rdmagrpc: transport provider chosen", "provider", name, "why", why, "device", d.Name())
	}
	return name, d, nil
}
