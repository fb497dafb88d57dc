package router

import (
	"fmt"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// backendsCfg makes n backends of role named <prefix>0.. with max_inflight maxInflight.
func backendsCfg(role routerconfig.Role, prefix string, n, maxInflight int) []routerconfig.BackendConfig {
	var out []routerconfig.BackendConfig
	for i := range n {
		out = append(out, routerconfig.BackendConfig{
			Name:        fmt.Sprintf("%s%d", prefix, i),
			URL:         fmt.Sprintf("http://127.0.0.1:%d", 10000+i+len(prefix)*100),
			Role:        role,
			MaxInflight: maxInflight,
		})
	}
	return out
}

// testBackends makes detached backends for policy tests: no router, no network.
func testBackends(inflight ...int64) []*Backend {
	var out []*Backend
	for i, n := range inflight {
		b := newBackend(routerconfig.BackendConfig{
			Name: fmt.Sprintf("b%d", i), URL: fmt.Sprintf("http://10.0.0.%d:8000", i+1),
			Role: routerconfig.RoleDecode, Weight: 1, MaxInflight: 1000, Engine: "vllm",
		}, bareEngine("vllm"), nil, nil)
		b.st.inflight.Store(n)
		out = append(out, b)
	}
	return out
}

// testEngines is an engine catalog as cmd/proxy's would be, for tests of what the router does
// with one: two kinds, "" meaning vllm.
type testEngines struct{}

type testEngine struct {
	kind string
	hold time.Duration
}

func (e testEngine) Kind() string                 { return e.kind }
func (e testEngine) KVHoldTimeout() time.Duration { return e.hold }

func (testEngines) Engine(kind string) (routerconfig.Engine, bool) {
	switch kind {
	case "", "vllm":
		return testEngine{"vllm", 480 * time.Second}, true
	case "sim":
		return testEngine{"sim", 480 * time.Second}, true
	}
	return nil, false
}

func (testEngines) Kinds() []string { return []string{"vllm", "sim"} }

// bareEngine is the engine of kind as a router without a catalog takes it: a name, and no
// hold timeout of its own.
func bareEngine(kind string) routerconfig.Engine {
	e, _ := routerconfig.EngineOf(nil, kind)
	return e
}
