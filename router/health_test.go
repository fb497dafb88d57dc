package router

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// engine is an httptest server whose health endpoint fails or hangs on cue.
type engine struct {
	*httptest.Server
	failing atomic.Bool
	hanging atomic.Bool
	checks  atomic.Int64
	path    atomic.Value // last path requested, /v1/models aside
	// models is what GET /v1/models lists (a []string); unset, it answers 404.
	models atomic.Value
}

func newEngine(t *testing.T) *engine {
	e := &engine{}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/v1/models" {
			// Asked after each passed check; not a check itself.
			ms, ok := e.models.Load().([]string)
			if !ok {
				http.NotFound(w, req)
				return
			}
			type model struct {
				ID string `json:"id"`
			}
			list := struct {
				Data []model `json:"data"`
			}{}
			for _, m := range ms {
				list.Data = append(list.Data, model{m})
			}
			json.NewEncoder(w).Encode(list)
			return
		}
		e.checks.Add(1)
		e.path.Store(req.URL.Path)
		if e.hanging.Load() {
			<-req.Context().Done() // the checker's timeout ends it
			return
		}
		if e.failing.Load() {
			http.Error(w, "sick", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(e.Close)
	return e
}

// runRouter runs r's health checks until the test ends.
func runRouter(t *testing.T, r *Router) {
	ctx, cancel := context.WithCancel(context.Background())
	var g errgroup.Group
	g.Go(func() error { return r.Run(ctx) })
	t.Cleanup(func() {
		cancel()
		if err := g.Wait(); err != nil {
			t.Errorf("Run returned %v, want nil", err)
		}
	})
}

func healthCfg(h routerconfig.HealthConfig, engines ...*engine) routerconfig.Config {
	cfg := routerconfig.Config{Health: h}
	for i, e := range engines {
		cfg.Backends = append(cfg.Backends, routerconfig.BackendConfig{Name: "d" + string(rune('0'+i)), URL: e.URL, Role: routerconfig.RoleDecode})
	}
	return cfg
}

func healthy(r *Router, name string) bool {
	for _, b := range r.Backends() {
		if b.Name == name {
			return b.Healthy
		}
	}
	return false
}

func TestActiveHealthMarksDownAndUp(t *testing.T) {
	tests := []struct {
		name  string
		sick  func(e *engine)
		well  func(e *engine)
		check routerconfig.HealthConfig
	}{
		{"5xx answers",
			func(e *engine) { e.failing.Store(true) }, func(e *engine) { e.failing.Store(false) },
			routerconfig.HealthConfig{Interval: 5 * time.Millisecond, UnhealthyThreshold: 2, HealthyThreshold: 2}},
		{"checks that time out",
			func(e *engine) { e.hanging.Store(true) }, func(e *engine) { e.hanging.Store(false) },
			routerconfig.HealthConfig{Interval: 5 * time.Millisecond, Timeout: 250 * time.Millisecond}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEngine(t)
			r, reg, _ := newTestRouter(t, healthCfg(tt.check, e))
			runRouter(t, r)
			testutil.Eventually(t, testutil.Timeout, func() bool { return e.checks.Load() > 0 }, "a first check")
			if !r.Ready() {
				t.Fatal("not ready with a healthy engine")
			}
			tt.sick(e)
			testutil.Eventually(t, testutil.Timeout, func() bool { return !r.Ready() }, "the backend to be marked down")
			if v, _ := testutil.Lookup(t, reg, "pdproxy_backend_healthy", map[string]string{"backend": "d0"}); v != 0 {
				t.Errorf("backend_healthy = %v while down", v)
			}
			if _, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{}); err != ErrNoBackend {
				t.Errorf("Acquire while down = %v, want ErrNoBackend", err)
			}
			tt.well(e)
			testutil.Eventually(t, testutil.Timeout, r.Ready, "the backend to be marked up")
			send(t, r, Result{Status: 200})
		})
	}
}

func TestActiveHealthNeedsThresholdFailuresInARow(t *testing.T) {
	e := newEngine(t)
	r, _, _ := newTestRouter(t, healthCfg(routerconfig.HealthConfig{Interval: -1, UnhealthyThreshold: 3, HealthyThreshold: 2}, e))
	h := routerconfig.HealthConfig{Timeout: time.Second, UnhealthyThreshold: 3, HealthyThreshold: 2, Path: "/health"}
	round := func(fail bool) {
		e.failing.Store(fail)
		r.checkAll(context.Background(), h)
	}
	round(true)
	round(true)
	round(false) // breaks the streak
	round(true)
	round(true)
	if !healthy(r, "d0") {
		t.Fatal("down after failures that were not in a row")
	}
	round(true)
	if healthy(r, "d0") {
		t.Fatal("up after 3 failed checks in a row")
	}
	round(false)
	if healthy(r, "d0") {
		t.Fatal("up after 1 passed check; healthy_threshold is 2")
	}
	round(false)
	if !healthy(r, "d0") {
		t.Fatal("down after 2 passed checks")
	}
	// checkAll ran without Run, which would close the keep-alive connections it left.
	for _, b := range r.backends() {
		b.closeIdle()
	}
}

func TestActiveHealthUsesConfiguredPath(t *testing.T) {
	e := newEngine(t)
	r, _, _ := newTestRouter(t, healthCfg(routerconfig.HealthConfig{Interval: 5 * time.Millisecond, Path: "/v1/ready"}, e))
	runRouter(t, r)
	testutil.Eventually(t, testutil.Timeout, func() bool { return e.checks.Load() > 0 }, "a check")
	if got := e.path.Load(); got != "/v1/ready" {
		// The only other path asked is /v1/models, after a passed check, which the engine
		// does not record.
		t.Errorf("checked %v, want /v1/ready", got)
	}
}

func TestActiveHealthChecksEachBackendOnItsOwn(t *testing.T) {
	good, bad := newEngine(t), newEngine(t)
	bad.failing.Store(true)
	r, _, _ := newTestRouter(t, healthCfg(routerconfig.HealthConfig{Interval: 5 * time.Millisecond, UnhealthyThreshold: 1}, good, bad))
	runRouter(t, r)
	testutil.Eventually(t, testutil.Timeout, func() bool { return !healthy(r, "d1") }, "d1 down")
	if !healthy(r, "d0") || !r.Ready() {
		t.Error("a healthy backend was marked down with its neighbour")
	}
	for range 5 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
		if l.Backend().Name != "d0" {
			t.Errorf("picked down %s", l.Backend().Name)
		}
		l.Release(Result{Status: 200})
	}
}

func TestRunStopsWithItsContext(t *testing.T) {
	tests := []struct {
		name     string
		interval time.Duration
	}{
		{"checks enabled", time.Millisecond},
		{"checks disabled", -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEngine(t)
			r, _, _ := newTestRouter(t, healthCfg(routerconfig.HealthConfig{Interval: tt.interval}, e))
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			cancel()
			if err := testutil.Recv(t, testutil.Timeout, done, "Run to return after its context ended"); err != nil {
				t.Errorf("Run = %v, want nil", err)
			}
		})
	}
}

func TestReloadEnablesHealthChecksWhileRunning(t *testing.T) {
	e := newEngine(t)
	cfg := healthCfg(routerconfig.HealthConfig{Interval: -1}, e)
	r, _, _ := newTestRouter(t, cfg)
	runRouter(t, r)
	cfg.Health.Interval = 5 * time.Millisecond
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, testutil.Timeout, func() bool { return e.checks.Load() > 0 }, "checks after the reload")
}
