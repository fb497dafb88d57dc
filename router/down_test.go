package router

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// dialErr is a dial that failed with errno, as net.Dialer reports it.
func dialErr(errno syscall.Errno) error {
	return &net.OpError{Op: "dial", Net: "tcp", Err: &os.SyscallError{Syscall: "connect", Err: errno}}
}

func statusByName(t *testing.T, r *Router, name string) BackendStatus {
	t.Helper()
	for _, b := range r.Backends() {
		if b.Name == name {
			return b
		}
	}
	t.Fatalf("no backend %q", name)
	return BackendStatus{}
}

func TestARefusedCallMarksTheBackendDownUntilItsHealthCheckPasses(t *testing.T) {
	victim, other := newEngine(t), newEngine(t)
	cfg := healthCfg(routerconfig.HealthConfig{Interval: time.Hour, UnhealthyThreshold: 5, HealthyThreshold: 2}, victim, other)
	core, logs := observer.New(zap.InfoLevel)
	reg := prometheus.NewRegistry()
	r, err := New(cfg, zap.New(core), reg)
	if err != nil {
		t.Fatal(err)
	}
	clk := testutil.NewClock(time.Unix(1_700_000_000, 0))
	r.now = clk.Now
	defer r.CloseIdleConnections()
	downTotal := func() float64 {
		return testutil.Value(t, reg, "pdproxy_backend_down_total", map[string]string{"backend": "d0", "role": "decode", "reason": "connection_refused"})
	}

	// Six requests on d0 when it dies: each finds the connection refused.
	var leases []*Lease
	for range 6 {
		leases = append(leases, mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}}))
	}
	refused := refusedErr(t)
	var wg sync.WaitGroup
	for _, l := range leases {
		wg.Go(func() { l.Release(Result{Err: refused}) })
	}
	wg.Wait()

	st := statusByName(t, r, "d0")
	if st.Healthy || st.Ejected || st.DownReason != "connection refused" {
		t.Fatalf("d0 after refused calls = %+v; want down (not ejected) with down_reason \"connection refused\"", st)
	}
	if got := downTotal(); got != 1 {
		t.Errorf("pdproxy_backend_down_total = %v after one outage, want 1", got)
	}
	if n := logs.FilterMessage("backend down").Len(); n != 1 {
		t.Errorf("%d \"backend down\" log lines for one outage, want 1", n)
	}
	if got := statusByName(t, r, "d1"); !got.Healthy || got.DownReason != "" {
		t.Errorf("d1 = %+v, want healthy with no down_reason", got)
	}

	// No time brings it back, however long, and no request goes to it meanwhile: only its
	// health check does.
	clk.Advance(24 * time.Hour)
	for range 5 {
		l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
		name := l.Backend().Name
		l.Release(Result{Status: 200})
		if name == "d0" {
			t.Fatal("a request went to d0 while it was down")
		}
	}
	if _, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}}); !errors.Is(err, ErrNoBackend) {
		t.Errorf("Acquire with only d0 left = %v, want ErrNoBackend", err)
	}
	h := r.settings.Load().health
	r.checkAll(context.Background(), h)
	if statusByName(t, r, "d0").Healthy {
		t.Fatal("up after one passed check; healthy_threshold is 2")
	}
	r.checkAll(context.Background(), h)
	if st := statusByName(t, r, "d0"); !st.Healthy || st.DownReason != "" {
		t.Fatalf("d0 after two passed checks = %+v, want healthy", st)
	}
	// Back in full: not on probation, requests go to it in parallel.
	a := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
	b := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
	a.Release(Result{Status: 200})
	b.Release(Result{Status: 200})
	assertAllIdle(t, r)
}

func TestARefusedHealthCheckMarksTheBackendDownAtOnce(t *testing.T) {
	e := newEngine(t)
	r, reg, _ := newTestRouter(t, healthCfg(routerconfig.HealthConfig{Interval: time.Hour, UnhealthyThreshold: 3}, e))
	defer r.CloseIdleConnections()
	h := r.settings.Load().health
	r.checkAll(context.Background(), h)
	e.Close() // nothing listens any more
	r.checkAll(context.Background(), h)
	st := statusByName(t, r, "d0")
	if st.Healthy || st.DownReason != "health check: connection refused" {
		t.Fatalf("after one refused check = %+v; want down with down_reason \"health check: connection refused\"", st)
	}
	if got := testutil.Value(t, reg, "pdproxy_backend_down_total", map[string]string{"backend": "d0", "reason": "connection_refused"}); got != 1 {
		t.Errorf("pdproxy_backend_down_total{reason=connection_refused} = %v, want 1", got)
	}
}

