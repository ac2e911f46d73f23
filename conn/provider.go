package conn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"github.com/rdmagrpc/rdmagrpc/transport"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm" // the default where no RDMA device exists
)

// Devices are opened once per provider and shared by every connection of
// the process, as one ibv_context is.
var (
	devMu   sync.Mutex
	devices = map[string]transport.Device{}
)

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

// pickProvider: the option, else RDMAGRPC_PROVIDER, else verbs when a
// usable device exists (and transport/verbs was imported), else shm. Only
// the absence of RDMA selects shm: a device that is here but fails to open
// (permissions, memlock, a port down) is the caller's error, because shm
// reaches local processes only and would quietly turn every remote dial
// into a refusal.
func pickProvider(o *options) (string, transport.Device, error) {
	name, why := o.provider, "option"
	if name == "" {
		name, why = os.Getenv("RDMAGRPC_PROVIDER"), "RDMAGRPC_PROVIDER"
	}
	if name == "" {
		name, why = "shm", "no RDMA device"
		if transport.Registered("verbs") {
			_, err := openDevice("verbs")
			switch {
			case err == nil:
				name, why = "verbs", "RDMA device found"
			case errors.Is(err, transport.ErrUnusable) || !errors.Is(err, transport.ErrUnavailable):
				return "", nil, fmt.Errorf("%w (set RDMAGRPC_PROVIDER=shm to use shared memory between local processes instead)", err)
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
	if l := o.log(); l.Enabled(context.Background(), slog.LevelDebug) {
		l.Debug("rdmagrpc: transport provider chosen", "provider", name, "why", why, "device", d.Name())
	}
	return name, d, nil
}
