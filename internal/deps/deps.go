// Package deps pins the modules named by the mission until the packages
// that use them land; it is deleted once each is imported for real.
package deps

import (
	_ "github.com/cilium/ebpf"
	_ "go.opentelemetry.io/otel"
	_ "go.opentelemetry.io/otel/sdk/metric"
	_ "go.opentelemetry.io/otel/sdk/trace"
	_ "go.uber.org/goleak"
	_ "golang.org/x/net/nettest"
	_ "golang.org/x/sys/unix"
	_ "google.golang.org/grpc"
	_ "google.golang.org/grpc/interop"
)
