package transporttest

import (
	"context"
	"slices"
	"testing"
)

type testCase struct {
	name string
	// local is the half run by the test; it listens (env.l) when peer is set.
	local func(t *testing.T, e *env)
	// peer is the half that connects; nil for cases with one half.
	peer func(ctx context.Context, p *peer) error
	// crossOnly cases need the peer in another process (it dies).
	crossOnly bool
	// peerExits: the peer process ends abruptly, its exit status is moot.
	peerExits bool
}

var cases = slices.Concat(cmCases, dataCases, errorCases, cqCases, loadCases)

func findCase(name string) *testCase {
	for _, c := range cases {
		if c.name == name {
			return c
		}
	}
	return nil
}

// Names lists the suite's cases, for documentation and counting.
func Names() []string {
	n := make([]string, len(cases))
	for i, c := range cases {
		n[i] = c.name
	}
	return n
}
