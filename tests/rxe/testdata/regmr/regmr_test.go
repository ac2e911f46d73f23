package main

import (
	"os"
	"testing"
)

// TestRegMR is run inside the guest as a `go test -c` binary, the way the
// transport tests run there.
func TestRegMR(t *testing.T) {
	if err := run(os.Getenv("RXE_DEV"), 64<<10); err != nil {
		t.Fatal(err)
	}
}
