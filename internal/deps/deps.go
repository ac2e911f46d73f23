// Package deps pins the OpenTelemetry modules named by the mission until
// the instrumentation that uses them lands (issue 6); it is deleted then.
package deps

import (
	_ "go.opentelemetry.io/otel"
	_ "go.opentelemetry.io/otel/sdk/metric"
	_ "go.opentelemetry.io/otel/sdk/trace"
)
