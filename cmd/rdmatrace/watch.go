package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/rdmagrpc/rdmagrpc/bpf"
)

// watchInterval is how often /proc is scanned for processes started
// since the last scan.
const watchInterval = 250 * time.Millisecond

// watcher finds rdmagrpc processes by itself: at start and then every
// watchInterval it looks at the executable of every process and probes
// each file that contains rdmagrpc's probe points, once per file (a uprobe
// on a file fires in every process running it, now or later). Files are
// told apart by device and inode, read through /proc/PID/exe, so a
// program in a container (another mount namespace) is probed through its
// own file, and a copy rebuilt at the same path is probed again.
type watcher struct {
	tr  *bpf.Tracer
	fns []bpf.GoFunc
	// notify, when set, hears of each file newly probed or skipped.
	notify func(msg string)

	mu      sync.Mutex
	seen    map[fileKey]bool
	files   map[fileKey]bool  // probed files
	probed  []string          // executables probed (the path first seen)
	skipped map[string]string // executable → why it was not probed (not rdmagrpc files are not listed)
	procs   map[int]bool      // live processes running a probed file
}

type fileKey struct{ dev, ino uint64 }

func newWatcher(tr *bpf.Tracer, fns []bpf.GoFunc) *watcher {
	return &watcher{tr: tr, fns: fns, seen: map[fileKey]bool{}, files: map[fileKey]bool{}, skipped: map[string]string{}, procs: map[int]bool{}}
}

// scan probes the executables of processes not seen before and returns
// how many files it probed.
func (w *watcher) scan() int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	self, _ := os.Executable()
	selfKey, _ := keyOf(self)
	live := map[int]bool{}
	n := 0
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		exe := filepath.Join("/proc", e.Name(), "exe")
		k, err := keyOf(exe)
		if err != nil || k == selfKey {
			continue // a kernel thread, or gone
		}
		w.mu.Lock()
		done := w.seen[k]
		w.seen[k] = true
		w.mu.Unlock()
		if done {
			if w.isProbed(k) {
				live[pid] = true
			}
			continue
		}
		if !isGo(exe) {
			continue
		}
		target, _ := os.Readlink(exe)
		_, err = w.tr.AttachGoFuncs(exe, w.fns)
		switch {
		case err == nil:
			n++
			live[pid] = true
			w.mu.Lock()
			w.files[k] = true
			w.probed = append(w.probed, fmt.Sprintf("%s (pid %d)", target, pid))
			w.mu.Unlock()
			w.say(fmt.Sprintf("attached %s (pid %d)", target, pid))
		case errors.Is(err, bpf.ErrNoSymbol):
			// A Go program that does not use rdmagrpc.
		default:
			w.mu.Lock()
			w.skipped[target] = err.Error()
			w.mu.Unlock()
			w.say(fmt.Sprintf("skipped %s (pid %d): %v", target, pid, err))
		}
	}
	w.mu.Lock()
	w.procs = live
	w.mu.Unlock()
	return n
}

func (w *watcher) isProbed(k fileKey) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.files[k]
}

func (w *watcher) say(msg string) {
	if w.notify != nil {
		w.notify(msg)
	}
}

// run scans every watchInterval until ctx ends.
func (w *watcher) run(ctx context.Context) {
	t := time.NewTicker(watchInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			w.scan()
		}
	}
}

// status is the header line: what is watched and what was skipped.
func (w *watcher) status() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := fmt.Sprintf("watching every process: %d rdmagrpc executables probed, %d processes running them", len(w.probed), len(w.procs))
	if len(w.skipped) > 0 {
		s += fmt.Sprintf("; %d skipped:", len(w.skipped))
		for exe, why := range w.skipped {
			s += fmt.Sprintf(" %s (%s)", exe, why)
		}
	}
	return s
}

func keyOf(path string) (fileKey, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return fileKey{}, err
	}
	return fileKey{dev: st.Dev, ino: st.Ino}, nil
}
