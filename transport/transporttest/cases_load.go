package transporttest

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"sync"
	"testing"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

const (
	loadConns = 4
	loadMsgs  = 300
	loadSize  = 256
	loadDepth = 16
)

// Concurrency: several connections, each with its own goroutines posting
// and polling at once on both sides; every message checksummed and in order.
var loadCases = []*testCase{
	{
		name: "ConcurrentConnections",
		local: func(t *testing.T, e *env) {
			eps := make([]*endpoint, loadConns)
			for i := range eps {
				eps[i] = e.accept(setup{}, nil)
				for s := range loadDepth {
					if err := eps[i].postRecv(uint64(s), eps[i].sge(s*loadSize, loadSize)); err != nil {
						t.Fatal(err)
					}
				}
			}
			e.send("go")
			var wg sync.WaitGroup
			errs := make(chan error, loadConns)
			for _, ep := range eps {
				wg.Go(func() { errs <- receiveChecked(e.ctx(), ep) })
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Error(err)
				}
			}
		},
		peer: func(ctx context.Context, p *peer) error {
			eps := make([]*endpoint, loadConns)
			for i := range eps {
				ep, err := p.connect(ctx, setup{}, nil)
				if err != nil {
					return err
				}
				defer ep.close()
				eps[i] = ep
			}
			if _, err := p.ctl.expect(ctx, "go"); err != nil {
				return err
			}
			var wg sync.WaitGroup
			errs := make(chan error, loadConns)
			for _, ep := range eps {
				wg.Go(func() { errs <- sendChecked(ctx, ep) })
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					return err
				}
			}
			return p.awaitBye(ctx)
		},
	},
}

// sendChecked sends loadMsgs messages (sequence, payload, CRC) keeping at
// most loadDepth in flight; the receiver's RNR retries absorb its reposts.
func sendChecked(ctx context.Context, ep *endpoint) error {
	inflight := 0
	for i := range loadMsgs {
		for inflight >= loadDepth {
			if _, err := poll(ctx, ep.scq, 1); err != nil {
				return err
			}
			inflight--
		}
		slot := i % (loadDepth * 2)
		m := ep.mem[slot*loadSize : (slot+1)*loadSize]
		binary.LittleEndian.PutUint32(m, uint32(i))
		fill(m[4:loadSize-4], byte(i))
		binary.LittleEndian.PutUint32(m[loadSize-4:], crc32.ChecksumIEEE(m[:loadSize-4]))
		if err := ep.postSend(transport.SendWR{ID: uint64(i), Opcode: transport.OpSend, SG: []transport.SGE{ep.sge(slot*loadSize, loadSize)}, Signaled: true}); err != nil {
			return err
		}
		inflight++
	}
	wcs, err := poll(ctx, ep.scq, inflight)
	if err != nil {
		return err
	}
	for _, wc := range wcs {
		if wc.Status != transport.StatusSuccess {
			return wc.Err()
		}
	}
	return nil
}

func receiveChecked(ctx context.Context, ep *endpoint) error {
	for i := range loadMsgs {
		wcs, err := poll(ctx, ep.rcq, 1)
		if err != nil {
			return fmt.Errorf("message %d: %w", i, err)
		}
		wc := wcs[0]
		if wc.Status != transport.StatusSuccess || wc.ByteLen != loadSize {
			return fmt.Errorf("message %d: %+v", i, wc)
		}
		slot := int(wc.ID)
		m := ep.mem[slot*loadSize : (slot+1)*loadSize]
		if seq := binary.LittleEndian.Uint32(m); seq != uint32(i) {
			return fmt.Errorf("message %d arrived as %d: out of order", i, seq)
		}
		if crc32.ChecksumIEEE(m[:loadSize-4]) != binary.LittleEndian.Uint32(m[loadSize-4:]) {
			return fmt.Errorf("message %d: checksum mismatch", i)
		}
		if err := ep.postRecv(wc.ID, ep.sge(slot*loadSize, loadSize)); err != nil {
			return err
		}
	}
	return nil
}
