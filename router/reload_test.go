package router

import (
	"context"
	"errors"
	"testing"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestReloadRemovedBackendDrainsCleanly(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0)}
	r, reg, _ := newTestRouter(t, cfg)
	old := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d0"}}) // on d1
	send(t, r, Result{Status: 200})

	cfg.Backends = backendsCfg(routerconfig.RoleDecode, "d", 1, 0) // drops d1
	cfg.Health.Interval = -1
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
		if l.Backend().Name != "d0" {
			t.Fatalf("picked removed %s", l.Backend().Name)
		}
		l.Release(Result{Status: 200})
	}
	if _, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"d0"}}); !errors.Is(err, ErrNoBackend) {
		t.Errorf("Acquire excluding the only current backend = %v, want ErrNoBackend", err)
	}
	for _, b := range r.Backends() {
		if b.Name == "d1" {
			t.Error("removed backend still listed")
		}
	}
	old.Release(Result{Status: 200})
	if n := old.Backend().Inflight(); n != 0 {
		t.Errorf("removed backend inflight after release = %d, want 0", n)
	}
	for _, name := range []string{"pdproxy_backend_requests_total", "pdproxy_backend_inflight_requests", "pdproxy_backend_healthy"} {
		if _, ok := testutil.Lookup(t, reg, name, map[string]string{"backend": "d1"}); ok {
			t.Errorf("%s still has a series for removed d1", name)
		}
	}
}

func TestReloadKeepsStateOfKeptBackends(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 4)}
	r, _, clk := newTestRouter(t, cfg)
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	for range 3 {
		send(t, r, Result{Status: 500}) // ejects d0
	}
	cfg.Backends[0].Weight = 5
	cfg.Backends[0].MaxInflight = 8
	cfg.Health.Interval = -1
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	st := r.Backends()[0]
	if st.Inflight != 1 || st.Weight != 5 || st.MaxInflight != 8 || !st.Ejected || st.Ejections != 1 {
		t.Errorf("after reload = %+v; want in-flight and ejection kept, weight and limit new", st)
	}
	l.Release(Result{Status: 200})
	clk.Advance(routerconfig.DefaultBaseBackoff)
	assertAllIdle(t, r)
	if !r.Ready() {
		t.Error("not ready after the ejection ended")
	}
}

func TestReloadAddressChangeIsANewBackend(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)}
	r, _, _ := newTestRouter(t, cfg)
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	cfg.Backends[0].URL = "http://elsewhere:9"
	cfg.Health.Interval = -1
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	// The new d0 is another engine: the old one's in-flight request does not fill it.
	l2 := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	if l2.Backend().URLString != "http://elsewhere:9" {
		t.Errorf("picked %s", l2.Backend().URLString)
	}
	l.Release(Result{Status: 200})
	l2.Release(Result{Status: 200})
	assertAllIdle(t, r)
	if l.Backend().Inflight() != 0 {
		t.Error("old backend left in flight")
	}
}

func TestReloadInvalidConfigKeepsTheOldOne(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0)})
	bad := routerconfig.Config{Backends: backendsCfg(routerconfig.RolePrefill, "p", 1, 0)} // no decoder
	if err := r.Reload(bad); err == nil {
		t.Fatal("Reload accepted a config without decoders")
	}
	if got := len(r.Backends()); got != 2 || r.Has(routerconfig.RolePrefill) {
		t.Errorf("after a failed reload: %d backends, prefill %v", got, r.Has(routerconfig.RolePrefill))
	}
	send(t, r, Result{Status: 200})
}

func TestReloadSwitchesPolicy(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 3, 0)}
	r, _, _ := newTestRouter(t, cfg)
	cfg.DecodePolicy = routerconfig.PolicyPrefixAffinity
	cfg.Health.Interval = -1
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	h := Hint{Prefix: "the same long system prompt"}
	first := mustAcquire(t, r, routerconfig.RoleDecode, h)
	first.Release(Result{Status: 200})
	for range 5 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, h)
		if l.Backend() != first.Backend() {
			t.Fatalf("prefix went to %s, then %s", first.Backend().Name, l.Backend().Name)
		}
		l.Release(Result{Status: 200})
	}
}
