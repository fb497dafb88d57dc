package router

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// servedBy is one waiter of a flow test, as Acquire answered it.
type servedBy struct {
	tenant string
	lease  *Lease
	err    error
}

// flowQueue queues one request of tenant (weight w) on r's decode pool and waits until it is
// queued; its answer comes on out.
func queueFor(t *testing.T, r *Router, ctx context.Context, out chan<- servedBy, tenant string, w float64) {
	t.Helper()
	before := queued(r, routerconfig.RoleDecode)
	go func() {
		l, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{RequestID: tenant, Flow: Flow{Key: "k-" + tenant, Label: tenant, Weight: w}})
		out <- servedBy{tenant, l, err}
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == before+1 }, "the request to queue")
}

// serveOneAtATime releases busy, then serves n waiters one after another on a pool of one
// slot, and counts them by tenant.
func serveOneAtATime(t *testing.T, busy *Lease, out <-chan servedBy, n int) map[string]int {
	t.Helper()
	busy.Release(Result{Status: 200})
	counts := map[string]int{}
	for range n {
		s := testutil.Recv(t, testutil.Timeout, out, "a waiter to be served")
		if s.err != nil {
			t.Fatalf("%s: %v", s.tenant, s.err)
		}
		counts[s.tenant]++
		s.lease.Release(Result{Status: 200})
	}
	return counts
}

// drainFlows cancels the waiters left and checks that they left nothing behind.
func drainFlows(t *testing.T, r *Router, cancel context.CancelFunc, out <-chan servedBy, left int) {
	t.Helper()
	cancel()
	leases := 0
	for range left {
		// The last release served the next waiter, which may have taken its lease before
		// it saw its client leave: it gives it back.
		if s := testutil.Recv(t, testutil.Timeout, out, "a canceled waiter"); s.lease != nil {
			leases++
			s.lease.Release(Result{})
		}
	}
	if leases > 1 {
		t.Errorf("%d waiters got a lease after the last release, want at most 1", leases)
	}
	assertQueueEmpty(t, r)
	assertAllIdle(t, r)
}

func assertQueueEmpty(t *testing.T, r *Router) {
	t.Helper()
	p := r.decode
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.waiters.Len() != 0 || len(p.waiters.flows) != 0 || len(p.waiters.active) != 0 {
		t.Errorf("queue holds %d waiters in %d flows (%d active), want none", p.waiters.Len(), len(p.waiters.flows), len(p.waiters.active))
	}
}

func withinShare(t *testing.T, tenant string, got int, want float64) {
	t.Helper()
	if math.Abs(float64(got)-want) > 0.1*want {
		t.Errorf("%s served %d, want within 10%% of %.1f", tenant, got, want)
	}
}

func TestFairQueueGivesEachOfTenEqualTenantsItsShareWhileOneFloods(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1), Queue: routerconfig.QueueConfig{Size: 1000}})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan servedBy, 300)
	// The flood arrives first: first come, first served would give it the next 120 slots.
	for range 120 {
		queueFor(t, r, ctx, out, "noisy", 1)
	}
	for i := range 9 {
		for range 12 {
			queueFor(t, r, ctx, out, fmt.Sprintf("quiet%d", i), 1)
		}
	}
	counts := serveOneAtATime(t, busy, out, 100)
	withinShare(t, "noisy", counts["noisy"], 10)
	for i := range 9 {
		name := fmt.Sprintf("quiet%d", i)
		withinShare(t, name, counts[name], 10)
	}
	drainFlows(t, r, cancel, out, 120+9*12-100)
}

func TestFairQueueServesWeightsThreeToOne(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1), Queue: routerconfig.QueueConfig{Size: 1000}})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan servedBy, 400)
	for range 150 {
		queueFor(t, r, ctx, out, "light", 1)
	}
	for range 150 {
		queueFor(t, r, ctx, out, "heavy", 3)
	}
	counts := serveOneAtATime(t, busy, out, 120)
	withinShare(t, "heavy", counts["heavy"], 90)
	withinShare(t, "light", counts["light"], 30)
	drainFlows(t, r, cancel, out, 300-120)
}

