// Command server is grpc-go's interop TestService server over rdmagrpc.
//
//	server --port 10000 [--host 0.0.0.0] [--provider verbs|shm]
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"strconv"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/interop"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

func main() {
	host := flag.String("host", "127.0.0.1", "address to listen on (an address of an RDMA device's netdev for verbs)")
	port := flag.Int("port", 10000, "port to listen on; 0 picks one (printed)")
	provider := flag.String("provider", "", `transport provider, "verbs" or "shm"; default: verbs when a device exists, else shm`)
	flag.Parse()
	var opts []conn.Option
	if *provider != "" {
		opts = append(opts, conn.WithProvider(*provider))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	l, err := interop.Listen(ctx, net.JoinHostPort(*host, strconv.Itoa(*port)), opts...)
	if err != nil {
		log.Fatal(err)
	}
	s := interop.NewServer()
	go func() {
		<-ctx.Done()
		s.GracefulStop()
	}()
	fmt.Println(l.Addr())
	if err := s.Serve(l); err != nil {
		log.Fatal(err)
	}
}
