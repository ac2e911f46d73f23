// Command connenlarge makes real rdmagrpc connections enlarge, for the
// bpf tests: after a line on stdin it opens n connection pairs over the
// shm provider, writes one message above the threshold on each (so the
// writer enlarges and the reader provisions: two enlargementMarker calls
// per pair), prints "done" and exits.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

func main() {
	n := flag.Int("n", 5, "connection pairs, one enlargement each")
	flag.Parse()
	fmt.Println("ready")
	if !bufio.NewScanner(os.Stdin).Scan() {
		fmt.Fprintln(os.Stderr, "connenlarge: stdin closed before the start line")
		os.Exit(1)
	}
	for i := range *n {
		if err := pair(); err != nil {
			fmt.Fprintf(os.Stderr, "connenlarge: pair %d: %v\n", i, err)
			os.Exit(1)
		}
	}
	fmt.Println("done")
}

func pair() error {
	ctx := context.Background()
	l, err := conn.Listen(ctx, "127.0.0.1:0", conn.WithProvider("shm"))
	if err != nil {
		return err
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := conn.Dial(ctx, l.Addr().String(), conn.WithProvider("shm"))
	if err != nil {
		return err
	}
	defer c.Close()
	s, ok := <-accepted
	if !ok {
		return fmt.Errorf("accept failed")
	}
	defer s.Close()
	msg := make([]byte, 64<<10)
	done := make(chan error, 1)
	go func() { _, err := io.ReadFull(s, make([]byte, len(msg))); done <- err }()
	if _, err := c.Write(msg); err != nil {
		return err
	}
	return <-done
}
