// quiet is a service the way users write one: it imports conn and the
// verbs provider, listens with the default provider choice, dials itself,
// echoes a message and exits. TestQuietByDefault requires that it print
// nothing unless RDMAGRPC_LOG asks.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

func main() {
	if err := run(); err != nil {
		// Only a failure speaks, with a non-zero status the test reports.
		fmt.Fprintln(os.Stderr, "quiet:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	l, err := conn.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.Copy(c, c)
	}()
	c, err := conn.Dial(ctx, l.Addr().String())
	if err != nil {
		return err
	}
	defer c.Close()
	msg := []byte("hello")
	if _, err := c.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if string(got) != string(msg) {
		return fmt.Errorf("echo %q, want %q", got, msg)
	}
	return nil
}
