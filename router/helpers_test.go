package router

import "fmt"

// backendsCfg makes n backends of role named <prefix>0.. with max_inflight maxInflight.
func backendsCfg(role Role, prefix string, n, maxInflight int) []BackendConfig {
	var out []BackendConfig
	for i := range n {
		out = append(out, BackendConfig{
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
		b := newBackend(BackendConfig{
			Name: fmt.Sprintf("b%d", i), URL: fmt.Sprintf("http://10.0.0.%d:8000", i+1),
			Role: RoleDecode, Weight: 1, MaxInflight: 1000, Engine: EngineVLLM,
		}, nil, nil)
		b.st.inflight.Store(n)
		out = append(out, b)
	}
	return out
}
