package bpf

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// ErrClosed is returned by Read after Close.
var ErrClosed = errors.New("bpf: tracer closed")

// Options configure a Tracer.
type Options struct {
	// PID limits every probe to one process; 0 traces all processes.
	PID int
}

// Tracer owns the loaded BPF programs, their uprobes and the ring buffer
// reader. Attach methods may be called while another goroutine Reads.
type Tracer struct {
	objs       probesObjects
	rd         *ringbuf.Reader
	pid        int
	monoToWall time.Duration
	deadline   time.Time // owned by the reading goroutine

	mu       sync.RWMutex
	probes   []probe
	links    []link.Link
	attached []string
	closed   bool
}

// Open loads the BPF programs. It needs root (CAP_BPF and CAP_PERFMON) and
// a kernel with BPF ring buffers (5.8+) and uprobe attach cookies (5.15+).
func Open(opts Options) (*Tracer, error) {
	if opts.PID < 0 {
		return nil, fmt.Errorf("bpf: negative pid %d", opts.PID)
	}
	// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK.
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("bpf: lift memlock limit: %w", err)
	}
	t := &Tracer{pid: opts.PID}
	if err := loadProbesObjects(&t.objs, nil); err != nil {
		return nil, fmt.Errorf("bpf: load programs: %w", err)
	}
	rd, err := ringbuf.NewReader(t.objs.Events)
	if err != nil {
		t.objs.Close()
		return nil, fmt.Errorf("bpf: open ring buffer: %w", err)
	}
	t.rd = rd
	var mono unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono); err != nil {
		t.Close()
		return nil, fmt.Errorf("bpf: read monotonic clock: %w", err)
	}
	t.monoToWall = time.Duration(time.Now().UnixNano() - mono.Nano())
	return t, nil
}

// Attached lists the functions probed so far, as "path:function".
func (t *Tracer) Attached() []string {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return append([]string(nil), t.attached...)
}

// libibverbsFuncs are the registration entry points probed in
// libibverbs. ibv_reg_mr and ibv_reg_mr_iova are not probed: both call
// ibv_reg_mr_iova2, so probing them too would count every call twice.
var libibverbsFuncs = []struct {
	name  string
	shape probeShape
	kind  Kind
}{
	{"ibv_reg_mr_iova2", shapeIbvRegMR, KindRegister},
	{"ibv_reg_dmabuf_mr", shapeIbvRegDmabuf, KindRegister},
	{"ibv_rereg_mr", shapeIbvReregMR, KindReregister},
	{"ibv_dereg_mr", shapeIbvDeregMR, KindDeregister},
}

// AttachLibibverbs probes the registration functions of the libibverbs
// shared object at path (see FindLibibverbs). It attaches what it can and
// returns the functions it could not attach in the error.
func (t *Tracer) AttachLibibverbs(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("bpf: open %s: %w", path, err)
	}
	defer f.Close()
	ex, err := link.OpenExecutable(path)
	if err != nil {
		return fmt.Errorf("bpf: %w", err)
	}
	var errs []error
	for _, fn := range libibverbsFuncs {
		off, err := defaultVersionOffset(f, fn.name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		id, err := t.addProbe(probe{shape: fn.shape, name: fn.name, kind: fn.kind})
		if err != nil {
			return err
		}
		opts := t.uprobeOpts(off, id, fn.shape)
		entry, err := ex.Uprobe("", t.objs.LibEntry, &opts)
		if err != nil {
			errs = append(errs, fmt.Errorf("uprobe %s: %w", fn.name, err))
			continue
		}
		ret, err := ex.Uretprobe("", t.objs.LibReturn, &opts)
		if err != nil {
			entry.Close()
			errs = append(errs, fmt.Errorf("uretprobe %s: %w", fn.name, err))
			continue
		}
		t.keep(path+":"+fn.name, entry, ret)
	}
	if len(errs) > 0 {
		return fmt.Errorf("bpf: %s: %w", path, errors.Join(errs...))
	}
	return nil
}

// AttachGoFunc probes one Go function of the binary at path: an entry
// uprobe and one uprobe per RET instruction. A stripped binary
// (-ldflags=-s) is found through .gopclntab. Every probe address is
// verified first (see verifyGoCode); on any doubt nothing is attached.
func (t *Tracer) AttachGoFunc(path string, fn GoFunc) error {
	_, err := t.attachGoFuncs(path, []GoFunc{fn}, false)
	return err
}

// AttachGoFuncs probes every function of fns that the binary at path
// defines and returns their symbols. Functions the binary lacks are
// skipped; it is an error if none is found. The binary's probes are
// attached all or none: if any function it defines cannot be located and
// verified (see verifyGoCode), or any probe fails to attach, no probe of
// this call stays attached and the error says why.
func (t *Tracer) AttachGoFuncs(path string, fns []GoFunc) ([]string, error) {
	return t.attachGoFuncs(path, fns, true)
}

