package router

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// fakeClock drives ejection timing without sleeping.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// waitFor polls cond until it holds or the deadline passes; the deadline is generous
// because it only bounds a failure, it does not measure speed.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// metricValue returns the value of the series name{labels}, and whether it exists.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !labelsMatch(m, labels) {
				continue
			}
			switch {
			case m.Gauge != nil:
				return m.Gauge.GetValue(), true
			case m.Counter != nil:
				return m.Counter.GetValue(), true
			case m.Histogram != nil:
				return float64(m.Histogram.GetSampleCount()), true
			}
		}
	}
	return 0, false
}

func labelsMatch(m *dto.Metric, want map[string]string) bool {
	got := map[string]string{}
	for _, lp := range m.GetLabel() {
		got[lp.GetName()] = lp.GetValue()
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

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
			Role: RoleDecode, Weight: 1, MaxInflight: 1000, Engine: "vllm",
		}, opaqueEngine("vllm"), nil, nil)
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

func (testEngines) Engine(kind string) (Engine, bool) {
	switch kind {
	case "", "vllm":
		return testEngine{"vllm", 480 * time.Second}, true
	case "sim":
		return testEngine{"sim", 480 * time.Second}, true
	}
	return nil, false
}

func (testEngines) Kinds() []string { return []string{"vllm", "sim"} }
