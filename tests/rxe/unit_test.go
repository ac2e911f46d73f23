package rxe

import (
	"bytes"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"
)

// cpioEntry is one parsed newc record.
type cpioEntry struct {
	name string
	mode uint32
	data string
	rdev [2]uint32
}

// readNewc parses what cpioWriter writes, as the kernel would.
func readNewc(t *testing.T, b []byte) []cpioEntry {
	t.Helper()
	var out []cpioEntry
	off := 0
	align := func() { off = (off + 3) &^ 3 }
	for {
		if off+110 > len(b) {
			t.Fatalf("truncated header at %d", off)
		}
		h := string(b[off : off+110])
		if h[:6] != "070701" {
			t.Fatalf("bad magic %q at %d", h[:6], off)
		}
		field := func(i int) uint32 {
			v, err := strconv.ParseUint(h[6+8*i:14+8*i], 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return uint32(v)
		}
		mode, size, rmaj, rmin, nsize := field(1), field(6), field(9), field(10), field(11)
		off += 110
		name := string(b[off : off+int(nsize)-1])
		off += int(nsize)
		align()
		data := string(b[off : off+int(size)])
		off += int(size)
		align()
		if name == "TRAILER!!!" {
			return out
		}
		out = append(out, cpioEntry{name, mode, data, [2]uint32{rmaj, rmin}})
	}
}

func TestCPIORoundTrip(t *testing.T) {
	var buf bytes.Buffer
	c := newCPIO(&buf)
	if err := c.addSymlink("bin", "usr/bin"); err != nil {
		t.Fatal(err)
	}
	if err := c.addBytes("usr/bin/hello", 0o755, []byte("abcde")); err != nil {
		t.Fatal(err)
	}
	if err := c.addCharDev("dev/console", 0o600, 5, 1); err != nil {
		t.Fatal(err)
	}
	if err := c.close(); err != nil {
		t.Fatal(err)
	}
	if buf.Len()%4 != 0 {
		t.Errorf("archive length %d not 4-aligned: a second archive appended to it would be misread", buf.Len())
	}
	got := readNewc(t, buf.Bytes())
	want := []cpioEntry{
		{"bin", 0o120777, "usr/bin", [2]uint32{}},
		{"usr", 0o040755, "", [2]uint32{}},
		{"usr/bin", 0o040755, "", [2]uint32{}},
		{"usr/bin/hello", 0o100755, "abcde", [2]uint32{}},
		{"dev", 0o040755, "", [2]uint32{}},
		{"dev/console", 0o020600, "", [2]uint32{5, 1}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d entries %+v, want %d", len(got), got, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestRunArchive(t *testing.T) {
	var buf bytes.Buffer
	p := Payload{
		Files: []File{{Host: "testdata/smoke.sh"}, {Host: "testdata/smoke.sh", Guest: "/lib/x/smoke"}},
		Args:  []string{"smoke.sh", "it's", "$HOME"},
		Env:   []string{"A=b c"},
	}
	if err := writeRunArchive(&buf, p, netConfig{"d0", GuestAddrA, GuestAddrA, "single"}, "n0nce"); err != nil {
		t.Fatal(err)
	}
	files := map[string]cpioEntry{}
	for _, e := range readNewc(t, buf.Bytes()) {
		files[e.name] = e
	}
	if _, ok := files["rxe/bin/smoke.sh"]; !ok {
		t.Error("payload file not under /rxe/bin")
	}
	if _, ok := files["usr/lib/x/smoke"]; !ok {
		t.Error("guest path /lib/x not mapped into /usr (would replace the /lib symlink)")
	}
	if _, ok := files["lib"]; ok {
		t.Error("archive names /lib as a directory")
	}
	if got, want := files["rxe/payload.sh"].data, `exec 'smoke.sh' 'it'\''s' '$HOME'`+"\n"; got != want {
		t.Errorf("payload.sh = %q, want %q", got, want)
	}
	env := files["rxe/run.env"].data
	for _, s := range []string{"RXE_NONCE=n0nce\n", "export RXE_PEER='10.99.0.1'\n", "export A='b c'\n"} {
		if !strings.Contains(env, s) {
			t.Errorf("run.env lacks %q:\n%s", s, env)
		}
	}
	for _, bad := range [][]string{nil, {}} {
		if err := writeRunArchive(io.Discard, Payload{Args: bad}, netConfig{}, "x"); err == nil {
			t.Error("empty command accepted")
		}
	}
	if err := writeRunArchive(io.Discard, Payload{Args: []string{"true"}, Env: []string{"A B=1"}}, netConfig{}, "x"); err == nil {
		t.Error("bad env name accepted")
	}
}

func TestSerialParser(t *testing.T) {
	for _, tc := range []struct{ name, payload string }{
		{"trailing newline", "a\nb\n"},
		{"no trailing newline", "a\nb"},
		{"empty", ""},
		{"blank lines", "\n\n"},
		{"carriage returns kept", "x\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stream := "rxe-init noise\n@@RXE-N-READY@@\n" + tc.payload + "\n@@RXE-N-EXIT 3@@\n"
			var live bytes.Buffer
			p := newSerialParser("N", &live)
			p.start = time.Now()
			p.consume(strings.NewReader(stream))
			if !p.haveExit || p.exitCode != 3 {
				t.Fatalf("exit %v %d", p.haveExit, p.exitCode)
			}
			if got := p.out.String(); got != tc.payload {
				t.Errorf("output %q, want %q", got, tc.payload)
			}
			if live.String() != tc.payload {
				t.Errorf("streamed %q, want %q", live.String(), tc.payload)
			}
			if p.setup.String() != "rxe-init noise\n" {
				t.Errorf("setup log %q", p.setup.String())
			}
		})
	}
	// A marker with another nonce is payload output, not the end.
	p := newSerialParser("N", nil)
	p.consume(strings.NewReader("@@RXE-N-READY@@\n@@RXE-M-EXIT 0@@\n"))
	if p.haveExit {
		t.Error("foreign nonce ended the run")
	}
	p = newSerialParser("N", nil)
	p.consume(strings.NewReader("@@RXE-N-FAIL rxe0 not ready@@\n"))
	if p.failure != "rxe0 not ready" {
		t.Errorf("failure %q", p.failure)
	}
}

func TestModulesDepOrder(t *testing.T) {
	mods := []kmod{
		{name: "a", rel: "kernel/a.ko"},
		{name: "b", rel: "kernel/b.ko", depends: []string{"a"}},
		{name: "c", rel: "kernel/c.ko", depends: []string{"b"}},
	}
	want := "kernel/a.ko:\nkernel/b.ko: kernel/a.ko\nkernel/c.ko: kernel/b.ko kernel/a.ko\n"
	if got := string(modulesDep(mods)); got != want {
		t.Errorf("modules.dep:\n%s\nwant:\n%s", got, want)
	}
}

func TestUsrMerged(t *testing.T) {
	for in, want := range map[string]string{
		"bin/ip": "usr/bin/ip", "lib64/ld.so": "usr/lib64/ld.so", "libx/y": "libx/y",
		"usr/bin/rdma": "usr/bin/rdma", "etc/libibverbs.d/rxe.driver": "etc/libibverbs.d/rxe.driver",
	} {
		if got := usrMerged(in); got != want {
			t.Errorf("usrMerged(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestCountResults(t *testing.T) {
	out := []byte(`=== RUN   TestA
--- PASS: TestA (0.01s)
--- PASS: TestConformance (1.00s)
    --- PASS: TestConformance/OneProcess (0.50s)
        --- PASS: TestConformance/OneProcess/PrivateData (0.10s)
        --- PASS: TestConformance/OneProcess/RemoteAccess (0.10s)
            --- PASS: TestConformance/OneProcess/RemoteAccess/BadRKey (0.10s)
        --- SKIP: TestConformance/OneProcess/PeerKilledFlushes (0.00s)
    --- FAIL: TestConformance/TwoProcesses/Reject (0.10s)
--- SKIP: TestRXEPairTransfer (0.00s)
`)
	got := countResults(out)
	want := "3 passed, 2 skipped, 1 failed; TestConformance: 2 passed, 1 skipped, 1 failed"
	if got != want {
		t.Errorf("countResults = %q, want %q", got, want)
	}
}

func TestFailureLines(t *testing.T) {
	out := []byte(`=== RUN   TestA
    a_test.go:3: not this one
--- PASS: TestA (0.00s)
=== RUN   TestB
=== RUN   TestB/sub
    b_test.go:12: want 1, got 2
=== RUN   TestB/other
    b_test.go:20: not this one either
=== NAME  TestB/sub
    b_test.go:14: more detail
--- FAIL: TestB (0.01s)
    --- FAIL: TestB/sub (0.01s)
    --- PASS: TestB/other (0.00s)
=== RUN   TestC
--- PASS: TestC (0.00s)
panic: boom
goroutine 1 [running]:
FAIL
`)
	got := strings.Join(failureLines(out), "\n")
	for _, want := range []string{"--- FAIL: TestB/sub", "b_test.go:12: want 1, got 2", "b_test.go:14: more detail", "panic: boom", "goroutine 1 [running]:"} {
		if !strings.Contains(got, want) {
			t.Errorf("failureLines lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "not this one") || strings.Contains(got, "TestC") {
		t.Errorf("failureLines took lines of passing tests:\n%s", got)
	}
	if got := failureLines([]byte("ok\n")); len(got) != 1 || !strings.Contains(got[0], "no FAIL line") {
		t.Errorf("failureLines of a passing run = %q", got)
	}
}
