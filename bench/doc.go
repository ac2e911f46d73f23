// Package bench is the side-by-side benchmark behind `make bench`: grpc-go
// over TCP loopback, over a unix socket and over rdmagrpc, measured in one
// run, in interleaved rounds whose medians are reported with their ratios
// to TCP as markdown tables.
//
// Every figure of the main table is measured with client and server in
// two processes (the server is this binary re-executed), as services run;
// CPU time per RPC (getrusage of both processes, user+sys, divided by the
// RPC count) is the cost of both ends of the call. The one-process
// figures follow as a second table (Config.OneProcess). Everything printed
// is measured in the run that prints it.
package bench
