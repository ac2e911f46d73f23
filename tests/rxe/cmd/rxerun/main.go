// Command rxerun runs programs inside the Soft-RoCE qemu guest(s) of
// tests/rxe, building and caching the guest first if needed.
//
//	rxerun [flags] -- ./verbs.test -test.v          # one guest
//	rxerun -pair -b './srv.test -test.run X' -- ./cli.test -test.run Y
//
// Host files named by -f (repeatable) and the program itself (when it is
// a host path) are copied into /rxe/bin in the guest. The exit status is
// the payload's (the larger one in -pair mode), or 2 when the harness
// itself failed.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/rdmagrpc/rdmagrpc/tests/rxe"
)

type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(v string) error { *m = append(*m, v); return nil }

func main() {
	var files, envs multi
	cache := flag.String("cache", rxe.DefaultCacheDir(), "guest image cache dir")
	timeout := flag.Duration("timeout", 10*time.Minute, "whole run, including a cold build")
	pair := flag.Bool("pair", false, "two guests: the command runs in guest A, -b in guest B")
	bcmd := flag.String("b", "", "with -pair: the command for guest B (split on spaces)")
	quiet := flag.Bool("q", false, "no progress lines on stderr")
	mem := flag.Int("mem", 1024, "guest memory, MiB")
	cpus := flag.Int("smp", 2, "guest vCPUs")
	console := flag.Bool("console", false, "print the kernel console after the run")
	flag.Var(&files, "f", "host file or directory to copy into /rxe/bin (repeatable)")
	flag.Var(&envs, "e", "KEY=VALUE for the guest payload(s) (repeatable)")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: rxerun [flags] -- command [args...]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 || (*pair && *bcmd == "") {
		flag.Usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	os.Exit(run(ctx, *cache, *pair, *quiet, *console, *mem, *cpus, files, envs, flag.Args(), strings.Fields(*bcmd)))
}

// payload copies a command given as a host path into the guest and runs
// it from /rxe/bin; other commands (ibv_devinfo, sh) run as named.
func payload(args []string, files, envs []string, prefix string) rxe.Payload {
	p := rxe.Payload{Files: rxe.Files(files...), Env: envs, Args: append([]string(nil), args...)}
	if st, err := os.Stat(args[0]); err == nil && !st.IsDir() && strings.Contains(args[0], "/") {
		p.Files = append(p.Files, rxe.File{Host: args[0]})
		p.Args[0] = rxe.GuestBin + "/" + baseName(args[0])
	}
	p.Stream = &prefixWriter{prefix: prefix, w: os.Stdout}
	return p
}

func baseName(p string) string { return p[strings.LastIndex(p, "/")+1:] }

func run(ctx context.Context, cache string, pair, quiet, console bool, mem, cpus int,
	files, envs, acmd, bcmd []string) int {
	logw := os.Stderr
	var opts []rxe.Option
	if !quiet {
		opts = append(opts, rxe.WithLog(logw))
	}
	t0 := time.Now()
	img, err := rxe.Build(ctx, cache, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "rxerun:", err)
		return 2
	}
	img.MemoryMiB, img.CPUs = mem, cpus
	logf := func(format string, a ...any) {
		if !quiet {
			fmt.Fprintf(logw, "rxerun: "+format+"\n", a...)
		}
	}
	logf("image ready in %v", time.Since(t0).Round(time.Millisecond))
	report := func(name string, r rxe.Result) {
		logf("%s: exit %d, boot %v, run %v, total %v", name, r.ExitCode,
			r.Boot.Round(time.Millisecond), r.Run.Round(time.Millisecond), r.Duration.Round(time.Millisecond))
		if console {
			fmt.Fprintf(os.Stderr, "---- %s kernel console ----\n%s", name, r.Console)
		}
	}
	if !pair {
		r, err := img.RunOne(ctx, payload(acmd, files, envs, ""))
		report("guest", r)
		if err != nil {
			fmt.Fprintln(os.Stderr, "rxerun:", err)
			return 2
		}
		return r.ExitCode
	}
	ra, rb, err := img.RunPair(ctx, payload(acmd, files, envs, "[a] "), payload(bcmd, files, envs, "[b] "))
	report("guest a", ra)
	report("guest b", rb)
	if err != nil {
		fmt.Fprintln(os.Stderr, "rxerun:", err)
		if errors.Is(err, context.Canceled) {
			return 130
		}
		return 2
	}
	return max(ra.ExitCode, rb.ExitCode)
}