func TestFairQueueKeepsPriorityClassesWithinATenant(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	out := make(chan servedBy, 4)
	flow := Flow{Key: "a", Label: "a"}
	for _, h := range []Hint{{RequestID: "batch", Slack: 1e9, Flow: flow}, {RequestID: "interactive", Flow: flow}} {
		before := queued(r, routerconfig.RoleDecode)
		go func() {
			l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, h)
			out <- servedBy{h.RequestID, l, err}
		}()
		testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == before+1 }, "the request to queue")
	}
	busy.Release(Result{Status: 200})
	first := testutil.Recv(t, testutil.Timeout, out, "a waiter")
	if first.tenant != "interactive" {
		t.Errorf("served %s first, want interactive (the tenant's earliest deadline)", first.tenant)
	}
	first.lease.Release(Result{Status: 200})
	second := testutil.Recv(t, testutil.Timeout, out, "a waiter")
	second.lease.Release(Result{Status: 200})
	assertQueueEmpty(t, r)
	assertAllIdle(t, r)
}

func TestQueuedClientThatLeavesLeavesNoTrace(t *testing.T) {
	r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1)})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan servedBy, 1)
	queueFor(t, r, ctx, out, "gone", 1)
	if n := testutil.Value(t, reg, "pdproxy_flow_queue_depth", map[string]string{"tenant": "gone"}); n != 1 {
		t.Errorf("flow_queue_depth{gone} while queued = %v, want 1", n)
	}
	cancel()
	if s := testutil.Recv(t, testutil.Timeout, out, "the canceled waiter"); !errors.Is(s.err, context.Canceled) || s.lease != nil {
		t.Errorf("Acquire = %v, %v; want context.Canceled and no lease", s.lease, s.err)
	}
	busy.Release(Result{Status: 200})
	assertQueueEmpty(t, r)
	assertAllIdle(t, r)
	if n := testutil.Value(t, reg, "pdproxy_flow_queue_depth", map[string]string{"tenant": "gone"}); n != 0 {
		t.Errorf("flow_queue_depth{gone} after the client left = %v, want 0", n)
	}
	if n, _ := testutil.Lookup(t, reg, "pdproxy_queue_rejected_total", map[string]string{"reason": "canceled"}); n != 1 {
		t.Errorf("queue_rejected_total{canceled} = %v, want 1", n)
	}
}

