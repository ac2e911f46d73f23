package main

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	tea "github.com/charmbracelet/bubbletea"

	"github.com/rdmagrpc/rdmagrpc/bpf"
)

func run(ctx context.Context, cfg config) error {
	if os.Geteuid() != 0 {
		return errors.New("rdmatrace needs root: eBPF uprobes require CAP_BPF and CAP_PERFMON.\n" +
			"  Run it with sudo, e.g.: sudo " + strings.Join(os.Args, " "))
	}
	tr, err := bpf.Open(bpf.Options{PID: cfg.pid})
	if err != nil {
		if bpf.IsNotSupported(err) || errors.Is(err, os.ErrPermission) {
			return fmt.Errorf("eBPF is not available here (%w).\n"+
				"  rdmatrace needs BPF programs with uprobes and ring buffers (Linux 5.15+, not blocked by\n"+
				"  kernel.unprivileged_bpf_disabled, lockdown or a container's seccomp profile)", err)
		}
		return err
	}
	defer tr.Close()
	notes, w := attach(tr, cfg)
	if len(tr.Attached()) == 0 && w == nil {
		return fmt.Errorf("nothing to trace:\n  %s", strings.Join(notes, "\n  "))
	}
	if w != nil {
		// Processes started from now on are found by the watcher.
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		defer func() { cancel(); <-done }()
		if cfg.jsonOut {
			w.notify = func(msg string) { fmt.Fprintln(os.Stderr, "rdmatrace:", msg) }
		}
		go func() { defer close(done); w.run(wctx) }()
	}
	if cfg.jsonOut {
		for _, n := range notes {
			fmt.Fprintln(os.Stderr, "rdmatrace:", n)
		}
		if w != nil {
			fmt.Fprintln(os.Stderr, "rdmatrace:", w.status())
		}
		// Scripts wait for this line before starting the work to trace.
		fmt.Fprintf(os.Stderr, "rdmatrace: attached %s\n", strings.Join(tr.Attached(), " "))
		return runJSON(ctx, tr, cfg)
	}
	return runView(ctx, tr, cfg, notes, w)
}

// attach probes libibverbs and the Go binaries the configuration names,
// and returns notes on what it could not probe. With no binary and no pid
// named it returns a watcher that has probed the running rdmagrpc
// processes and finds later ones (see watcher).
func attach(tr *bpf.Tracer, cfg config) ([]string, *watcher) {
	var notes []string
	if !cfg.noVerbs {
		lib := cfg.lib
		var err error
		if lib == "" {
			lib, err = bpf.FindLibibverbs(cfg.pid)
		}
		if err == nil {
			err = tr.AttachLibibverbs(lib)
		}
		if err != nil {
			notes = append(notes, "libibverbs: "+err.Error())
		}
	}
	fns := goFuncs(cfg.goPackage)
	bins := slices.Clone(cfg.binaries)
	if len(bins) == 0 && cfg.pid > 0 {
		bins = append(bins, fmt.Sprintf("/proc/%d/exe", cfg.pid))
	}
	if len(bins) == 0 {
		if cfg.noScan {
			return append(notes, "Go binaries not scanned (--no-scan): shm registrations and enlargements are not traced"), nil
		}
		w := newWatcher(tr, fns)
		if w.scan() == 0 {
			notes = append(notes, noneYet)
		}
		return notes, w
	}
	for _, b := range bins {
		if _, err := tr.AttachGoFuncs(b, fns); err != nil {
			notes = append(notes, err.Error())
		}
	}
	return notes, nil
}

// goFuncs are the rdmagrpc probe points, moved under pkg when given.
func goFuncs(pkg string) []bpf.GoFunc {
	fns := slices.Clone(bpf.KnownGoFuncs)
	if pkg == "" {
		return fns
	}
	for i := range fns {
		name := fns[i].Symbol[strings.LastIndexByte(fns[i].Symbol, '.')+1:]
		fns[i].Symbol = pkg + "." + name
	}
	return fns
}

func isGo(path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	return f.Section(".go.buildinfo") != nil || f.Section(".gopclntab") != nil
}

