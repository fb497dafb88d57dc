package router

import (
	"context"
	"errors"
	"net/http"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/h1client"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// newTestRouter builds a router over cfg with a fresh registry and a fake clock; checks
// are off unless cfg turns them on, so tests drive health by hand.
func newTestRouter(t *testing.T, cfg routerconfig.Config) (*Router, *prometheus.Registry, *testutil.Clock) {
	t.Helper()
	if cfg.Health.Interval == 0 {
		cfg.Health.Interval = -1
	}
	reg := prometheus.NewRegistry()
	r, err := New(cfg, zaptest.NewLogger(t), reg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	clk := testutil.NewClock(time.Unix(1_700_000_000, 0))
	r.now = clk.Now
	return r, reg, clk
}

func backendByName(t *testing.T, r *Router, name string) *Backend {
	t.Helper()
	for _, b := range r.backends() {
		if b.Name == name {
			return b
		}
	}
	t.Fatalf("no backend %q", name)
	return nil
}

func queued(r *Router, role routerconfig.Role) int {
	p := r.pool(role)
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waiters.Len()
}

func mustAcquire(t *testing.T, r *Router, role routerconfig.Role, h Hint) *Lease {
	t.Helper()
	l, err := r.Acquire(context.Background(), role, h)
	if err != nil {
		t.Fatalf("Acquire(%s): %v", role, err)
	}
	return l
}

func assertAllIdle(t *testing.T, r *Router) {
	t.Helper()
	for _, b := range r.Backends() {
		if b.Inflight != 0 {
			t.Errorf("%s inflight = %d, want 0", b.Name, b.Inflight)
		}
	}
}

func TestAcquireCountsOneInflightUntilRelease(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0)})
	l1 := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	l2 := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	if l1.Backend() == l2.Backend() {
		t.Fatalf("least_inflight put both on %s", l1.Backend().Name)
	}
	if n := l1.Backend().Inflight(); n != 1 {
		t.Errorf("inflight while leased = %d, want 1", n)
	}
	l1.Release(Result{Status: 200})
	l1.Release(Result{Status: 500}) // a second Release is a no-op
	l2.Release(Result{Status: 200})
	assertAllIdle(t, r)
	var nilLease *Lease
	nilLease.Release(Result{}) // safe
	if nilLease.Backend() != nil {
		t.Error("nil lease has a backend")
	}
}

func TestAcquireSkipsIneligibleBackends(t *testing.T) {
	tests := []struct {
		name  string
		setup func(t *testing.T, r *Router) Hint
	}{
		{"full backend is skipped", func(t *testing.T, r *Router) Hint {
			backendByName(t, r, "d0").st.inflight.Store(1)
			t.Cleanup(func() { backendByName(t, r, "d0").st.inflight.Store(0) })
			return Hint{}
		}},
		{"unhealthy backend is skipped", func(t *testing.T, r *Router) Hint {
			backendByName(t, r, "d0").st.up.Store(false)
			return Hint{}
		}},
		{"ejected backend is skipped", func(t *testing.T, r *Router) Hint {
			b := backendByName(t, r, "d0")
			b.st.ejectedUntil.Store(r.now().Add(time.Second).UnixNano())
			return Hint{}
		}},
		{"excluded backend is skipped", func(t *testing.T, r *Router) Hint {
			return Hint{Exclude: []string{"d0"}}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 1)})
			h := tt.setup(t, r)
			l := mustAcquire(t, r, routerconfig.RoleDecode, h)
			defer l.Release(Result{Status: 200})
			if got := l.Backend().Name; got != "d1" {
				t.Errorf("picked %s, want d1", got)
			}
		})
	}
}

func TestAcquireWithoutUsableBackendIsErrNoBackend(t *testing.T) {
	tests := []struct {
		name  string
		role  routerconfig.Role
		setup func(r *Router) Hint
	}{
		{"every backend down", routerconfig.RoleDecode, func(r *Router) Hint {
			for _, b := range r.backends() {
				b.st.up.Store(false)
			}
			return Hint{}
		}},
		{"every backend ejected", routerconfig.RoleDecode, func(r *Router) Hint {
			for _, b := range r.backends() {
				b.st.ejectedUntil.Store(r.now().Add(time.Minute).UnixNano())
			}
			return Hint{}
		}},
		{"every backend excluded", routerconfig.RoleDecode, func(*Router) Hint { return Hint{Exclude: []string{"d0", "d1"}} }},
		{"role not configured", routerconfig.RolePrefill, func(*Router) Hint { return Hint{} }},
		{"unknown role", routerconfig.Role("embed"), func(*Router) Hint { return Hint{} }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0)})
			h := tt.setup(r)
			l, err := r.Acquire(context.Background(), tt.role, h)
			if !errors.Is(err, ErrNoBackend) {
				t.Fatalf("Acquire = %v, %v; want ErrNoBackend", l, err)
			}
			if queued(r, routerconfig.RoleDecode) != 0 {
				t.Error("a request with no backend was queued")
			}
		})
	}
}

