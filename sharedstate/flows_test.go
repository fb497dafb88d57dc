package sharedstate

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestShareFlowsAddsEachReplicasServiceAndAnswersTheTotals(t *testing.T) {
	srv := redistest.Start(t)
	a, b := startReplica(t, srv.Addr(), Config{}), startReplica(t, srv.Addr(), Config{})
	ctx := context.Background()
	if _, err := a.ShareFlows(ctx, 7, map[string]float64{"decode:x": 3, "decode:y": 1}, nil); err != nil {
		t.Fatalf("a: %v", err)
	}
	got, err := b.ShareFlows(ctx, 7, map[string]float64{"decode:x": 2}, []string{"decode:x", "decode:y", "decode:z"})
	if err != nil {
		t.Fatalf("b: %v", err)
	}
	if got["decode:x"] != 5 || got["decode:y"] != 1 {
		t.Errorf("totals = %v, want x 5 (3 + 2) and y 1", got)
	}
	if _, ok := got["decode:z"]; ok {
		t.Errorf("totals name a flow nobody served: %v", got)
	}
	if got, _ := b.ShareFlows(ctx, 8, nil, []string{"decode:x"}); len(got) != 0 {
		t.Errorf("the next window's totals = %v, want none: each window starts afresh", got)
	}
	if ttl, err := srv.Do("TTL", "pdproxy:flows:7"); err != nil || ttl == "-1" || ttl == "-2" {
		t.Errorf("TTL of a window's totals = %s (%v), want one: a window nobody serves goes away", ttl, err)
	}
	srv.Stop()
	if _, err := a.ShareFlows(ctx, 7, map[string]float64{"decode:x": 1}, []string{"decode:x"}); err == nil {
		t.Error("ShareFlows with Redis stopped answered no error")
	}
	if n := testutil.Value(t, a.reg, "pdproxy_shared_state_errors_total", map[string]string{"op": "flows"}); n < 1 {
		t.Errorf("errors{flows} = %v, want at least 1", n)
	}
}

// TestATenantsShareIsGlobalBehindReplicas: two replicas of one slot each. A noisy tenant waits
// on both, a quiet one on replica A alone. Each replica alone would give the quiet tenant half
// of A's slots, a quarter of all: with the shares global, the noisy tenant's service on B
// counts on A too, and the quiet one gets most of A.
func TestATenantsShareIsGlobalBehindReplicas(t *testing.T) {
	srv := redistest.Start(t)
	for _, shared := range []bool{false, true} {
		quiet := quietShareOfA(t, srv.Addr(), shared, 20)
		t.Logf("shared state %v: the quiet tenant got %.2f of replica A's slots", shared, quiet)
		switch {
		case shared && quiet < 0.75:
			t.Errorf("with shared state, the quiet tenant got %.2f of replica A's slots, want at least 0.75", quiet)
		case !shared && (quiet < 0.35 || quiet > 0.65):
			t.Errorf("without shared state, the quiet tenant got %.2f of replica A's slots, want about half (each replica fair alone)", quiet)
		}
	}
}

// quietShareOfA serves rounds of one request on each replica and answers the quiet tenant's
// share of replica A's.
func quietShareOfA(t *testing.T, addr string, shared bool, rounds int) float64 {
	t.Helper()
	type served struct {
		tenant string
		lease  *router.Lease
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := func() (*router.Router, chan served, *router.Lease) {
		cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "d", URL: "http://127.0.0.1:9", Role: routerconfig.RoleDecode, MaxInflight: 1}},
			Health: routerconfig.HealthConfig{Interval: -1}, Queue: routerconfig.QueueConfig{Size: 1000}}
		r, err := router.New(cfg, zaptest.NewLogger(t), prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		if shared {
			r.ShareFlows(startReplica(t, addr, Config{}).Store)
		}
		done := make(chan struct{})
		go func() { r.Run(ctx); close(done) }()
		t.Cleanup(func() { <-done })
		busy, err := r.Acquire(ctx, routerconfig.RoleDecode, router.Hint{})
		if err != nil {
			t.Fatal(err)
		}
		return r, make(chan served, 200), busy
	}
	queue := func(r *router.Router, out chan served, tenant string, n int) {
		for range n {
			before := r.Load(routerconfig.RoleDecode).Queued
			go func() {
				l, err := r.Acquire(ctx, routerconfig.RoleDecode, router.Hint{Flow: router.Flow{Key: tenant, Label: tenant}})
				if err == nil {
					out <- served{tenant, l}
				}
			}()
			testutil.Eventually(t, testutil.Timeout, func() bool { return r.Load(routerconfig.RoleDecode).Queued == before+1 }, "the request to queue")
		}
	}
	ra, outA, busyA := start()
	rb, outB, busyB := start()
	queue(ra, outA, "noisy", rounds+5)
	queue(ra, outA, "quiet", rounds+5)
	queue(rb, outB, "noisy", rounds+5)
	quiet := 0
	for range rounds {
		busyA.Release(router.Result{Status: 200})
		busyB.Release(router.Result{Status: 200})
		a := testutil.Recv(t, testutil.Timeout, outA, "a request served on A")
		busyB = testutil.Recv(t, testutil.Timeout, outB, "a request served on B").lease
		busyA = a.lease
		if a.tenant == "quiet" {
			quiet++
		}
		time.Sleep(150 * time.Millisecond) // a round of the shares goes by
	}
	busyA.Release(router.Result{})
	busyB.Release(router.Result{})
	cancel()
	for _, out := range []chan served{outA, outB} {
		// The waiters left are canceled; one may have been served before it saw that.
		for {
			select {
			case s := <-out:
				s.lease.Release(router.Result{})
				continue
			case <-time.After(200 * time.Millisecond):
			}
			break
		}
	}
	return float64(quiet) / float64(rounds)
}
