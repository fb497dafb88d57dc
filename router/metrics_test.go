package router

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestRequestsTotalCodes(t *testing.T) {
	r, reg, _ := newTestRouter(t, routerconfig.Config{
		Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0),
		Ejection: routerconfig.EjectionConfig{ConsecutiveFailures: -1},
	})
	for _, res := range []Result{
		{Status: 200}, {Status: 200}, {Status: 503}, {Status: 418},
		{Err: errTransport}, {Canceled: true}, {Canceled: true, Status: 200}, {},
	} {
		send(t, r, res)
	}
	for code, want := range map[string]float64{"200": 2, "503": 1, "418": 1, "error": 1, "canceled": 2} {
		got, _ := testutil.Lookup(t, reg, "pdproxy_backend_requests_total", map[string]string{"backend": "d0", "role": "decode", "code": code})
		if got != want {
			t.Errorf("requests_total{code=%q} = %v, want %v", code, got, want)
		}
	}
	if _, ok := testutil.Lookup(t, reg, "pdproxy_backend_requests_total", map[string]string{"code": "0"}); ok {
		t.Error("an unused lease was counted as a request")
	}
}

func TestBackendGauges(t *testing.T) {
	r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: append(backendsCfg(routerconfig.RoleDecode, "d", 2, 0), backendsCfg(routerconfig.RolePrefill, "p", 1, 0)...)})
	l := mustAcquire(t, r, routerconfig.RolePrefill, Hint{})
	backendByName(t, r, "d1").st.up.Store(false)
	tests := []struct {
		metric, backend, role string
		want                  float64
	}{
		{"pdproxy_backend_inflight_requests", "p0", "prefill", 1},
		{"pdproxy_backend_inflight_requests", "d0", "decode", 0},
		{"pdproxy_backend_healthy", "d0", "decode", 1},
		{"pdproxy_backend_healthy", "d1", "decode", 0},
		{"pdproxy_backend_healthy", "p0", "prefill", 1},
		{"pdproxy_backend_ejections_total", "d0", "decode", 0},
	}
	for _, tt := range tests {
		got, ok := testutil.Lookup(t, reg, tt.metric, map[string]string{"backend": tt.backend, "role": tt.role})
		if !ok || got != tt.want {
			t.Errorf("%s{backend=%q} = %v (present %v), want %v", tt.metric, tt.backend, got, ok, tt.want)
		}
	}
	l.Release(Result{Status: 200})
	if got, _ := testutil.Lookup(t, reg, "pdproxy_backend_inflight_requests", map[string]string{"backend": "p0"}); got != 0 {
		t.Errorf("inflight after release = %v, want 0", got)
	}
}

func TestMetricsRegisterOnTheInjectedRegistryOnly(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0)}
	reg := prometheus.NewRegistry()
	if _, err := New(cfg, zaptest.NewLogger(t), reg); err != nil {
		t.Fatal(err)
	}
	// A second router on the same registry is a wiring bug and says so.
	if _, err := New(cfg, zaptest.NewLogger(t), reg); err == nil {
		t.Error("second New on one registry did not fail")
	}
	// A nil registry is allowed: no metrics.
	r, err := New(cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{})
	if err != nil {
		t.Fatal(err)
	}
	l.Release(Result{Status: 200})
}
