package transport

import "slices"

// Reasons a listener gives when it rejects a connection request: each is
// a prefix of the reject's private data, which the reason's text may
// follow (doc/protocol.md, "Hello and reject reasons"). A dialer that
// finds none knows only that it was rejected. They live here, not in a
// provider, because the listener that decides (conn's backlog, a
// provider's peer check) and the dialer that reports them are on
// different layers.
var (
	// RejectPeerRefused: the listener's peer check refused the dialing
	// process; its reason follows.
	RejectPeerRefused = []byte{'R', 'D', 'M', 'G', 0xff, 'p', 'e', 'e', 'r', ':'}
	// RejectListenerFailed: the listener could not take the request (it
	// ran out of descriptors, say); its error follows. Unlike the other
	// reasons it says nothing of the listener's will: the request may
	// succeed again.
	RejectListenerFailed = []byte{'R', 'D', 'M', 'G', 0xff, 'f', 'a', 'i', 'l', ':'}
	// RejectBacklogFull: the listener's accept backlog is full.
	RejectBacklogFull = []byte{'R', 'D', 'M', 'G', 0xff, 'b', 'l', 'o', 'g'}
)

// RejectWith is reason followed by err's text, cut to max bytes.
func RejectWith(reason []byte, err error, max int) []byte {
	b := append(slices.Clone(reason), err.Error()...)
	return b[:min(len(b), max)]
}