func TestAcquireWithDoneContextFailsAtOnce(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0)})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire = %v, want context.Canceled", err)
	}
	assertAllIdle(t, r)
}

func TestHasReadyAndMinKVHoldTimeout(t *testing.T) {
	cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{Name: "p0", URL: "http://p0:1", Role: routerconfig.RolePrefill, KVHoldTimeout: 90 * time.Second},
		{Name: "p1", URL: "http://p1:1", Role: routerconfig.RolePrefill},
		{Name: "d0", URL: "http://d0:1", Role: routerconfig.RoleDecode, Engine: "sim"},
	}, Engines: testEngines{}}
	r, _, _ := newTestRouter(t, cfg)
	if !r.Has(routerconfig.RolePrefill) || !r.Has(routerconfig.RoleDecode) || r.Has("other") {
		t.Error("Has disagrees with config")
	}
	if got := r.MinKVHoldTimeout(routerconfig.RolePrefill); got != 90*time.Second {
		t.Errorf("MinKVHoldTimeout(prefill) = %v, want 90s", got)
	}
	if got := r.MinKVHoldTimeout(routerconfig.RoleDecode); got != 480*time.Second {
		t.Errorf("MinKVHoldTimeout(decode) = %v, want 480s", got)
	}
	if !r.Ready() {
		t.Error("not ready with a healthy decoder")
	}
	backendByName(t, r, "d0").st.up.Store(false)
	if r.Ready() {
		t.Error("ready with the only decoder down")
	}

	r2, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0)})
	if r2.Has(routerconfig.RolePrefill) || r2.MinKVHoldTimeout(routerconfig.RolePrefill) != 0 {
		t.Error("decode-only router claims prefill backends")
	}
}

func TestBackendsReportsStatus(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{URL: "http://p0:8000", Role: routerconfig.RolePrefill, Engine: "sim"},
		{Name: "d0", URL: "http://d0:8000", Role: routerconfig.RoleDecode, Weight: 2, MaxInflight: 8},
	}, Engines: testEngines{}})
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	defer l.Release(Result{})
	got := r.Backends()
	want := []BackendStatus{
		{Name: "p0:8000", URL: "http://p0:8000", Role: routerconfig.RolePrefill, Healthy: true, MaxInflight: 256, Weight: 1, Engine: "sim"},
		{Name: "d0", URL: "http://d0:8000", Role: routerconfig.RoleDecode, Healthy: true, Inflight: 1, MaxInflight: 8, Weight: 2, Engine: "vllm"},
	}
	if len(got) != len(want) {
		t.Fatalf("Backends() = %+v", got)
	}
	for i := range want {
		if !reflect.DeepEqual(got[i], want[i]) {
			t.Errorf("Backends()[%d] = %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestAvailableListsTheBackendsOfARoleThatMayBePicked(t *testing.T) {
	tests := []struct {
		name  string
		role  routerconfig.Role
		setup func(t *testing.T, r *Router)
		want  []string
	}{
		{"every healthy decoder in config order", routerconfig.RoleDecode, func(*testing.T, *Router) {}, []string{"d0", "d1", "d2"}},
		{"only the role asked for", routerconfig.RolePrefill, func(*testing.T, *Router) {}, []string{"p0"}},
		{"a backend failing active checks is left out", routerconfig.RoleDecode, func(t *testing.T, r *Router) {
			backendByName(t, r, "d0").st.up.Store(false)
		}, []string{"d1", "d2"}},
		{"an ejected backend is left out", routerconfig.RoleDecode, func(t *testing.T, r *Router) {
			backendByName(t, r, "d1").st.ejectedUntil.Store(r.now().Add(time.Second).UnixNano())
		}, []string{"d0", "d2"}},
		{"a backend whose ejection ended is back", routerconfig.RoleDecode, func(t *testing.T, r *Router) {
			backendByName(t, r, "d1").st.ejectedUntil.Store(r.now().Add(-time.Second).UnixNano())
		}, []string{"d0", "d1", "d2"}},
		{"a full backend is still listed", routerconfig.RoleDecode, func(t *testing.T, r *Router) {
			l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d0", "d1"}})
			t.Cleanup(func() { l.Release(Result{Status: 200}) })
		}, []string{"d0", "d1", "d2"}},
		{"no backend of the role", routerconfig.Role("embed"), func(*testing.T, *Router) {}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := routerconfig.Config{Backends: append(backendsCfg(routerconfig.RolePrefill, "p", 1, 0), backendsCfg(routerconfig.RoleDecode, "d", 3, 1)...)}
			r, _, _ := newTestRouter(t, cfg)
			tt.setup(t, r)
			var got []string
			for _, b := range r.Available(tt.role) {
				if b != backendByName(t, r, b.Name) {
					t.Errorf("Available(%s) returned a copy of %s, not the live backend", tt.role, b.Name)
				}
				got = append(got, b.Name)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("Available(%s) = %v, want %v", tt.role, got, tt.want)
			}
		})
	}
}

func TestAvailableLeavesOutABackendThatAReloadRemoved(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0)}
	r, _, _ := newTestRouter(t, cfg)
	if err := r.Reload(routerconfig.Config{Backends: cfg.Backends[1:], Health: routerconfig.HealthConfig{Interval: -1}}); err != nil {
		t.Fatal(err)
	}
	if got := r.Available(routerconfig.RoleDecode); len(got) != 1 || got[0].Name != "d1" {
		t.Errorf("Available(decode) after removing d0 = %v, want [d1]", got)
	}
}