func (t *Tracer) attachGoFuncs(path string, fns []GoFunc, skipMissing bool) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("bpf: open %s: %w", path, err)
	}
	defer f.Close()
	syms := newGoSyms(f)
	var found []GoFunc
	var locs []goFunc
	for _, fn := range fns {
		loc, err := syms.locate(fn.Symbol)
		if skipMissing && errors.Is(err, ErrNoSymbol) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("bpf: %s: refusing to attach any probe to this binary: %w", path, err)
		}
		found = append(found, fn)
		locs = append(locs, loc)
	}
	if len(found) == 0 {
		return nil, fmt.Errorf("bpf: %s defines none of the %d rdmagrpc probe functions: %w", path, len(fns), ErrNoSymbol)
	}
	ex, err := link.OpenExecutable(path)
	if err != nil {
		return nil, fmt.Errorf("bpf: %w", err)
	}
	var all []link.Link
	fail := func(err error) ([]string, error) {
		for _, l := range all {
			l.Close()
		}
		return nil, fmt.Errorf("bpf: %s: attached no probe: %w", path, err)
	}
	perFunc := make([][]link.Link, len(found))
	for i, fn := range found {
		id, err := t.addProbe(probe{shape: shapeGoFunc, name: fn.Symbol, kind: fn.Kind, goFn: fn})
		if err != nil {
			return fail(err)
		}
		// Return probes go first so no call is entered without a way out.
		for _, off := range locs[i].rets {
			opts := t.uprobeOpts(off, id, shapeGoFunc)
			l, err := ex.Uprobe("", t.objs.GoReturn, &opts)
			if err != nil {
				return fail(fmt.Errorf("%s: RET uprobe at %#x: %w", fn.Symbol, off, err))
			}
			all = append(all, l)
			perFunc[i] = append(perFunc[i], l)
		}
		opts := t.uprobeOpts(locs[i].entry, id, shapeGoFunc)
		l, err := ex.Uprobe("", t.objs.GoEntry, &opts)
		if err != nil {
			return fail(fmt.Errorf("%s: entry uprobe: %w", fn.Symbol, err))
		}
		all = append(all, l)
		perFunc[i] = append(perFunc[i], l)
	}
	done := make([]string, len(found))
	for i, fn := range found {
		t.keep(path+":"+fn.Symbol, perFunc[i]...)
		done[i] = fn.Symbol
	}
	return done, nil
}

func (t *Tracer) uprobeOpts(fileOff uint64, id uint32, shape probeShape) link.UprobeOptions {
	return link.UprobeOptions{
		Address: fileOff,
		PID:     t.pid,
		Cookie:  uint64(id)<<8 | uint64(shape),
	}
}

func (t *Tracer) addProbe(p probe) (uint32, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, ErrClosed
	}
	t.probes = append(t.probes, p)
	return uint32(len(t.probes) - 1), nil
}

func (t *Tracer) keep(name string, ls ...link.Link) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		for _, l := range ls {
			l.Close()
		}
		return
	}
	t.links = append(t.links, ls...)
	t.attached = append(t.attached, name)
}

// pollInterval bounds how long an event can wait in the ring buffer: the
// probes wake the reader only once a batch is pending (see WAKEUP_BYTES in
// rdmatrace.c), so Read also looks on this interval.
const pollInterval = 20 * time.Millisecond

// Read blocks until the next event, or returns ErrClosed once Close ran,
// or an error wrapping os.ErrDeadlineExceeded after SetDeadline's time.
// Events reach Read within pollInterval of their submission. Only one
// goroutine may Read at a time.
func (t *Tracer) Read() (Event, error) {
	for {
		dl := time.Now().Add(pollInterval)
		if !t.deadline.IsZero() && t.deadline.Before(dl) {
			dl = t.deadline
		}
		t.rd.SetDeadline(dl)
		rec, err := t.rd.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			if !t.deadline.IsZero() && !time.Now().Before(t.deadline) {
				return Event{}, fmt.Errorf("bpf: read: %w", err)
			}
			continue
		}
		if errors.Is(err, os.ErrClosed) {
			return Event{}, ErrClosed
		}
		if err != nil {
			return Event{}, fmt.Errorf("bpf: read ring buffer: %w", err)
		}
		var raw probesEvent
		if len(rec.RawSample) < int(unsafe.Sizeof(raw)) {
			return Event{}, fmt.Errorf("bpf: short event: %d bytes", len(rec.RawSample))
		}
		// The record is the C struct event, laid out as on this host.
		raw = *(*probesEvent)(unsafe.Pointer(&rec.RawSample[0]))
		t.mu.RLock()
		id := raw.Cookie >> 8
		var p *probe
		if id < uint64(len(t.probes)) {
			p = &t.probes[id]
		}
		t.mu.RUnlock()
		if p == nil {
			continue // cannot happen: ids are handed out before attaching
		}
		return decode(&raw, p, t.monoToWall), nil
	}
}

// SetDeadline makes later Reads return an error wrapping
// os.ErrDeadlineExceeded once d has passed and no event is pending; the
// zero time removes the deadline. Call it from the reading goroutine.
func (t *Tracer) SetDeadline(d time.Time) { t.deadline = d }

// Stats are the kernel-side counters.
type Stats struct {
	Events       uint64 // events submitted to the ring buffer
	Lost         uint64 // events dropped because the ring buffer was full
	NoEntry      uint64 // returns seen without their entry (attached mid-call)
	EntryDropped uint64 // entries not recorded: pending-call table full
}

// Stats sums the per-CPU counters.
func (t *Tracer) Stats() (Stats, error) {
	var s Stats
	dst := []*uint64{&s.Events, &s.Lost, &s.NoEntry, &s.EntryDropped}
	for i, p := range dst {
		var per []uint64
		if err := t.objs.Stats.Lookup(uint32(i), &per); err != nil {
			return Stats{}, fmt.Errorf("bpf: read stats: %w", err)
		}
		for _, v := range per {
			*p += v
		}
	}
	return s, nil
}

// Close detaches every probe, unblocks Read and frees the programs.
func (t *Tracer) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	links := t.links
	t.links = nil
	t.mu.Unlock()
	var errs []error
	for _, l := range links {
		if err := l.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if t.rd != nil {
		if err := t.rd.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := t.objs.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// IsNotSupported reports whether err means this kernel lacks a BPF feature
// the tracer needs.
func IsNotSupported(err error) bool { return errors.Is(err, ebpf.ErrNotSupported) }
