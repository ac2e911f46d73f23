package bufpool

import (
	"fmt"
	"math/bits"
)

// classOf returns the class index and class size for a request of size
// bytes: the smallest power of two >= size, at least the pool's smallest.
func (p *Pool) classOf(size int) (int, int, error) {
	if size <= 0 || size > p.maxSize {
		return 0, 0, fmt.Errorf("%w: %d bytes requested, classes are %d..%d", ErrSize, size, p.minSize, p.maxSize)
	}
	if size <= p.minSize {
		return 0, p.minSize, nil
	}
	shift := bits.Len(uint(size - 1))
	return shift - p.minShift, 1 << shift, nil
}

// ClassSize returns the size of the class a Get of size bytes is served
// from, so that callers can size protocol fields to what they will get.
func (p *Pool) ClassSize(size int) (int, error) {
	_, c, err := p.classOf(size)
	return c, err
}

// Classes returns the class sizes, smallest first.
func (p *Pool) Classes() []int {
	var out []int
	for c := p.minSize; c <= p.maxSize; c <<= 1 {
		out = append(out, c)
	}
	return out
}

func isPow2(n int) bool { return n > 0 && n&(n-1) == 0 }
