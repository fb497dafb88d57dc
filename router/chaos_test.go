package router

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// TestInflightNeverLeaksUnderChaos hammers Acquire, Release and Reload from many
// goroutines, with clients that cancel at random moments, handlers that panic (recovered
// by the caller, as net/http does), double releases from other goroutines, health flaps
// and passive ejections, then checks that every in-flight count went back to zero and
// never went below it.
func TestInflightNeverLeaksUnderChaos(t *testing.T) {
	cfgA := routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			{Name: "p0", URL: "http://p0:1", Role: routerconfig.RolePrefill, MaxInflight: 2},
			{Name: "p1", URL: "http://p1:1", Role: routerconfig.RolePrefill, MaxInflight: 2},
			{Name: "d0", URL: "http://d0:1", Role: routerconfig.RoleDecode, MaxInflight: 2},
			{Name: "d1", URL: "http://d1:1", Role: routerconfig.RoleDecode, MaxInflight: 2},
			{Name: "d2", URL: "http://d2:1", Role: routerconfig.RoleDecode, MaxInflight: 1},
		},
		PrefillPolicy: routerconfig.PolicyPrefixAffinity,
		Health:        routerconfig.HealthConfig{Interval: -1},
		Ejection:      routerconfig.EjectionConfig{ConsecutiveFailures: 2, BaseBackoff: time.Millisecond, MaxBackoff: 4 * time.Millisecond},
		Queue:         routerconfig.QueueConfig{Size: 4, Timeout: 5 * time.Millisecond},
	}
	cfgB := cfgA
	cfgB.Backends = []routerconfig.BackendConfig{
		{Name: "p1", URL: "http://p1:1", Role: routerconfig.RolePrefill, MaxInflight: 3},
		{Name: "p2", URL: "http://p2:1", Role: routerconfig.RolePrefill, MaxInflight: 1},
		{Name: "d1", URL: "http://d1-moved:1", Role: routerconfig.RoleDecode, MaxInflight: 2},
		{Name: "d3", URL: "http://d3:1", Role: routerconfig.RoleDecode, MaxInflight: 2},
	}
	cfgB.PrefillPolicy, cfgB.DecodePolicy = routerconfig.PolicyRoundRobin, routerconfig.PolicyPowerOfTwo
	invalid := routerconfig.Config{Backends: []routerconfig.BackendConfig{{URL: "nope"}}}

	r, reg, _ := newTestRouter(t, cfgA)
	r.now = time.Now // ejections must end on their own here

	var (
		seen      sync.Map // *backendState -> name
		negative  atomic.Bool
		stop      = make(chan struct{})
		workers   sync.WaitGroup
		bg        sync.WaitGroup // reloader, flapper, sampler
		releasers sync.WaitGroup
		served    atomic.Int64
		errCount  sync.Map // error text -> *atomic.Int64
	)
	countErr := func(err error) {
		v, _ := errCount.LoadOrStore(err.Error(), new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}

	bg.Go(func() { // reloader
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			cfg := cfgA
			switch i % 3 {
			case 1:
				cfg = cfgB
			case 2:
				if err := r.Reload(invalid); err == nil {
					t.Error("invalid reload accepted")
				}
				continue
			}
			if err := r.Reload(cfg); err != nil {
				t.Errorf("reload: %v", err)
			}
			time.Sleep(time.Millisecond)
		}
	})
	bg.Go(func() { // health flapper: what a check round would do
		rng := rand.New(rand.NewPCG(1, 2))
		for {
			select {
			case <-stop:
				return
			default:
			}
			bs := r.backends()
			b := bs[rng.IntN(len(bs))]
			refusal := ""
			if rng.IntN(4) == 0 {
				refusal = "connection refused"
			}
			b.check(rng.IntN(3) > 0, refusal, routerconfig.HealthConfig{UnhealthyThreshold: 2, HealthyThreshold: 1})
			r.prefill.kick()
			r.decode.kick()
			time.Sleep(500 * time.Microsecond)
		}
	})
	bg.Go(func() { // sampler: counts must never be seen below zero
		for {
			select {
			case <-stop:
				return
			default:
			}
			seen.Range(func(k, _ any) bool {
				if k.(*backendState).inflight.Load() < 0 {
					negative.Store(true)
				}
				return true
			})
			time.Sleep(100 * time.Microsecond)
		}
	})

	results := []Result{
		{Status: 200}, {Status: 200}, {Status: 200}, {Status: 503}, {Status: 400},
		{Err: errTransport}, {Err: refusedErr(t)}, {Canceled: true}, {},
	}
	for w := range 16 {
		workers.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			for i := range 300 {
				func() {
					defer func() { _ = recover() }() // the caller survives a panicking handler
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					switch rng.IntN(4) {
					case 0:
						cancel() // client gone before the request is routed
					case 1:
						timer := time.AfterFunc(time.Duration(rng.IntN(2000))*time.Microsecond, cancel)
						defer timer.Stop()
					}
					role := routerconfig.RoleDecode
					if rng.IntN(2) == 0 {
						role = routerconfig.RolePrefill
					}
					var h Hint
					h.RequestID = fmt.Sprintf("w%d-%d", w, i)
					h.Prefix = fmt.Sprintf("prompt %d", rng.IntN(20))
					if rng.IntN(4) == 0 {
						h.Exclude = []string{"d0", "p1", "d3"}[rng.IntN(3):]
					}
					l, err := r.Acquire(ctx, role, h)
					if err != nil {
						if !errors.Is(err, ErrNoBackend) && !errors.Is(err, ErrQueueFull) &&
							!errors.Is(err, ErrQueueTimeout) && !errors.Is(err, context.Canceled) {
							t.Errorf("unexpected Acquire error: %v", err)
						}
						countErr(err)
						return
					}
					served.Add(1)
					seen.Store(l.b.st, l.b.Name)
					res := results[rng.IntN(len(results))]
					defer l.Release(res)
					if rng.IntN(5) == 0 { // a racing second release from elsewhere
						releasers.Go(func() { l.Release(Result{Status: 500}) })
					}
					if rng.IntN(3) == 0 {
						time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
					}
					if rng.IntN(10) == 0 {
						panic("handler blew up")
					}
				}()
			}
		})
	}
	workers.Wait()
	close(stop)
	bg.Wait()
	releasers.Wait()

	if negative.Load() {
		t.Error("an in-flight count was seen below zero")
	}
	seen.Range(func(k, v any) bool {
		if n := k.(*backendState).inflight.Load(); n != 0 {
			t.Errorf("backend %v (incl. removed ones) left with inflight %d", v, n)
		}
		return true
	})
	assertAllIdle(t, r)
	for _, role := range []routerconfig.Role{routerconfig.RolePrefill, routerconfig.RoleDecode} {
		if n := queued(r, role); n != 0 {
			t.Errorf("%d %s waiters left", n, role)
		}
	}
	for _, b := range r.Backends() {
		if v, _ := testutil.Lookup(t, reg, "pdproxy_backend_inflight_requests", map[string]string{"backend": b.Name}); v != 0 {
			t.Errorf("inflight gauge for %s = %v", b.Name, v)
		}
	}
	if served.Load() == 0 {
		t.Error("no request was ever served; the test exercised nothing")
	}
	errCount.Range(func(k, v any) bool {
		t.Logf("%s: %d", k, v.(*atomic.Int64).Load())
		return true
	})
	t.Logf("served %d of %d", served.Load(), 16*300)
}
