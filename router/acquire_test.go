package router

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"
)

// newTestRouter builds a router over cfg with a fresh registry; checks are off unless cfg
// turns them on, so tests drive health by hand.
func newTestRouter(t *testing.T, cfg Config) (*Router, *prometheus.Registry) {
	t.Helper()
	if cfg.Health.Interval == 0 {
		cfg.Health.Interval = -1
	}
	reg := prometheus.NewRegistry()
	r, err := New(cfg, zaptest.NewLogger(t), reg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return r, reg
}

func TestAcquireCountsOneInflightUntilRelease(t *testing.T) {
	r, _ := newTestRouter(t, Config{Backends: []BackendConfig{
		{Name: "d1", URL: "http://127.0.0.1:1", Role: RoleDecode},
		{Name: "d2", URL: "http://127.0.0.1:2", Role: RoleDecode},
	}})
	l1, err := r.Acquire(context.Background(), RoleDecode, Hint{})
	if err != nil {
		t.Fatal(err)
	}
	l2, err := r.Acquire(context.Background(), RoleDecode, Hint{})
	if err != nil {
		t.Fatal(err)
	}
	if l1.Backend() == l2.Backend() {
		t.Fatalf("least_inflight put both on %s", l1.Backend().Name)
	}
	l1.Release(Result{Status: 200})
	l1.Release(Result{Status: 200})
	l2.Release(Result{Status: 200})
	for _, b := range r.Backends() {
		if b.Inflight != 0 {
			t.Errorf("%s inflight = %d, want 0", b.Name, b.Inflight)
		}
	}
}
