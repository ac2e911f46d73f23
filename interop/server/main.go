// Command server is grpc-go's interop TestService server over rdmagrpc.
//
//	server --port 10000 [--host 0.0.0.0] [--provider verbs|shm] \
//	       [--use_tls --tls_cert_file server.pem --tls_key_file server.key [--client_ca_file ca.pem]]
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

	"google.golang.org/grpc"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/interop"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

func main() {
	host := flag.String("host", "127.0.0.1", "address to listen on (an address of an RDMA device's netdev for verbs)")
	port := flag.Int("port", 10000, "port to listen on; 0 picks one (printed)")
	provider := flag.String("provider", "", `transport provider, "verbs" or "shm"; default: verbs when a device exists, else shm`)
	useTLS := flag.Bool("use_tls", false, "serve with TLS")
	certFile := flag.String("tls_cert_file", "", "PEM file of the server's certificate")
	keyFile := flag.String("tls_key_file", "", "PEM file of the server's key")
	clientCA := flag.String("client_ca_file", "", "PEM file of the CAs whose client certificates are required (mutual TLS)")
	flag.Parse()
	var sopts []grpc.ServerOption
	if *useTLS {
		creds, err := interop.ServerTLS(*certFile, *keyFile, *clientCA)
		if err != nil {
			log.Fatal(err)
		}
		sopts = append(sopts, grpc.Creds(creds))
	}
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
	s := interop.NewServer(sopts...)
	go func() {
		<-ctx.Done()
		s.GracefulStop()
	}()
	fmt.Println(l.Addr())
	if err := s.Serve(l); err != nil {
		log.Fatal(err)
	}
}
