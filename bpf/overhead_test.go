package bpf

import (
	"errors"
	"path/filepath"
	"strconv"
	"testing"
)

// The probes' cost per call, measured as the difference between a probed
// and an unprobed run of the same helper, timed inside the helper:
//
//	go test -run '^$' -bench Probe -benchtime 100000x ./bpf/
//
// Go: a regMR+deregMR pair of goreg (per function: an entry uprobe and a
// RET uprobe, two traps, one ring-buffer event). C: a reg+dereg pair of the
// stand-in libibverbs (per function: uprobe + uretprobe). Each pair is two
// probed calls, so the per-call overhead is (probed - unprobed) / 2.

func BenchmarkGoProbe(b *testing.B) {
	benchPairs(b, "goreg", []string{"-bench"}, func(tr *Tracer, dir, bin string) error {
		_, err := tr.AttachGoFuncs(bin, asMain(KnownGoFuncs))
		return err
	})
}

func BenchmarkLibProbe(b *testing.B) {
	benchPairs(b, "fvdriver", []string{"bench"}, func(tr *Tracer, dir, _ string) error {
		return tr.AttachLibibverbs(filepath.Join(dir, "libfakeverbs.so"))
	})
}

func benchPairs(b *testing.B, helper string, args []string, attach func(tr *Tracer, dir, bin string) error) {
	for _, probed := range []bool{false, true} {
		name := map[bool]string{false: "unprobed", true: "probed"}[probed]
		b.Run(name, func(b *testing.B) {
			if probed {
				requireRoot(b)
			}
			dir := helpers(b)
			if helper == "fvdriver" {
				dir = cHelpers(b)
			}
			bin := filepath.Join(dir, helper)
			tg := startTarget(b, bin, append(args, strconv.Itoa(max(b.N, 1000)))...)
			if probed {
				tr, err := Open(Options{PID: tg.cmd.Process.Pid})
				if err != nil {
					b.Fatal(err)
				}
				defer tr.Close()
				if err := attach(tr, dir, bin); err != nil {
					b.Fatal(err)
				}
				go func() { // drains the ring buffer until Close
					for {
						if _, err := tr.Read(); errors.Is(err, ErrClosed) {
							return
						}
					}
				}()
			}
			if _, err := tg.stdin.Write([]byte("go\n")); err != nil {
				b.Fatal(err)
			}
			if !tg.out.Scan() {
				b.Fatal("helper exited before printing its timing")
			}
			ns, err := strconv.ParseFloat(tg.out.Text(), 64)
			if err != nil {
				b.Fatalf("helper printed %q", tg.out.Text())
			}
			b.ReportMetric(ns, "ns/pair")
			b.ReportMetric(0, "ns/op") // the harness's own timing includes process start-up
		})
	}
}
