package proxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// sharedReplica is a proxy replica whose limits are shared through the Redis at addr: its own
// Store (running until the test ends) and harness.
func sharedReplica(t *testing.T, addr string, cfg Config, d *fakeEngine) (*harness, *prometheus.Registry) {
	t.Helper()
	st, reg := sharedStore(t, addr, "")
	return replicaOn(t, st, cfg, d), reg
}

// sharedStore is a Store on the Redis at addr, running until the test ends, and its registry;
// its keys start with prefix ("" for the default).
func sharedStore(t *testing.T, addr, prefix string) (*sharedstate.Store, *prometheus.Registry) {
	t.Helper()
	// The most the config allows: these tests are about what the replicas share, and a
	// loaded machine should not make a check miss its budget.
	budget := sharedstate.MaxTimeout
	storeReg := prometheus.NewRegistry()
	st, err := sharedstate.New(sharedstate.Config{Redis: sharedstate.RedisConfig{Addr: addr, Timeout: &budget, KeyPrefix: prefix}}, zaptest.NewLogger(t), storeReg)
	if err != nil {
		t.Fatalf("sharedstate.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		st.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		st.Close()
	})
	return st, storeReg
}

// replicaOn is a proxy replica in front of d whose limits are shared through st.
func replicaOn(t *testing.T, st SharedState, cfg Config, d *fakeEngine) *harness {
	t.Helper()
	return newHarnessLogged(t, cfg, routerconfig.Config{Backends: []routerconfig.BackendConfig{decoder("d0", d.URL())}}, lifecycle.Config{}, nil, WithSharedState(st))
}

// checkedState is a replica's shared state, with the error of its last Check kept: nil when
// Redis decided, sharedstate.ErrUnavailable when the Store answered from its back-off without
// asking Redis, another when it asked and Redis failed.
type checkedState struct {
	SharedState
	mu   sync.Mutex
	last error
}

func (c *checkedState) Check(ctx context.Context, req sharedstate.Request) (sharedstate.Decision, error) {
	d, err := c.SharedState.Check(ctx, req)
	c.mu.Lock()
	c.last = err
	c.mu.Unlock()
	return d, err
}

func (c *checkedState) lastErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}

func TestASharedRateLimitHoldsAcrossReplicas(t *testing.T) {
	srv := redistest.Start(t)
	d := newEngine(t, vllmDecode)
	// Two requests per 100 s: the schedule does not move during the test.
	cfg := Config{Limits: LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 0.02, Burst: 2}}}
	a, aReg := sharedReplica(t, srv.Addr(), cfg, d)
	b, bReg := sharedReplica(t, srv.Addr(), cfg, d)
	if resp, body := a.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k1")); resp.StatusCode != http.StatusOK {
		t.Fatalf("the key's first request, on one replica: %d %s", resp.StatusCode, body)
	}
	if resp, body := b.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k1")); resp.StatusCode != http.StatusOK {
		t.Fatalf("its second, on the other: %d %s", resp.StatusCode, body)
	}
	// Each replica alone would let two in: together they let two in, and refuse on both.
	for _, h := range []*harness{a, b} {
		resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k1"))
		assertRefused(t, resp, body, 50)
		if v := h.value("pdproxy_limit_rejected_total", map[string]string{"key": keyName("k1"), "reason": "rate"}); v != 1 {
			t.Errorf("limit_rejected_total{reason=rate} on a replica = %v, want 1", v)
		}
	}
	if n := len(d.generations()); n != 2 {
		t.Errorf("the engine got %d generation calls, want 2", n)
	}
	// Another key has its own schedule.
	if resp, body := b.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k2")); resp.StatusCode != http.StatusOK {
		t.Errorf("another key: %d %s", resp.StatusCode, body)
	}
	for _, reg := range []*prometheus.Registry{aReg, bReg} {
		if v := testutil.Value(t, reg, "pdproxy_shared_state_errors_total", nil); v != 0 {
			t.Errorf("shared state errors %v, want 0", v)
		}
	}
	a.waitQuiet()
	b.waitQuiet()
}

func TestASharedConcurrencyLimitCountsAStreamOnAnotherReplica(t *testing.T) {
	srv := redistest.Start(t)
	g := newGate()
	var d *fakeEngine
	d = newEngine(t, g.handler(&d))
	cfg := Config{Limits: LimitsConfig{PerKey: KeyLimits{MaxConcurrent: 1}}}
	a, _ := sharedReplica(t, srv.Addr(), cfg, d)
	b, _ := sharedReplica(t, srv.Addr(), cfg, d)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, err := a.front.Client().Do(a.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","stream":true}`, bearer("k")))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := readEvent(br); err != nil {
		t.Fatalf("first event: %v", err)
	}
	testutil.Recv(t, testDeadline, g.started, "the stream to start")

	refused, body := b.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k"))
	assertRefused(t, refused, body, 1)
	if v := b.value("pdproxy_limit_rejected_total", map[string]string{"reason": "concurrency"}); v != 1 {
		t.Errorf("limit_rejected_total{reason=concurrency} on the other replica = %v, want 1", v)
	}
	close(g.open)
	io.Copy(io.Discard, br)
	a.waitQuiet()
	// The stream's slot goes back as it ends: the other replica lets the key in again.
	eventually(t, "the key to be admitted on the other replica", func() bool { return b.statusOf(plainCompletion, bearer("k")) == http.StatusOK })
	b.waitQuiet()
}

func TestWithRedisStoppedEachReplicaServesOnItsOwnLimits(t *testing.T) {
	srv := redistest.Start(t)
	d := newEngine(t, vllmDecode)
	cfg := Config{Limits: LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 0.02, Burst: 3}}}
	st, aReg := sharedStore(t, srv.Addr(), "")
	aState := &checkedState{SharedState: st}
	a := replicaOn(t, aState, cfg, d)
	b, _ := sharedReplica(t, srv.Addr(), cfg, d)
	for _, h := range []*harness{b, b, a} {
		if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k")); resp.StatusCode != http.StatusOK {
			t.Fatalf("a request under the shared limit: %d %s", resp.StatusCode, body)
		}
	}
	resp, body := a.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k"))
	assertRefused(t, resp, body, 50)

	// Redis gone: no request fails for it. Replica a goes on from its own bucket (3, less the
	// one it served), so it serves two more and refuses the next: its own limit, at once.
	srv.Stop()
	for i := range 2 {
		if resp, body := a.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k")); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d with Redis stopped, under the replica's own limit: %d %s", i, resp.StatusCode, body)
		}
	}
	resp, body = a.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k"))
	assertRefused(t, resp, body, 50)
	// At once: the Store, backing off since the first request found Redis gone, answered
	// the refusal's check without a round trip to wait for.
	if err := aState.lastErr(); !errors.Is(err, sharedstate.ErrUnavailable) {
		t.Errorf("the refusal's shared check: %v, want %v: decided without asking Redis", err, sharedstate.ErrUnavailable)
	}
	if v := testutil.Value(t, aReg, "pdproxy_shared_state_errors_total", map[string]string{"op": "check"}); v != 3 {
		t.Errorf("shared state check errors %v, want 3: each request decided on the replica's own state", v)
	}
	if v := a.value("pdproxy_requests_total", map[string]string{"code": "200"}); v != 3 {
		t.Errorf("requests answered 200 on the replica: %v, want 3", v)
	}
	a.waitQuiet()
	b.waitQuiet()
}
