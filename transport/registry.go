package transport

import (
	"fmt"
	"slices"
	"sync"
)

var (
	mu        sync.RWMutex
	providers = map[string]Provider{}
)

// Register makes a provider available by name. It panics if called twice
// with the same name or with a nil provider, as database/sql.Register does:
// both are programming errors in an init function.
func Register(p Provider) {
	if p == nil {
		panic("transport: Register of nil provider")
	}
	mu.Lock()
	defer mu.Unlock()
	if _, dup := providers[p.Name()]; dup {
		panic("transport: Register called twice for provider " + p.Name())
	}
	providers[p.Name()] = p
}

// Get returns the registered provider called name.
func Get(name string) (Provider, error) {
	mu.RLock()
	p, ok := providers[name]
	mu.RUnlock()
	if !ok {
		hint := "the providers of rdmagrpc are verbs and shm"
		if name == "verbs" || name == "shm" {
			hint = fmt.Sprintf(`import its package: import _ "github.com/rdmagrpc/rdmagrpc/transport/%s"`, name)
		}
		return nil, fmt.Errorf("transport: provider %q not registered (registered: %v; %s)", name, Providers(), hint)
	}
	return p, nil
}

// Registered says whether a provider of that name is registered; unlike
// Get it builds no error, for a caller that asks on every dial.
func Registered(name string) bool {
	mu.RLock()
	defer mu.RUnlock()
	_, ok := providers[name]
	return ok
}

// Providers returns the names of the registered providers, sorted.
func Providers() []string {
	mu.RLock()
	defer mu.RUnlock()
	names := make([]string, 0, len(providers))
	for n := range providers {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}
