// Command client runs grpc-go's interop test cases against an interop
// server over rdmagrpc.
//
//	client --server_host 127.0.0.1 --server_port 10000 --test_case all \
//	       [--use_tls --ca_file ca.pem --server_host_override name \
//	        [--client_cert_file client.pem --client_key_file client.key]]
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"strconv"
	"strings"

	"google.golang.org/grpc/credentials"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/interop"
	_ "github.com/rdmagrpc/rdmagrpc/transport/shm"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

func main() {
	host := flag.String("server_host", "127.0.0.1", "the server's address")
	port := flag.Int("server_port", 10000, "the server's port")
	cases := flag.String("test_case", "all", "comma-separated cases, or all: "+names())
	provider := flag.String("provider", "", `transport provider, "verbs" or "shm"; default: verbs when a device exists, else shm`)
	useTLS := flag.Bool("use_tls", false, "connect with TLS")
	caFile := flag.String("ca_file", "", "PEM file of the CAs to trust with TLS (default: the system's)")
	override := flag.String("server_host_override", "", "the name to check in the server's certificate (default: server_host)")
	certFile := flag.String("client_cert_file", "", "PEM file of a client certificate, for mutual TLS")
	keyFile := flag.String("client_key_file", "", "PEM file of the client certificate's key")
	flag.Parse()
	var creds credentials.TransportCredentials
	if *useTLS {
		name := *override
		if name == "" {
			name = *host
		}
		var err error
		if creds, err = interop.ClientTLS(*caFile, name, *certFile, *keyFile); err != nil {
			log.Fatal(err)
		}
	}
	sel, err := interop.Select(*cases)
	if err != nil {
		log.Fatal(err)
	}
	var opts []conn.Option
	if *provider != "" {
		opts = append(opts, conn.WithProvider(*provider))
	}
	if err := interop.Run(context.Background(), net.JoinHostPort(*host, strconv.Itoa(*port)), sel, os.Stdout, creds, opts...); err != nil {
		log.Fatal(err)
	}
}

func names() string {
	var n []string
	for _, c := range interop.Cases {
		n = append(n, c.Name)
	}
	return strings.Join(n, ", ")
}
