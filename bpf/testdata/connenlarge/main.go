// Command connenlarge makes real rdmagrpc connections enlarge, for the
// bpf tests: after a line on stdin it opens n connection pairs over the
// shm provider, writes one message above the threshold on each (so the
// writer enlarges and the reader provisions: two enlargementMarker calls
// per pair), prints "done" and exits. With -shrink, each pair then idles
// until the writer's direction shrank back (two more marker calls). With
// -park, the message is a small one instead, and each pair idles until
// the writer's direction parked and the reader released its ring (two
// marker calls, and no enlargement).
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/rdmagrpc/rdmagrpc/conn"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
)

func main() {
	n := flag.Int("n", 5, "connection pairs, one enlargement each")
	flag.BoolVar(&shrink, "shrink", false, "wait for each pair's idle shrink")
	flag.BoolVar(&park, "park", false, "write a small message and wait for each pair's park")
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

var shrink, park bool

func pair() error {
	ctx := context.Background()
	opts := []conn.Option{conn.WithProvider("shm")}
	if shrink || park {
		opts = append(opts, conn.WithIdleShrink(20*time.Millisecond))
	}
	l, err := conn.Listen(ctx, "127.0.0.1:0", opts...)
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
	c, err := conn.Dial(ctx, l.Addr().String(), opts...)
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
	if park {
		msg = msg[:100]
	}
	done := make(chan error, 1)
	go func() { _, err := io.ReadFull(s, make([]byte, len(msg))); done <- err }()
	if _, err := c.Write(msg); err != nil {
		return err
	}
	if err := <-done; err != nil || !shrink && !park {
		return err
	}
	if park {
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
			if c.(*conn.Conn).Stats().Parks == 1 && s.(*conn.Conn).Stats().ParksServed == 1 {
				return nil
			}
		}
		return fmt.Errorf("no park within 5 s")
	}
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if c.(*conn.Conn).Stats().Shrinks == 1 && s.(*conn.Conn).Stats().ShrinksServed == 1 {
			return nil
		}
	}
	return fmt.Errorf("no shrink within 5 s")
}
