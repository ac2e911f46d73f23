package conn

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bufpool"
	"github.com/rdmagrpc/rdmagrpc/transport"
)

// Kits. A connection's protection domain and the pool that registered its
// small rings (8 KiB on each side) outlive it, for the next connection
// on the same device: that one's dial or accept then neither allocates a
// PD nor registers memory, its rings come from the pool's free lists.
// rdma_cm and the providers' own set-up stay; what a kit saves is the PD
// and the two registrations of every connection (on a NIC a registration
// is a command to its firmware; doc/benchmarks.md has what it saves).
//
// Only a connection whose queue pair is destroyed leaves its kit: its
// peer's queue pair was connected to that one and reaches the rings no
// more. The next connection's peer gets the rings' keys over a queue pair
// of its own, as it would get new ones; on shm a kit is the peer
// process's device's (one per peer process), so it never serves a
// connection to another process. Kits are few (maxKits) and short-lived
// (kitLife): the registered memory of connections that are gone is not
// kept for long, and a budget under pressure trims their free lists like
// any other pool's.
type kit struct {
	dev  transport.Device // the underlying device (transport.DeviceWrapper)
	pd   transport.PD
	pool *bufpool.Pool
	kept time.Time
}

const (
	maxKits = 64
	kitLife = 10 * time.Second
)

var kits struct {
	sync.Mutex
	list  []kit // oldest first
	sweep *time.Timer
	armed bool
}

func underlying(dev transport.Device) transport.Device {
	for {
		w, ok := dev.(transport.DeviceWrapper)
		if !ok {
			return dev
		}
		dev = w.Unwrap()
	}
}

// takeKit returns the newest kit of dev whose pool charges budget (nil:
// bufpool.Default()), or nils.
func takeKit(dev transport.Device, budget *bufpool.Budget) (transport.PD, *bufpool.Pool) {
	dev = underlying(dev)
	budget = cmp.Or(budget, bufpool.Default())
	kits.Lock()
	defer kits.Unlock()
	for i := len(kits.list) - 1; i >= 0; i-- {
		if k := kits.list[i]; k.dev == dev && k.pool.Budget() == budget {
			kits.list = slices.Delete(kits.list, i, i+1)
			return k.pd, k.pool
		}
	}
	return nil, nil
}

// keepKit keeps pd and pool, which holds no buffer any more, for the next
// connection on dev; false when there are maxKits already.
func keepKit(dev transport.Device, pd transport.PD, pool *bufpool.Pool) bool {
	pool.SetOnRegister(nil) // the connection's telemetry is over
	kits.Lock()
	defer kits.Unlock()
	if len(kits.list) >= maxKits {
		return false
	}
	kits.list = append(kits.list, kit{dev: underlying(dev), pd: pd, pool: pool, kept: time.Now()})
	if !kits.armed {
		kits.armed = true
		if kits.sweep == nil {
			kits.sweep = time.AfterFunc(kitLife, sweepKits)
		} else {
			kits.sweep.Reset(kitLife)
		}
	}
	return true
}

// sweepKits closes the kits kept for kitLife, and runs again when the
// oldest left is due.
func sweepKits() {
	now := time.Now()
	kits.Lock()
	n := 0
	for n < len(kits.list) && now.Sub(kits.list[n].kept) >= kitLife {
		n++
	}
	old := slices.Clone(kits.list[:n])
	kits.list = slices.Delete(kits.list, 0, n)
	if len(kits.list) > 0 {
		kits.sweep.Reset(kitLife - now.Sub(kits.list[0].kept))
	} else {
		kits.armed = false
	}
	kits.Unlock()
	for _, k := range old {
		k.close()
	}
}

// ReleaseKits closes now the kits closed connections left for later ones
// (their protection domains and registered small rings, which are
// otherwise closed kitLife after their connection): for a process that
// wants its registered memory back at once, or counts it.
func ReleaseKits() {
	kits.Lock()
	old := kits.list
	kits.list = nil
	kits.Unlock()
	for _, k := range old {
		k.close()
	}
}

func (k kit) close() {
	k.pool.Close()
	k.pd.Close()
}