func TestFairQueueRefusals(t *testing.T) {
	const size = 4
	tests := []struct {
		name string
		// queue is what waits before the request under test, by flow key (weight 1).
		queue []string
		// noFlow sends the request under test without a flow.
		noFlow   bool
		maxQueue int
		want     error
		// evicted is the flow one of whose waiters makes room, told ErrTenantQueueFull.
		evicted string
	}{
		{name: "a tenant at max_queue_per_tenant is refused with the queue not full", queue: []string{"a", "a"}, maxQueue: 2, want: ErrTenantQueueFull},
		{name: "a tenant under its share of a full queue takes the place of the newest waiter of the tenant furthest over its own", queue: []string{"n", "n", "n", "b"}, evicted: "n"},
		{name: "a tenant at its share of a full queue is refused", queue: []string{"a", "a", "b", "b"}, want: ErrTenantQueueFull},
		{name: "a full queue with no tenant over its share is the pool saturated", queue: []string{"b", "c", "d", "e"}, want: ErrPoolSaturated},
		{name: "a request of no flow finds a full queue full, as without flow control", queue: []string{"b", "b", "c", "c"}, noFlow: true, want: ErrQueueFull},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, reg, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1), Queue: routerconfig.QueueConfig{Size: size}})
			busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
			ctx, cancel := context.WithCancel(context.Background())
			out := make(chan servedBy, size+1)
			for _, k := range tt.queue {
				queueFor(t, r, ctx, out, k, 1)
			}
			h := Hint{RequestID: "new", Flow: Flow{Key: "k-a", Label: "a", MaxQueue: tt.maxQueue}}
			if tt.noFlow {
				h.Flow = Flow{}
			}
			acquireCtx, stop := context.WithCancel(context.Background())
			res := make(chan servedBy, 1)
			go func() {
				l, err := r.Acquire(acquireCtx, routerconfig.RoleDecode, h)
				res <- servedBy{"a", l, err}
			}()
			left := len(tt.queue)
			if tt.want != nil {
				if s := testutil.Recv(t, testutil.Timeout, res, "the refusal"); !errors.Is(s.err, tt.want) || s.lease != nil {
					t.Fatalf("Acquire = %v, %v; want %v", s.lease, s.err, tt.want)
				}
			} else {
				s := testutil.Recv(t, testutil.Timeout, out, "the evicted waiter")
				if s.tenant != tt.evicted || !errors.Is(s.err, ErrTenantQueueFull) {
					t.Errorf("evicted %s with %v, want %s with %v", s.tenant, s.err, tt.evicted, ErrTenantQueueFull)
				}
				left--
				testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == size }, "the request to queue")
				stop()
				if s := testutil.Recv(t, testutil.Timeout, res, "the queued request to leave"); s.lease != nil {
					s.lease.Release(Result{})
				}
			}
			stop()
			busy.Release(Result{Status: 200})
			if reason := map[error]string{ErrTenantQueueFull: "tenant_full", ErrPoolSaturated: "saturated", ErrQueueFull: "full", nil: "tenant_full"}[tt.want]; true {
				if n, _ := testutil.Lookup(t, reg, "pdproxy_queue_rejected_total", map[string]string{"reason": reason}); n != 1 {
					t.Errorf("queue_rejected_total{%s} = %v, want 1", reason, n)
				}
			}
			// The served waiters give their slot back at once.
			cancel()
			for range left {
				if s := testutil.Recv(t, testutil.Timeout, out, "a waiter"); s.lease != nil {
					s.lease.Release(Result{})
				}
			}
			assertQueueEmpty(t, r)
			assertAllIdle(t, r)
		})
	}
}

func TestPoolSaturationRisesInAFloodAndFallsAfter(t *testing.T) {
	cfg := routerconfig.Config{Backends: append(backendsCfg(routerconfig.RoleDecode, "d", 2, 2), backendsCfg(routerconfig.RolePrefill, "p", 1, 4)...)}
	r, reg, _ := newTestRouter(t, cfg)
	saturation := func(role routerconfig.Role) float64 {
		return testutil.Value(t, reg, "pdproxy_pool_saturation", map[string]string{"role": string(role)})
	}
	if s := saturation(routerconfig.RoleDecode); s != 0 {
		t.Errorf("decode saturation idle = %v, want 0", s)
	}
	// The flood: every decode slot taken and as many requests again waiting.
	var leases []*Lease
	for range 4 {
		leases = append(leases, mustAcquire(t, r, routerconfig.RoleDecode, Hint{}))
	}
	leases = append(leases, mustAcquire(t, r, routerconfig.RolePrefill, Hint{}))
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan servedBy, 4)
	for range 4 {
		queueFor(t, r, ctx, out, "noisy", 1)
	}
	if s := saturation(routerconfig.RoleDecode); s <= 0.9 || s != 2 {
		t.Errorf("decode saturation in the flood = %v, want 2 (4 in flight and 4 waiting over 4 slots)", s)
	}
	if s := saturation(routerconfig.RolePrefill); s != 0.25 {
		t.Errorf("prefill saturation = %v, want 0.25", s)
	}
	// 1 prefiller at 0.25 against 2 decoders at 2: a prefiller for every 16 decoders would do.
	if ratio := testutil.Value(t, reg, "pdproxy_pd_ratio_recommended", nil); ratio != 0.0625 {
		t.Errorf("pd_ratio_recommended = %v, want 0.0625", ratio)
	}
	if n := testutil.Value(t, reg, "pdproxy_flow_queue_depth", map[string]string{"tenant": "noisy"}); n != 4 {
		t.Errorf("flow_queue_depth{noisy} = %v, want 4", n)
	}
	// After it: every lease ends, and each waiter served gives its slot back.
	for _, l := range leases {
		l.Release(Result{Status: 200})
	}
	for range 4 {
		s := testutil.Recv(t, testutil.Timeout, out, "a waiter")
		if s.err != nil {
			t.Fatalf("waiter: %v", s.err)
		}
		s.lease.Release(Result{Status: 200})
	}
	cancel()
	if s := saturation(routerconfig.RoleDecode); s >= 0.5 {
		t.Errorf("decode saturation after the flood = %v, want below 0.5", s)
	}
	if _, ok := testutil.Lookup(t, reg, "pdproxy_pd_ratio_recommended", nil); ok {
		t.Errorf("pd_ratio_recommended shown with no decode load")
	}
	if n := testutil.Value(t, reg, "pdproxy_flow_queue_depth", map[string]string{"tenant": "noisy"}); n != 0 {
		t.Errorf("flow_queue_depth{noisy} after = %v, want 0", n)
	}
	if _, ok := testutil.Lookup(t, reg, "pdproxy_pool_predicted_ttft_seconds", nil); ok {
		t.Errorf("predicted TTFT shown for pools not placed by cost")
	}
}

