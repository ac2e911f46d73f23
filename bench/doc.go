// Package bench is the side-by-side benchmark behind `make bench`: grpc-go
// over TCP loopback, over a unix socket and over rdmagrpc, measured in one
// process and one run, in interleaved rounds whose medians are reported
// with their ratios to TCP as a markdown table.
//
// Everything printed is measured in the run that prints it. Client and
// server share the process, so CPU time per RPC (getrusage, user+sys,
// divided by the RPC count) is the cost of both ends of the call.
package bench
