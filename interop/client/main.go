// Command client runs grpc-go's interop test cases against an interop
// server over rdmagrpc.
//
//	client --server_host 127.0.0.1 --server_port 10000 --test_case all
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"strconv"
	"strings"

	"github.com/rdmagrpc/rdmagrpc/conn"
	"github.com/rdmagrpc/rdmagrpc/interop"
	_ "github.com/rdmagrpc/rdmagrpc/transport/verbs"
)

func main() {
	host := flag.String("server_host", "127.0.0.1", "the server's address")
	port := flag.Int("server_port", 10000, "the server's port")
	cases := flag.String("test_case", "all", "comma-separated cases, or all: "+names())
	provider := flag.String("provider", "", `transport provider, "verbs" or "shm"; default: verbs when a device exists, else shm`)
	flag.Parse()
	sel, err := interop.Select(*cases)
	if err != nil {
		log.Fatal(err)
	}
	var opts []conn.Option
	if *provider != "" {
		opts = append(opts, conn.WithProvider(*provider))
	}
	if err := interop.Run(context.Background(), net.JoinHostPort(*host, strconv.Itoa(*port)), sel, os.Stdout, opts...); err != nil {
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
