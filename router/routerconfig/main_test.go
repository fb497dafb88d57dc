package routerconfig

import (
	"maps"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// catalog is an engine catalog as cmd/proxy's would be: each kind's hold timeout, "" meaning
// vllm.
type catalog map[string]time.Duration

// testEngines is the catalog of the tests: vllm and sim, each holding KV 480s.
var testEngines = catalog{"vllm": 480 * time.Second, "sim": 480 * time.Second}

type kind struct {
	name string
	hold time.Duration
}

func (k kind) Kind() string                 { return k.name }
func (k kind) KVHoldTimeout() time.Duration { return k.hold }

func (c catalog) Engine(name string) (Engine, bool) {
	if name == "" {
		name = "vllm"
	}
	hold, ok := c[name]
	return kind{name, hold}, ok
}

func (c catalog) Kinds() []string { return slices.Sorted(maps.Keys(c)) }