func TestPoolPredictedTTFTIsTheLeastOverThePool(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 2, 4), DecodePolicy: routerconfig.PolicyCacheAware,
		CacheAware: routerconfig.CacheAwareConfig{PrefillTokensPerSecond: 1000, PrefillOverhead: 10e6, DecodeCostTokens: 100}}
	r, reg, _ := newTestRouter(t, cfg)
	if ttft := testutil.Value(t, reg, "pdproxy_pool_predicted_ttft_seconds", map[string]string{"role": "decode"}); math.Abs(ttft-0.01) > 1e-9 {
		t.Errorf("predicted TTFT idle = %v, want 0.01 (the overhead)", ttft)
	}
	l := mustAcquire(t, r, routerconfig.RoleDecode, Hint{})
	defer l.Release(Result{Status: 200})
	if ttft := r.Load(routerconfig.RoleDecode).PredictedTTFT; math.Abs(ttft-0.01) > 1e-9 {
		t.Errorf("predicted TTFT with one engine busy = %v, want 0.01: the other is idle", ttft)
	}
}

// distinctText is a prompt of about n bytes that shares no prefix with another of its kind.
func distinctText(i, n int) string {
	head := fmt.Sprintf("%08x request %d: ", uint32(i)*2654435761, i)
	return head + strings.Repeat("x", max(n-len(head), 0))
}

func TestFairQueueChargesTheTokensARequestComputes(t *testing.T) {
	// Two tenants of one weight, both waiting all along: one sends prompts of 4,000 bytes,
	// the other of 1,000. Served by their tokens, the short one gets four requests through
	// for each of the long one's: the same engine time each.
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1), Queue: routerconfig.QueueConfig{Size: 1000}, DecodePolicy: routerconfig.PolicyCacheAware})
	busy := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: distinctText(-1, 100)})
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan servedBy, 200)
	queue := func(tenant string, i, size int) {
		before := queued(r, routerconfig.RoleDecode)
		go func() {
			l, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{Text: distinctText(i, size), Flow: Flow{Key: tenant, Label: tenant}})
			out <- servedBy{tenant, l, err}
		}()
		testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == before+1 }, "the request to queue")
	}
	for i := range 60 {
		queue("long", i, 4000)
		queue("short", 1000+i, 1000)
	}
	counts := serveOneAtATime(t, busy, out, 50)
	if ratio := float64(counts["short"]) / float64(max(counts["long"], 1)); ratio < 3.4 || ratio > 4.6 {
		t.Errorf("served short %d, long %d: ratio %.2f, want about 4 (the tokens of a long prompt over a short one's)", counts["short"], counts["long"], ratio)
	}
	drainFlows(t, r, cancel, out, 120-50)
}

