package transport

import (
	"strings"
	"testing"
)

// A provider not registered is answered with a package that exists to
// import, or with the providers there are: never a made-up path.
func TestGetUnregisteredHint(t *testing.T) {
	_, err := Get("verbs")
	if err == nil || !strings.Contains(err.Error(), `import _ "github.com/rdmagrpc/rdmagrpc/transport/verbs"`) {
		t.Errorf("Get(verbs) unregistered: %v", err)
	}
	_, err = Get("VERBS")
	if err == nil || strings.Contains(err.Error(), "transport/VERBS") || !strings.Contains(err.Error(), "the providers of rdmagrpc are verbs and shm") {
		t.Errorf("Get(VERBS): %v", err)
	}
}
