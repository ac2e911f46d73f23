// Package shm is a software RDMA provider with the semantics of the
// transport interface (verbs + rdma_cm) between processes of one host and
// within one process.
//
// Registered memory is memfd-backed. A requester performs each work request
// itself at post time, like a NIC acting for both sides: it checks the
// responder's memory-region table (shared memory), copies directly into or
// out of the responder's memfd mappings, consumes the responder's posted
// receives from a shared ring and writes the receive completion there. The
// unix socket of a connection carries only set-up, memfd hand-over, error
// notes and disconnect, and its hang-up is how a vanished peer is noticed.
//
// Isolation: a device has a child device per peer process (peers.go), with
// its own MR table and arenas, so that two peer processes never map each
// other's memory; a listener admits only processes of its own user unless
// conn.WithPeerCheck decides otherwise (the kernel's SO_PEERCRED), and
// binds only addresses of this host.
package shm

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// ProviderName is the name the provider registers under.
const ProviderName = "shm"

func init() { transport.Register(provider{}) }

type provider struct{}

func (provider) Name() string { return ProviderName }

func (provider) Open(name string) (transport.Device, error) {
	if name == "" {
		name = "shm0"
	}
	return openDevice(name)
}

// Device limits. They are generous software limits chosen to resemble a
// real HCA so that code tuned here does not break on hardware, but for
// MaxInline: here the requester is the CPU, and an inline send is one copy
// straight from the caller's memory into the responder's, where a NIC
// would need a copy into registered staging memory first.
var deviceAttr = transport.DeviceAttr{
	MaxQPWR:     16384,
	MaxSGE:      32,
	MaxCQE:      1 << 20,
	MaxInline:   1 << 20,
	MaxMRSize:   1 << 40,
	MaxQPRdAtom: 16,
}

type device struct {
	name      string
	mrs       *mrTableOwner
	data, ctl *pool // where its memory, QP rings and CQ headers are carved

	// Per peer process (peers.go): a device opened by Open has one
	// child device per peer process its connections go to, with an MR
	// table and arenas of its own, so that what a peer process is handed
	// (the table, the arenas it maps) holds only its own connections'
	// data. parent is nil for a device opened by Open; peer names the
	// child's peer process.
	parent *device
	peer   peerID
	born   time.Time    // a child's creation
	pds    atomic.Int32 // PDs open, for dropping an unused child
	cqs    atomic.Int32

	mu       sync.Mutex
	closed   bool
	children map[peerID]*device

	// kept are peer arenas a QP of this device had handed to it (peer.go,
	// peerMem), kept mapped so that the next QP to the same peer process
	// takes another reference instead of asking for the memfd again: that
	// request was a cross-process round trip in the first write of every
	// connection, and of every new connection after the last one closed.
	arenaMu sync.Mutex
	kept    []kept[arenaKey]
	// keptCtl are the mappings of the peer's MR table and control arenas
	// (peer.go, keepCtl), kept for the next QP to the same peer process.
	keptCtl []kept[fileKey]
	// peerHolds are the inodes of this device's control files its peer
	// process said, in its last accept, it keeps mapped (peer.go).
	peerHolds []uint64
}

var pdIDs atomic.Uint32

func openDevice(name string) (*device, error) {
	t, err := newMRTable()
	if err != nil {
		return nil, fmt.Errorf("shm: open device %s: %w", name, err)
	}
	return &device{name: name, mrs: t, data: dataPool, ctl: ctlPool}, nil
}

func (d *device) Name() string               { return d.name }
func (d *device) Provider() string           { return ProviderName }
func (d *device) Attr() transport.DeviceAttr { return deviceAttr }

func (d *device) AllocMemory(size int) ([]byte, error) { return allocMemory(d.data, size) }
func (d *device) FreeMemory(mem []byte) error          { return freeMemory(mem) }

func (d *device) AllocPD() (transport.PD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("shm: alloc PD: device %s closed", d.name)
	}
	p := &pd{dev: d, id: pdIDs.Add(1)}
	pdRegistry.add(p)
	d.pds.Add(1)
	return p, nil
}

func (d *device) CreateCQ(entries int) (transport.CQ, error) {
	if entries <= 0 || entries > deviceAttr.MaxCQE {
		return nil, fmt.Errorf("shm: create CQ of %d entries: %w (1..%d)", entries, transport.ErrInvalidWR, deviceAttr.MaxCQE)
	}
	c, err := newCQ(d, entries)
	if err == nil {
		d.cqs.Add(1)
	}
	return c, err
}

// Close releases the device's MR table. MRs and QPs should be closed first,
// as with ibv_close_device; peers keep their own mapping of the table.
func (d *device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var errs []error
	for id, c := range d.children {
		// A child still in use keeps its table and arenas: its peers map
		// them (as with the parent's, which close releases regardless).
		if c.idle() {
			errs = append(errs, c.drop())
			delete(d.children, id)
		}
	}
	d.releaseArenas()
	if err := d.mrs.close(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("shm: close device %s: %w", d.name, err)
	}
	return nil
}