func runView(ctx context.Context, tr *bpf.Tracer, cfg config, notes []string, w *watcher) error {
	events, errc, stop := pump(tr)
	defer stop()
	scope := "all processes"
	if cfg.pid > 0 {
		scope = fmt.Sprintf("pid %d", cfg.pid)
	}
	start := time.Now()
	st := newStats(start)
	st.ranBefore = startedBefore
	disc := newDiscovery(cfg.pid)
	st.setFound(disc.found(), commOf)
	hw := newHWRates(cfg.sysfs, start)
	var until time.Time
	if cfg.duration > 0 {
		until = start.Add(cfg.duration)
	}
	if cfg.plain || !isTerminal(os.Stdout) {
		for _, n := range notes {
			fmt.Fprintln(os.Stderr, "rdmatrace:", n)
		}
		if w != nil {
			w.notify = func(msg string) { fmt.Fprintln(os.Stderr, "rdmatrace:", msg) }
		}
		for _, l := range hw.lines() {
			fmt.Fprintln(os.Stderr, "rdmatrace:", l)
		}
		fmt.Fprintf(os.Stderr, "rdmatrace: attached %s\n", strings.Join(tr.Attached(), " "))
		plainRun(ctx, os.Stdout, events, st, hw, cfg.interval, until, periodic(discoverEvery, func() {
			st.markExited(processAlive)
			st.setFound(disc.found(), commOf)
		}))
		select {
		case err := <-errc: // the tracer failed: src closed
			if !errors.Is(err, bpf.ErrClosed) {
				return err
			}
		default: // stopped by ctx or --duration
		}
		return nil
	}
	m := &model{
		st:       st,
		src:      events,
		errc:     errc,
		tr:       tr,
		notes:    notes,
		watch:    w,
		scope:    scope,
		interval: cfg.interval,
		started:  start,
		until:    until,
		hw:       hw,
		refresh:  periodic(discoverEvery, func() { st.setFound(disc.found(), commOf) }),
	}
	p := tea.NewProgram(m, tea.WithAltScreen(), tea.WithContext(ctx))
	_, err := p.Run()
	if errors.Is(err, tea.ErrProgramKilled) && ctx.Err() != nil {
		return nil // Ctrl-C or SIGTERM
	}
	return err
}

// discoverEvery is how often the sockets are scanned again for the
// connection ends open since before rdmatrace started (a scan reads
// every process's descriptors: not on every tick of a busy host).
const discoverEvery = 5 * time.Second

// periodic returns a function of the time that runs f when every has
// passed since it last did.
func periodic(every time.Duration, f func()) func(time.Time) {
	var last time.Time
	return func(now time.Time) {
		if now.Sub(last) >= every {
			last = now
			f()
		}
	}
}

// noneYet is the note of a watcher that has found nothing so far.
const noneYet = "no rdmagrpc process running yet: watching for new ones"

func describeProbes(attached, notes []string) string {
	var verbs, gofns []string
	for _, a := range attached {
		fn := a[strings.LastIndexByte(a, ':')+1:]
		if strings.HasPrefix(fn, "ibv_") {
			verbs = append(verbs, fn)
		} else if fn = fn[strings.LastIndexByte(fn, '/')+1:]; !slices.Contains(gofns, fn) {
			gofns = append(gofns, fn) // once, however many executables have it
		}
	}
	s := fmt.Sprintf("libibverbs %d, Go %d %v", len(verbs), len(gofns), gofns)
	if len(notes) > 0 {
		s += "  (" + strings.Join(notes, "; ") + ")"
	}
	return s
}

// pump moves events from the tracer to a channel. Its goroutine ends when
// stop (which closes the tracer) is called; errc then holds why it ended.
func pump(tr *bpf.Tracer) (<-chan bpf.Event, <-chan error, func()) {
	events := make(chan bpf.Event, 4096)
	errc := make(chan error, 1)
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		defer close(events)
		for {
			ev, err := tr.Read()
			if err != nil {
				errc <- err
				return
			}
			select {
			case events <- ev:
			case <-done:
				errc <- bpf.ErrClosed
				return
			}
		}
	}()
	return events, errc, func() {
		close(done)
		tr.Close()
		<-exited
	}
}
