package conn

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A listener whose application does not call Accept set up every dial
// and kept it: a burst pinned memory without bound. Beyond the backlog a
// dial is now refused at once, saying why; Accept makes room again.
func TestAcceptBacklog(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := Listen(ctx, testAddr(), WithBacklog(2))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var dialed []*Conn
	defer func() {
		for _, c := range dialed {
			c.Close()
		}
	}()
	for i := range 2 {
		c, err := Dial(ctx, l.Addr().String())
		if err == nil {
			err = c.(*Conn).Handshake(ctx)
		}
		if err != nil {
			t.Fatalf("dial %d within the backlog: %v", i, err)
		}
		dialed = append(dialed, c.(*Conn))
	}
	start := time.Now()
	// The first dial learned that the listener offers RDMA: this one
	// goes to it directly and returns once its request is sent; the
	// refusal comes with the first call, here Handshake.
	c, err := Dial(ctx, l.Addr().String())
	if err == nil {
		err = c.(*Conn).Handshake(ctx)
		c.Close()
		if err == nil {
			t.Fatal("a dial beyond the backlog succeeded")
		}
	}
	if !errors.Is(err, ErrBacklogFull) {
		t.Fatalf("dial beyond the backlog: %v, want it to say the backlog is full", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("refusal took %v", d)
	}
	t.Logf("refused: %v", err)
	a, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	c, err = Dial(ctx, l.Addr().String())
	if err == nil {
		err = c.(*Conn).Handshake(ctx)
	}
	if err != nil {
		t.Fatalf("dial after Accept made room: %v", err)
	}
	dialed = append(dialed, c.(*Conn))
	if _, err := WithBacklogValidate(0); err == nil {
		t.Error("a backlog of 0 was accepted")
	}
}

// WithBacklogValidate applies WithBacklog(n) to the defaults and validates.
func WithBacklogValidate(n int) (*options, error) {
	o := defaults()
	WithBacklog(n)(&o)
	return &o, o.validate()
}
