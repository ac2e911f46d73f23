package fault

import (
	"errors"
	"fmt"
	"sync"

	"github.com/rdmagrpc/rdmagrpc/transport"
)

// stager keeps the registered memory corrupted copies are sent from, per
// PD (an lkey is only valid in its PD). Buffers are reused by power-of-two
// size so that a corruption rule firing often does not register often.
type stager struct {
	mu     sync.Mutex
	free   map[int][]*stageBuf
	byKey  map[uint32]*stageBuf
	out    int
	closed bool
}

type stageBuf struct {
	mem  []byte
	mr   transport.MR
	size int
}

func (s *stager) get(dev transport.Device, p transport.PD, n int) (*stageBuf, error) {
	size := 4096
	for size < n {
		size <<= 1
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("PD closed")
	}
	if l := s.free[size]; len(l) > 0 {
		b := l[len(l)-1]
		s.free[size] = l[:len(l)-1]
		s.out++
		s.mu.Unlock()
		return b, nil
	}
	s.mu.Unlock()
	mem, err := dev.AllocMemory(size)
	if err != nil {
		return nil, fmt.Errorf("staging memory: %w", err)
	}
	// Registered on the inner PD: staging is the injector's own
	// machinery and must not be subject to its registration rules.
	m, err := p.RegMR(mem, transport.AccessLocalWrite)
	if err != nil {
		dev.FreeMemory(mem)
		return nil, fmt.Errorf("staging memory: %w", err)
	}
	b := &stageBuf{mem: mem, mr: m, size: size}
	s.mu.Lock()
	if s.byKey == nil {
		s.byKey = map[uint32]*stageBuf{}
		s.free = map[int][]*stageBuf{}
	}
	s.byKey[m.LKey()] = b
	s.out++
	s.mu.Unlock()
	return b, nil
}

func (s *stager) put(b *stageBuf) {
	if b == nil {
		return
	}
	s.mu.Lock()
	s.out--
	s.free[b.size] = append(s.free[b.size], b)
	s.mu.Unlock()
}

func (s *stager) lookup(lkey uint32) transport.MR {
	s.mu.Lock()
	defer s.mu.Unlock()
	if b := s.byKey[lkey]; b != nil {
		return b.mr
	}
	return nil
}

// close deregisters and frees the staging memory; it fails while copies
// are still in flight (their QP is not closed yet).
func (s *stager) close(dev transport.Device) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.out > 0 {
		return fmt.Errorf("%d corrupted copies still in flight (close the QPs first)", s.out)
	}
	s.closed = true
	var errs []error
	for _, l := range s.free {
		for _, b := range l {
			errs = append(errs, b.mr.Dereg(), dev.FreeMemory(b.mem))
		}
	}
	s.free, s.byKey = nil, nil
	return errors.Join(errs...)
}