func TestClientTransportIsTunedPerBackend(t *testing.T) {
	for _, tc := range []struct{ client string }{{routerconfig.EngineClientStdlib}, {routerconfig.EngineClientLean}} {
		t.Run(tc.client, func(t *testing.T) {
			r, _, _ := newTestRouter(t, routerconfig.Config{EngineClient: tc.client, Backends: []routerconfig.BackendConfig{{Name: "d0", URL: "http://d0:1", Role: routerconfig.RoleDecode, MaxInflight: 32}}})
			c := backendByName(t, r, "d0").Client()
			if c.Timeout != 0 {
				t.Errorf("client Timeout = %v; streams need none", c.Timeout)
			}
			switch tr := c.Transport.(type) {
			case *http.Transport:
				if tc.client != routerconfig.EngineClientStdlib || tr.MaxIdleConnsPerHost != 32 || tr.MaxConnsPerHost != 0 || tr.ForceAttemptHTTP2 {
					t.Errorf("%s: transport = idle/host %d, conns/host %d, h2 %v", tc.client, tr.MaxIdleConnsPerHost, tr.MaxConnsPerHost, tr.ForceAttemptHTTP2)
				}
			case *h1client.Transport:
				if o := tr.Options(); tc.client != routerconfig.EngineClientLean || o.MaxIdlePerHost != 32 || o.IdleTimeout != 90*time.Second || o.DialTimeout != 3*time.Second || o.MaxResponseHeaderBytes != h1client.DefaultMaxResponseHeaderBytes {
					t.Errorf("%s: lean transport options %+v", tc.client, o)
				}
			default:
				t.Errorf("%s: transport %T", tc.client, tr)
			}
		})
	}
}

func TestOvercommitHintPicksAFullBackendInsteadOfWaiting(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{{Name: "d", URL: "http://127.0.0.1:1", Role: routerconfig.RoleDecode, MaxInflight: 1}},
		Queue:    routerconfig.QueueConfig{Size: -1},
	})
	first, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("second plain acquire: %v, want ErrQueueFull", err)
	}
	over, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Overcommit: true})
	if err != nil {
		t.Fatalf("overcommit acquire: %v", err)
	}
	if got := over.Backend().Inflight(); got != 2 {
		t.Fatalf("in-flight %d, want 2 (counted past the limit)", got)
	}
	over.Release(Result{Status: 200})
	first.Release(Result{Status: 200})
	if got := first.Backend().Inflight(); got != 0 {
		t.Fatalf("in-flight %d after both releases", got)
	}
}
