package shm

import (
	"context"
	"os"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

func TestArenaRunReusedZeroed(t *testing.T) {
	a, err := allocMemory(dataPool, 8192)
	if err != nil {
		t.Fatal(err)
	}
	defer freeMemory(a)
	b, err := allocMemory(dataPool, 8192)
	if err != nil {
		t.Fatal(err)
	}
	for i := range b {
		b[i] = 0xa5
	}
	addr := addrOf(b)
	if err := freeMemory(b); err != nil {
		t.Fatal(err)
	}
	c, err := allocMemory(dataPool, 8192)
	if err != nil {
		t.Fatal(err)
	}
	defer freeMemory(c)
	if addrOf(c) != addr {
		t.Logf("run not reused (first fit found another): %#x, freed %#x", addrOf(c), addr)
	}
	for i, v := range c {
		if v != 0 {
			t.Fatalf("byte %d of a reused run is %#x: the previous owner's data leaked", i, v)
		}
	}
}

func TestArenaLargeAllocationDedicated(t *testing.T) {
	big, err := allocMemory(dataPool, dedicatedAt)
	if err != nil {
		t.Fatal(err)
	}
	allocs.RLock()
	ar := arenaAt(addrOf(big))
	allocs.RUnlock()
	if ar == nil || !ar.dedicated || len(ar.mem) != dedicatedAt {
		t.Fatalf("large allocation not in a dedicated arena: %+v", ar)
	}
	if err := freeMemory(big); err != nil {
		t.Fatal(err)
	}
	allocs.RLock()
	_, still := arenas.byID[ar.id]
	allocs.RUnlock()
	if still {
		t.Fatal("dedicated arena kept after its allocation was freed")
	}
}

func countFDs(t *testing.T) int {
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(es)
}

// connectQP connects a QP of cli to l, accepted by a QP of srv; both are
// closed when the test ends. It returns cli's.
func connectQP(t *testing.T, ctx context.Context, l transport.Listener, cli, srv *side) transport.QP {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		r, err := l.Accept(ctx)
		if err == nil {
			var q transport.QP
			if q, err = r.Accept(ctx, srv.cfg(), nil); err == nil {
				t.Cleanup(func() { q.Close() })
			}
		}
		errc <- err
	}()
	q, err := cli.dev.Connect(ctx, l.Addr().String(), cli.cfg(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	return q
}

// Ten thousand idle connections per process fit in a 20,000 descriptor
// limit only if a connection end costs its socket and nothing else.
func TestOneDescriptorPerConnectionEnd(t *testing.T) {
	cli, srv, l := listenSides(t, 4096, 4096)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 50
	connectQP(t, ctx, l, cli, srv) // the first connection maps the peer's table and arenas
	before := countFDs(t)
	for range n {
		connectQP(t, ctx, l, cli, srv)
	}
	if d := countFDs(t) - before; d != 2*n {
		t.Fatalf("%d connections added %d descriptors, want %d (one socket per end)", n, d, 2*n)
	}
}

// A requester copying through a peer MR holds its Dereg back, so that the
// memory is never reused under the copy; one that never finishes leaves
// the memory quarantined.
func TestDeregWaitsForPinnedCopy(t *testing.T) {
	cli, srv := pair(t, nil)
	mem, err := srv.dev.AllocMemory(8192)
	if err != nil {
		t.Fatal(err)
	}
	mr, err := srv.pd.RegMR(mem, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	peerTable := cli.qp.(*qp).peer.mrt
	if !peerTable.pin(mr.RKey()) {
		t.Fatal("pin of a valid key failed")
	}
	done := make(chan error, 1)
	go func() { done <- mr.Dereg() }()
	select {
	case err := <-done:
		t.Fatalf("Dereg returned (%v) while a requester was copying", err)
	case <-time.After(50 * time.Millisecond):
	}
	if peerTable.pin(mr.RKey()) {
		t.Fatal("a key being deregistered could be pinned again")
	}
	peerTable.unpin(mr.RKey())
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := srv.dev.FreeMemory(mem); err != nil {
		t.Fatal(err)
	}

	// A pin that is never released.
	mem, err = srv.dev.AllocMemory(8192)
	if err != nil {
		t.Fatal(err)
	}
	mr, err = srv.pd.RegMR(mem, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	peerTable.pin(mr.RKey())
	start := time.Now()
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < pinWait {
		t.Fatalf("Dereg gave up after %v, before pinWait", d)
	}
	stuck := addrOf(mem)
	if err := srv.dev.FreeMemory(mem); err != nil {
		t.Fatal(err)
	}
	again, err := srv.dev.AllocMemory(8192)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.dev.FreeMemory(again)
	if addrOf(again) == stuck {
		t.Fatal("quarantined memory handed out again")
	}
}

// A peer that disarmed our queue and then went away before its wake-up
// message was read must not leave a waiter asleep for good.
func TestHangupWakesDisarmedQueue(t *testing.T) {
	cli, srv := pair(t, nil)
	if err := srv.rcq.ReqNotify(); err != nil {
		t.Fatal(err)
	}
	if !srv.rcq.(*cq).hdr.disarm() { // what the peer's notifyPeer does
		t.Fatal("queue not armed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- srv.rcq.Wait(ctx) }()
	cli.qp.Close()
	if err := <-done; err != nil {
		t.Fatalf("Wait after the peer left: %v", err)
	}
}

// runFree reports whether the run of seg is back in its arena's free list.
func runFree(seg *segment) bool {
	allocs.RLock()
	defer allocs.RUnlock()
	for _, s := range seg.a.arena.free {
		if s.off <= seg.a.off && seg.a.off < s.off+s.n {
			return true
		}
	}
	return false
}

// A ring the peer may still write (it did not acknowledge the disconnect
// in time) is never handed to the next QP; one it released is.
func TestRingQuarantinedAfterForcedDisconnect(t *testing.T) {
	cli, srv := pair(t, nil)
	peer := srv.qp.(*qp)
	peer.sendMu.Lock() // the peer's hang-up cannot finish: no acknowledgement
	q := cli.qp.(*qp)
	seg := q.seg
	start := time.Now()
	q.Close()
	peer.sendMu.Unlock()
	if !q.forced.Load() || time.Since(start) < time.Second {
		t.Fatalf("disconnect not forced (after %v)", time.Since(start))
	}
	if runFree(seg) {
		t.Fatal("ring of a forced disconnect returned to the pool")
	}

	cli2, _ := pair(t, nil)
	q2 := cli2.qp.(*qp)
	seg2 := q2.seg
	q2.Close()
	if q2.forced.Load() || !runFree(seg2) {
		t.Fatal("ring of a clean disconnect not returned to the pool")
	}
}

// A pool's last arena, kept for the next allocation once everything in it
// is freed, gives its pages back beyond keepResident: runs below punchMin
// are only cleared when freed, and a burst of connections would otherwise
// leave its high-water mark resident after they all closed. Below it, the
// pages stay for the next connection of a dial loop.
func TestEmptyArenaGivesPagesBack(t *testing.T) {
	p := &pool{name: "rdmagrpc-shm-test-punch"}
	const burst = 2 * keepResident / 8192
	var runs [][]byte
	for range burst {
		b, err := allocMemory(p, 8192)
		if err != nil {
			t.Fatal(err)
		}
		for i := range b {
			b[i] = 1
		}
		runs = append(runs, b)
	}
	allocs.RLock()
	if len(p.arenas) != 1 {
		allocs.RUnlock()
		t.Fatalf("%d arenas, want 1", len(p.arenas))
	}
	a := p.arenas[0]
	allocs.RUnlock()
	resident := func() int {
		vec := make([]byte, (len(a.mem)+os.Getpagesize()-1)/os.Getpagesize())
		if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&a.mem[0])), uintptr(len(a.mem)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
			t.Fatal(e)
		}
		n := 0
		for _, v := range vec {
			n += int(v & 1)
		}
		return n
	}
	if n := resident(); n < burst*8192/os.Getpagesize() {
		t.Fatalf("%d pages resident after writing %d KiB", n, burst*8)
	}
	for _, b := range runs {
		if err := freeMemory(b); err != nil {
			t.Fatal(err)
		}
	}
	if n := resident(); n != 0 {
		t.Fatalf("%d pages still resident once the arena is empty after a burst of %d KiB", n, burst*8)
	}
	// One connection at a time: its pages stay, cleared.
	for range 3 {
		b, err := allocMemory(p, 8192)
		if err != nil {
			t.Fatal(err)
		}
		for i := range b {
			if b[i] != 0 {
				t.Fatalf("byte %d of a reused run is %d, want 0", i, b[i])
			}
			b[i] = 1
		}
		if err := freeMemory(b); err != nil {
			t.Fatal(err)
		}
	}
	if n := resident(); n != 8192/os.Getpagesize() {
		t.Fatalf("%d pages resident once the arena is empty after one 8 KiB run, want its %d kept", n, 8192/os.Getpagesize())
	}
	allocs.Lock()
	p.drop()
	allocs.Unlock()
}

// Control segments of many connections share pages: a CQ header (64 B)
// took a page of its own, and with its QP ring that was most of what an
// idle connection end kept resident. A segment freed or quarantined next
// to live ones clears its own bytes only.
func TestSegmentsSharePages(t *testing.T) {
	p := &pool{name: "rdmagrpc-shm-test-segments"}
	defer func() {
		allocs.Lock()
		p.drop()
		allocs.Unlock()
	}()
	var segs []*segment
	pages := map[uintptr]bool{}
	for range 64 {
		s, err := newSegment(p, cqHdrSize)
		if err != nil {
			t.Fatal(err)
		}
		if addrOf(s.mem)%segmentUnit != 0 {
			t.Fatalf("segment at %#x: not on a cache line", addrOf(s.mem))
		}
		for i := range s.mem {
			s.mem[i] = 0xa5
		}
		pages[addrOf(s.mem)&^uintptr(pageSize-1)] = true
		segs = append(segs, s)
	}
	if want := 64 * cqHdrSize / pageSize; len(pages) != want {
		t.Fatalf("64 CQ headers on %d pages, want %d", len(pages), want)
	}
	ring, err := newSegment(p, qpSegSize(64, 1))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a QP ring of 64 slots: %d B", len(ring.mem))
	if err := segs[1].close(); err != nil {
		t.Fatal(err)
	}
	segs[2].quarantine()
	for _, i := range []int{1, 2} {
		for _, b := range segs[i].mem {
			if b != 0 {
				t.Fatalf("segment %d not cleared", i)
			}
		}
	}
	for _, i := range []int{0, 3} {
		for _, b := range segs[i].mem {
			if b != 0xa5 {
				t.Fatalf("segment %d, beside a freed and a quarantined one, was touched", i)
			}
		}
	}
	// The freed run is handed out again; the quarantined one never.
	s, err := newSegment(p, cqHdrSize)
	if err != nil {
		t.Fatal(err)
	}
	if addrOf(s.mem) != addrOf(segs[1].mem) {
		t.Fatalf("a freed segment's run was not reused first: got %#x, freed %#x", addrOf(s.mem), addrOf(segs[1].mem))
	}
	for _, x := range append(segs[3:], segs[0], s, ring) {
		if err := x.close(); err != nil {
			t.Fatal(err)
		}
	}
}

// A second connection to the same peer process writes into an arena the
// first had handed to it without asking for its memfd again: the request
// was a cross-process round trip in every connection's first write.
func TestSecondQPReusesPeerArena(t *testing.T) {
	cli, srv, l := listenSides(t, 64, 64)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	connect := func() transport.QP { return connectQP(t, ctx, l, cli, srv) }
	write := func(q transport.QP, off uint64, s string) {
		t.Helper()
		copy(cli.mem, s)
		if _, err := q.PostSend(transport.SendWR{ID: 1, Opcode: transport.OpWrite, SG: cli.sge(0, len(s)), RemoteAddr: srv.mr.Addr() + off, RKey: srv.mr.RKey(), Signaled: true}); err != nil {
			t.Fatal(err)
		}
		if wc := poll(t, cli.scq, 1)[0]; wc.Status != transport.StatusSuccess {
			t.Fatalf("write: %+v", wc)
		}
		if got := string(srv.mem[off : off+uint64(len(s))]); got != s {
			t.Fatalf("the peer holds %q, want %q", got, s)
		}
	}
	q1, q2 := connect(), connect()
	before := memfdRequests.Load()
	write(q1, 100, "first")
	if n := memfdRequests.Load() - before; n != 1 {
		t.Fatalf("the first QP's first write asked for %d memfds, want 1", n)
	}
	write(q2, 200, "second")
	if n := memfdRequests.Load() - before; n != 1 {
		t.Fatalf("the second QP asked for the arena again (%d requests in all)", n)
	}
	// A key the peer never registered is still refused through the
	// shared mapping.
	if _, err := q2.PostSend(transport.SendWR{ID: 2, Opcode: transport.OpWrite, SG: cli.sge(0, 4), RemoteAddr: srv.mr.Addr(), RKey: srv.mr.RKey() ^ 0x5a5a, Signaled: true}); err != nil {
		t.Fatal(err)
	}
	if wc := poll(t, cli.scq, 1)[0]; wc.Status != transport.StatusRemAccessErr {
		t.Fatalf("a write with a forged key: %+v", wc)
	}
	// The device keeps the arena mapped for the connections after the
	// last one closed (a dial loop asked for it at every dial), and lets
	// it go with the device.
	q1.Close()
	q2.Close()
	q3 := connect()
	write(q3, 300, "third")
	if n := memfdRequests.Load() - before; n != 1 {
		t.Fatalf("with a QP opened after the others closed, %d requests in all, want 1", n)
	}
	q3.Close()
	d := cli.dev.(*device)
	d.arenaMu.Lock()
	if len(d.kept) != 1 {
		d.arenaMu.Unlock()
		t.Fatalf("the device keeps %d arenas, want 1", len(d.kept))
	}
	k := d.kept[0].m.key
	d.arenaMu.Unlock()
	mapped := func() bool {
		peerMaps.Lock()
		defer peerMaps.Unlock()
		_, ok := peerMaps.m[k]
		return ok
	}
	if !mapped() {
		t.Fatal("the kept arena is not mapped")
	}
	d.releaseArenas()
	if mapped() {
		t.Fatal("the arena is still mapped once the device let it go")
	}
}

// The device keeps its mappings of a peer's MR table and control arenas
// once the last connection to that peer closed, and the next connection
// takes them again instead of mapping them anew (a dial-and-close loop
// unmapped and mapped them at every connection); they go with the device.
func TestPeerControlMappingsKept(t *testing.T) {
	cli, srv, l := listenSides(t, 64, 64)
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	refs := func(k fileKey) int {
		peerMaps.Lock()
		defer peerMaps.Unlock()
		if sm, ok := peerMaps.m[k]; ok {
			return sm.refs
		}
		return 0
	}
	q1 := connectQP(t, ctx, l, cli, srv).(*qp)
	var keys []fileKey
	addrs := map[fileKey]uintptr{}
	for _, m := range q1.peer.held {
		keys = append(keys, m.key)
		addrs[m.key] = addrOf(m.mem)
	}
	q1.Close()
	for _, k := range keys {
		if refs(k) == 0 {
			t.Fatalf("the peer's file %+v was unmapped when its last connection closed", k)
		}
	}
	q2 := connectQP(t, ctx, l, cli, srv).(*qp)
	for _, m := range q2.peer.held {
		if a, ok := addrs[m.key]; !ok || a != addrOf(m.mem) {
			t.Fatalf("the next connection mapped the peer's file %+v anew", m.key)
		}
	}
	q2.Close()
	// In one process the two sides' devices share their control arena,
	// which the server's open QP maps too: what goes is the client
	// device's own reference.
	before := map[fileKey]int{}
	for _, k := range keys {
		before[k] = refs(k)
	}
	cli.dev.(*device).releaseArenas()
	for _, k := range keys {
		if got := refs(k); got != before[k]-1 {
			t.Fatalf("the peer's file %+v has %d references once the device let it go, want %d", k, got, before[k]-1)
		}
	}
}

// RegMR finds the allocation behind any slice of it, in whichever arena
// and in whatever order allocations came and went; memory that is not, or
// no longer, an allocation is refused, and FreeMemory takes only what
// AllocMemory returned.
func TestAllocationIndex(t *testing.T) {
	var mems [][]byte
	for i := range 40 {
		size := pageSize * (1 + i%3)
		if i == 20 {
			size = dedicatedAt // an arena of its own, in the index too
		}
		m, err := allocMemory(dataPool, size)
		if err != nil {
			t.Fatal(err)
		}
		mems = append(mems, m)
	}
	check := func(m []byte, off, n int, want bool) {
		t.Helper()
		a := acquireAlloc(addrOf(m)+uintptr(off), n)
		if (a != nil) != want {
			t.Fatalf("acquire [%d, %d) of a %d-byte allocation: found %v, want %v", off, off+n, len(m), a != nil, want)
		}
		if a != nil {
			if a.base != addrOf(m) {
				t.Fatalf("acquire [%d, %d): allocation at %#x, want %#x", off, off+n, a.base, addrOf(m))
			}
			a.mrs.Add(-1)
		}
	}
	// Free every third, out of order, then check what is left.
	for i := len(mems) - 1; i >= 0; i -= 3 {
		if err := freeMemory(mems[i][pageSize/2:]); err == nil {
			t.Fatal("freed memory by a slice that does not start the allocation")
		}
		if err := freeMemory(mems[i]); err != nil {
			t.Fatal(err)
		}
		check(mems[i], 0, 1, false)
		mems[i] = nil
	}
	for _, m := range mems {
		if m == nil {
			continue
		}
		check(m, 0, len(m), true)
		check(m, len(m)-1, 1, true)
		check(m, len(m)-1, 0, true)
		check(m, pageSize/2, len(m)-pageSize/2, true)
		check(m, 1, len(m), false) // one byte past the run
	}
	for _, m := range mems {
		if m != nil {
			if err := freeMemory(m); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := freeMemory(make([]byte, 1)); err == nil {
		t.Fatal("freed Go memory")
	}
}