func TestOnlyAConnectionNobodyAnsweredIsProofABackendIsGone(t *testing.T) {
	tests := []struct {
		name   string
		err    error
		reason string // down_reason after one such call; "" means still up
		label  string
	}{
		{"connection refused", refusedErr(t), "connection refused", "connection_refused"},
		{"no route to host", dialErr(syscall.EHOSTUNREACH), "no route to host", "host_unreachable"},
		{"network unreachable", dialErr(syscall.ENETUNREACH), "network unreachable", "network_unreachable"},
		{"a dial that timed out: the backend may only be busy", &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}, "", ""},
		{"the proxy out of file descriptors", &net.OpError{Op: "dial", Net: "tcp", Err: &os.SyscallError{Syscall: "socket", Err: syscall.EMFILE}}, "", ""},
		{"the proxy out of local ports", dialErr(syscall.EADDRNOTAVAIL), "", ""},
		{"a name that does not resolve", &net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: "engine", IsNotFound: true}}, "", ""},
		{"a connection reset after it was made", errTransport, "", ""},
		{"a 503", nil, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0), Health: routerconfig.HealthConfig{Interval: time.Hour}})
			res := Result{Err: tt.err}
			if tt.err == nil {
				res = Result{Status: 503}
			}
			mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}}).Release(res)
			st := statusByName(t, r, "d0")
			if st.DownReason != tt.reason || st.Healthy != (tt.reason == "") {
				t.Errorf("after one call = %+v; want down_reason %q", st, tt.reason)
			}
			if tt.label != "" {
				if got := testutil.Value(t, reg, "pdproxy_backend_down_total", map[string]string{"backend": "d0", "reason": tt.label}); got != 1 {
					t.Errorf("pdproxy_backend_down_total{reason=%q} = %v, want 1", tt.label, got)
				}
			}
		})
	}
}

func TestARefusedCallWithChecksOffEjectsTheBackendAndItComesBackOnProbation(t *testing.T) {
	for _, ej := range []routerconfig.EjectionConfig{{}, {ConsecutiveFailures: -1}} {
		name := "passive ejection on"
		if ej.ConsecutiveFailures < 0 {
			name = "passive ejection off"
		}
		t.Run(name, func(t *testing.T) {
			r, reg, clk := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 0), Health: routerconfig.HealthConfig{Interval: -1}, Ejection: ej, Queue: routerconfig.QueueConfig{Size: -1}})
			refused := refusedErr(t)
			mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}}).Release(Result{Err: refused})
			st := statusByName(t, r, "d0")
			if st.Healthy || !st.Ejected || st.DownReason != "ejected: connection refused" {
				t.Fatalf("after a refused call = %+v; want ejected with down_reason \"ejected: connection refused\"", st)
			}
			if got := testutil.Value(t, reg, "pdproxy_backend_down_total", map[string]string{"backend": "d0", "reason": "connection_refused"}); got != 1 {
				t.Errorf("pdproxy_backend_down_total = %v, want 1", got)
			}
			clk.Advance(routerconfig.DefaultBaseBackoff)
			if st := statusByName(t, r, "d0"); !st.Healthy || st.DownReason != "" {
				t.Fatalf("after the back-off = %+v; want back", st)
			}
			// On probation: one request at a time; refused again, out for twice as long.
			probe := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
			if l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}}); !errors.Is(err, ErrQueueFull) {
				l.Release(Result{})
				t.Fatalf("a second request to d0 on probation: %v, want ErrQueueFull (no queue)", err)
			}
			probe.Release(Result{Err: refused})
			clk.Advance(2*routerconfig.DefaultBaseBackoff - time.Millisecond)
			if statusByName(t, r, "d0").Healthy {
				t.Fatal("back before twice the base back-off")
			}
			clk.Advance(time.Millisecond)
			probe = mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
			probe.Release(Result{Status: 200})
			a := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
			b := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Exclude: []string{"d1"}})
			a.Release(Result{Status: 200})
			b.Release(Result{Status: 200})
		})
	}
}

func TestDownReasonSaysWhyABackendIsOut(t *testing.T) {
	t.Run("ejected after failures in a row", func(t *testing.T) {
		r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0)})
		for range 3 {
			send(t, r, Result{Status: 500})
		}
		if st := statusByName(t, r, "d0"); st.DownReason != "ejected: consecutive failures" {
			t.Errorf("down_reason = %q", st.DownReason)
		}
	})
	t.Run("failed health checks", func(t *testing.T) {
		e := newEngine(t)
		e.failing.Store(true)
		r, reg, _ := newTestRouter(t, healthCfg(routerconfig.HealthConfig{Interval: time.Hour, UnhealthyThreshold: 2}, e))
		defer r.CloseIdleConnections()
		h := r.settings.Load().health
		r.checkAll(context.Background(), h)
		if st := statusByName(t, r, "d0"); !st.Healthy || st.DownReason != "" {
			t.Fatalf("after one failed check of two = %+v", st)
		}
		r.checkAll(context.Background(), h)
		if st := statusByName(t, r, "d0"); st.Healthy || st.DownReason != "health check failed" {
			t.Errorf("after two failed checks = %+v, want down_reason \"health check failed\"", st)
		}
		if got := testutil.Value(t, reg, "pdproxy_backend_down_total", map[string]string{"backend": "d0", "reason": "health_check"}); got != 1 {
			t.Errorf("pdproxy_backend_down_total{reason=health_check} = %v, want 1", got)
		}
	})
}
