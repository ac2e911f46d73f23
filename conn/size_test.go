package conn

import (
	"testing"
	"unsafe"
)

// Every idle connection end holds a Conn: the idle-memory goal counts its bytes. Go
// allocates it in the smallest size class that fits it and, as it holds
// pointers and is over 512 B, an 8 B header: a field that pushes it past
// 1,784 B costs 256 B per end, not its own size.
func TestConnSize(t *testing.T) {
	if n := unsafe.Sizeof(rdmaConn{}); n+8 > 1792 {
		t.Fatalf("Conn is %d B: with its malloc header, past the 1,792 B allocation class: derive the field from others, or make it lazy", n)
	}
}
