package bufpool

import (
	"errors"
	"fmt"
	"slices"
)

// Close deregisters and frees every free buffer and revokes the
// registration of every buffer still held, so that no peer can reach that
// memory any more and the PD can be closed. Held buffers stay mapped (the
// holder may still be reading them) and are freed when released. Close
// returns an error naming how many buffers, bytes and owners were still
// out, and any earlier release failures. Calling it again retries
// deregistrations that failed and reports what is still out.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.budget.leave(p)
	// No Get starts a registration once closed is set; wait for those
	// already running, which see closed and undo themselves.
	p.pending.Wait()

	p.mu.Lock()
	var victims []*region
	for k, l := range p.free {
		victims = append(victims, l...)
		delete(p.free, k)
	}
	p.freeBufs, p.freeBytes = 0, 0
	// A region whose Dereg failed earlier may still be held: retry its
	// deregistration, but only free it if nobody holds it.
	for _, r := range p.stuck {
		if r.heldAt < 0 {
			victims = append(victims, r)
		}
	}
	p.stuck = nil
	var held []*region
	owners := map[Owner]bool{}
	var heldBytes int64
	for _, r := range p.held {
		owners[r.owner] = true
		heldBytes += int64(r.size)
		if r.registered {
			held = append(held, r)
		}
	}
	nheld := len(p.held)
	errs := p.errs
	p.errs = nil
	p.mu.Unlock()

	for _, r := range victims {
		errs = append(errs, p.destroy(r))
	}
	for _, r := range held {
		errs = append(errs, p.deregister(r))
	}
	if nheld > 0 {
		ids := make([]Owner, 0, len(owners))
		for o := range owners {
			ids = append(ids, o)
		}
		slices.Sort(ids)
		const show = 8
		more := ""
		if len(ids) > show {
			more = fmt.Sprintf(" and %d more", len(ids)-show)
			ids = ids[:show]
		}
		errs = append(errs, fmt.Errorf("bufpool: close: %d buffers (%d bytes) still held by owners %v%s; their registrations are revoked and their memory is freed when released", nheld, heldBytes, ids, more))
	}
	return errors.Join(errs...)
}