func TestTTFTBoundHoldsRequestsBackUntilTheWorkAheadEnds(t *testing.T) {
	// 1,000 tokens a second and 10 ms per prefill: a prompt of 50 tokens starts in 60 ms
	// alone, 110 ms behind another. Under a bound of 100 ms the second waits for the first's
	// prefill to end, though the engine has slots to spare.
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 100), DecodePolicy: routerconfig.PolicyCacheAware, Queue: routerconfig.QueueConfig{TTFTBound: 100 * time.Millisecond},
		CacheAware: routerconfig.CacheAwareConfig{PrefillTokensPerSecond: 1000, PrefillOverhead: 10 * time.Millisecond}}
	r, reg, _ := newTestRouter(t, cfg)
	first := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: distinctText(0, 200)})
	out := make(chan servedBy, 1)
	go func() {
		l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Text: distinctText(1, 200), Flow: Flow{Key: "t", Label: "t"}})
		out <- servedBy{"t", l, err}
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == 1 }, "the second request to wait")
	if s := testutil.Value(t, reg, "pdproxy_pool_saturation", map[string]string{"role": "decode"}); s <= 0.9 {
		t.Errorf("saturation with a request held back by the bound = %v, want above 0.9", s)
	}
	first.Prefilled()
	s := testutil.Recv(t, testutil.Timeout, out, "the second request, once the first's prefill ended")
	if s.err != nil {
		t.Fatalf("second request: %v", s.err)
	}
	if p := s.lease.booked.cost.Predicted; p > 100*time.Millisecond {
		t.Errorf("second request admitted at a predicted TTFT of %v, over the bound", p)
	}
	s.lease.Release(Result{Status: 200})
	first.Release(Result{Status: 200})
	// A prompt longer than the bound alone is not held back on an idle engine.
	long := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: distinctText(2, 4000)})
	long.Release(Result{Status: 200})
	if s := testutil.Value(t, reg, "pdproxy_pool_saturation", map[string]string{"role": "decode"}); s >= 0.5 {
		t.Errorf("saturation idle = %v, want below 0.5", s)
	}
}

func TestTTFTBoundIsRefusedWhereNoPoolIsPlacedByCost(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 1), Queue: routerconfig.QueueConfig{TTFTBound: time.Second}}
	err := cfg.Validate()
	if err == nil || !strings.Contains(err.Error(), "flow_control.saturation_ttft") || !strings.Contains(err.Error(), "placed by cost") {
		t.Errorf("Validate = %v, want flow_control.saturation_ttft refused: no pool is placed by cost", err)
	}
	cfg.DecodePolicy = routerconfig.PolicyCacheAware
	if err := cfg.Validate(); err != nil {
		t.Errorf("Validate with cache_aware = %v, want nil", err)
	}
}

func TestReservedSlotLetsAnIdleTenantStartAtOnceWhileAnotherFloods(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 2), Queue: routerconfig.QueueConfig{Size: 100, ReservedSlots: 1}}
	r, _, clk := newTestRouter(t, cfg)
	noisy, quiet := Hint{Flow: Flow{Key: "noisy", Label: "noisy"}}, Hint{Flow: Flow{Key: "quiet", Label: "quiet"}}
	mustAcquire(t, r, routerconfig.RoleDecode, quiet).Release(Result{Status: 200}) // the quiet tenant is active, and idle
	first := mustAcquire(t, r, routerconfig.RoleDecode, noisy)                     // nothing of its own in flight: it may
	out := make(chan servedBy, 1)
	go func() {
		l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, noisy)
		out <- servedBy{"noisy", l, err}
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == 1 }, "the flood's second request to wait, one slot free")
	q := mustAcquire(t, r, routerconfig.RoleDecode, quiet) // the slot kept for it
	q.Release(Result{Status: 200})
	if n := queued(r, routerconfig.RoleDecode); n != 1 {
		t.Fatalf("%d waiting after the quiet tenant's request ended, want the flood's still waiting: the quiet tenant is active", n)
	}
	// A second later the quiet tenant is no longer active: the slot goes to the flood.
	clk.Advance(tenantActiveWindow + time.Millisecond)
	first.Release(Result{Status: 200})
	s := testutil.Recv(t, testutil.Timeout, out, "the flood's request, once the quiet tenant went quiet")
	if s.err != nil {
		t.Fatal(s.err)
	}
	s.lease.Release(Result{Status: 200})
	assertQueueEmpty(t, r)
	assertAllIdle(t, r)
	r.decode.mu.Lock()
	defer r.decode.mu.Unlock()
	if n := len(r.decode.flowSlots.inflight); n != 0 {
		t.Errorf("%d flows still counted in flight, want none", n)
	}
}

func TestWithoutReservedSlotsAFloodTakesEverySlot(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 2), Queue: routerconfig.QueueConfig{Size: 100}})
	noisy, quiet := Hint{Flow: Flow{Key: "noisy"}}, Hint{Flow: Flow{Key: "quiet"}}
	mustAcquire(t, r, routerconfig.RoleDecode, quiet).Release(Result{Status: 200})
	a, b := mustAcquire(t, r, routerconfig.RoleDecode, noisy), mustAcquire(t, r, routerconfig.RoleDecode, noisy)
	a.Release(Result{Status: 200})
	b.Release(Result{Status: 200})
}

func TestAReservedSlotIsKeptForATenantFirstSeenAfterAScanFoundNone(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 3), Queue: routerconfig.QueueConfig{Size: 100, ReservedSlots: 1}}
	r, _, _ := newTestRouter(t, cfg)
	noisy, quiet := Hint{Flow: Flow{Key: "noisy"}}, Hint{Flow: Flow{Key: "quiet"}}
	// The flood alone: its picks find no idle tenant, and remember that for a while.
	a, b := mustAcquire(t, r, routerconfig.RoleDecode, noisy), mustAcquire(t, r, routerconfig.RoleDecode, noisy)
	// A tenant first seen now, served and gone idle, is kept a slot at once, whatever the
	// flood's last scan found.
	mustAcquire(t, r, routerconfig.RoleDecode, quiet).Release(Result{Status: 200})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if l, err := r.Acquire(ctx, routerconfig.RoleDecode, noisy); err == nil {
		l.Release(Result{})
		t.Error("the flood took the pool's last slot while a tenant active a moment ago had nothing running")
	}
	a.Release(Result{Status: 200})
	b.Release(Result{Status: 200})
	assertAllIdle(t, r)
}

func TestServiceElsewhereCountsOnlyWhileATenantWaitsHere(t *testing.T) {
	q := &fairQueue{share: flowShare{window: 7, unsent: map[string]float64{}, own: map[string]float64{}}}
	w := &waiter{h: Hint{Flow: Flow{Key: "x"}}, ch: make(chan waitResult, 1)}
	q.push(w)
	f := q.flows["x"]
	start := f.vt
	// Other replicas served x a great deal before it waited here: no debt.
	q.addRemote(routerconfig.RoleDecode, 7, map[string]float64{flowField(routerconfig.RoleDecode, "x"): 1000})
	if f.vt != start {
		t.Fatalf("vt = %v after the first reading, want %v: service before waiting here is no debt", f.vt, start)
	}
	// While it waits here, what they serve it counts, over its weight.
	f.Weight = 2
	q.addRemote(routerconfig.RoleDecode, 7, map[string]float64{flowField(routerconfig.RoleDecode, "x"): 1010})
	if f.vt != start+5 {
		t.Errorf("vt = %v, want %v: 10 tokens served elsewhere at weight 2", f.vt, start+5)
	}
	// A reading of another window counts nothing.
	q.addRemote(routerconfig.RoleDecode, 8, map[string]float64{flowField(routerconfig.RoleDecode, "x"): 5000})
	if f.vt != start+5 {
		t.Errorf("vt = %v after another window's reading, want %v", f.vt, start+5)
	}
	q.remove(w)
}

func TestUnderATTFTBoundARequestOfAnotherModelIsNotHeldBehindTheWaiters(t *testing.T) {
	// Engine a serves model "a", engine b model "b". A request for "a" held back by the bound
	// behind work on engine a does not keep a request for "b" from idle engine b.
	cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{Name: "a", URL: "http://127.0.0.1:1", Role: routerconfig.RoleDecode, MaxInflight: 100, Models: []string{"a"}},
		{Name: "b", URL: "http://127.0.0.1:2", Role: routerconfig.RoleDecode, MaxInflight: 100, Models: []string{"b"}},
	}, DecodePolicy: routerconfig.PolicyCacheAware, Queue: routerconfig.QueueConfig{TTFTBound: 100 * time.Millisecond},
		CacheAware: routerconfig.CacheAwareConfig{PrefillTokensPerSecond: 1000, PrefillOverhead: 10 * time.Millisecond}}
	r, _, _ := newTestRouter(t, cfg)
	first := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Model: "a", Text: distinctText(0, 200)})
	out := make(chan servedBy, 1)
	go func() {
		l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Model: "a", Text: distinctText(1, 200), Flow: Flow{Key: "t"}})
		out <- servedBy{"a", l, err}
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == 1 }, "the second request for a to wait")
	other := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Model: "b", Text: distinctText(2, 200), Flow: Flow{Key: "u"}})
	if other.Backend().Name != "b" {
		t.Errorf("the request for b went to %s", other.Backend().Name)
	}
	other.Release(Result{Status: 200})
	first.Prefilled()
	s := testutil.Recv(t, testutil.Timeout, out, "the request for a, once the work ahead ended")
	if s.err != nil {
		t.Fatal(s.err)
	}
	s.lease.Release(Result{Status: 200})
	first.Release(Result{Status: 200})
}

func TestAPickHeldBackByTheTTFTBoundTeachesTheTreeNothing(t *testing.T) {
	// The request held back is picked again at each dispatch: were its text recorded as
	// routed at each of those picks, it would look cached, and go past the bound.
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 100), DecodePolicy: routerconfig.PolicyCacheAware, Queue: routerconfig.QueueConfig{TTFTBound: 100 * time.Millisecond},
		CacheAware: routerconfig.CacheAwareConfig{PrefillTokensPerSecond: 1000, PrefillOverhead: 10 * time.Millisecond}}
	r, _, _ := newTestRouter(t, cfg)
	first := mustAcquire(t, r, routerconfig.RoleDecode, Hint{Text: distinctText(0, 200)})
	text := distinctText(1, 200)
	out := make(chan servedBy, 1)
	go func() {
		l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Text: text, Flow: Flow{Key: "t"}})
		out <- servedBy{"t", l, err}
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { return queued(r, routerconfig.RoleDecode) == 1 }, "the request to wait")
	for range 3 {
		r.decode.kick() // dispatches that find it still held back
	}
	if n := queued(r, routerconfig.RoleDecode); n != 1 {
		t.Fatalf("%d waiting after the dispatches, want 1: held-back picks must not make its text look cached", n)
	}
	ca := r.decode.policy.(*CacheAware)
	if got := ca.tree.MatchOne(text, "d0", time.Time{}); got != 0 {
		t.Errorf("the tree credits %d bytes of the held-back request's text to d0, want 0", got)
	}
	first.Prefilled()
	s := testutil.Recv(t, testutil.Timeout, out, "the request, once the work ahead ended")
	if s.err != nil {
		t.Fatal(s.err)
	}
	s.lease.Release(Result{Status: 200})
	first.Release(Result{Status: 200})
}
