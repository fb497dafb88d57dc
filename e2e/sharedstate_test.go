package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/sharedstate"
)

// sharedReplicas starts n replicas of the embedded default, each with its own simulated
// engines, sharing per_key limits through the Redis at addr.
func sharedReplicas(t *testing.T, n int, addr string, limits proxy.KeyLimits) []*stack {
	t.Helper()
	// The most the config allows: this is about what the replicas share, and a loaded
	// machine should not make a check miss its budget (each one that does is counted, and
	// the tests below count none).
	budget := sharedstate.MaxTimeout
	var rs []*stack
	for range n {
		rs = append(rs, startStack(t, func(c *app.Config) {
			fastSims(c)
			c.Proxy.Limits = proxy.LimitsConfig{PerKey: limits}
			c.SharedState = sharedstate.Config{Redis: sharedstate.RedisConfig{Addr: addr, Timeout: &budget}}
		}))
	}
	return rs
}

// completionStatus sends a small completion with key and returns its status and, for an
// error, its code.
func completionStatus(t *testing.T, base, key string) (int, string) {
	t.Helper()
	resp := post(t, context.Background(), base+"/v1/completions", `{"model":"sim","prompt":"hi","max_tokens":2}`, "Authorization", "Bearer "+key)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK {
		return resp.StatusCode, ""
	}
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	json.Unmarshal(b, &e)
	if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get("Retry-After") == "" {
		t.Errorf("a 429 without Retry-After: %s", b)
	}
	return resp.StatusCode, e.Error.Code
}

func TestAKeyOverItsLimitIsRefusedByEveryReplica(t *testing.T) {
	srv := redistest.Start(t)
	limits := proxy.KeyLimits{RequestsPerSecond: 5, Burst: 5}
	rs := sharedReplicas(t, 3, srv.Addr(), limits)
	// A client alternating replicas request by request, about 15 requests a second for 3 s:
	// each replica alone would let through nearly all of them. The gaps vary, so that no
	// replica's turn keeps falling where the key's next request is due (at a steady 15/s,
	// one replica in three would get every one the limit lets through).
	gaps := rand.New(rand.NewPCG(29, 3))
	allowed := make([]int, len(rs))
	refused := make([]int, len(rs))
	start := time.Now()
	pace := time.NewTimer(0)
	defer pace.Stop()
	for i := range 45 {
		<-pace.C
		pace.Reset(20*time.Millisecond + time.Duration(gaps.IntN(90))*time.Millisecond)
		r := i % len(rs)
		switch code, errCode := completionStatus(t, rs[r].url, "team-key"); {
		case code == http.StatusOK:
			allowed[r]++
		case code == http.StatusTooManyRequests && errCode == "rate_limit_exceeded":
			refused[r]++
		default:
			t.Fatalf("request %d on replica %d: %d %s", i, r, code, errCode)
		}
	}
	elapsed := time.Since(start)
	total := allowed[0] + allowed[1] + allowed[2]
	want := float64(limits.Burst) + limits.RequestsPerSecond*elapsed.Seconds()
	if math.Abs(float64(total)-want) > math.Max(3, 0.1*want) {
		t.Errorf("the replicas let %v through (%d) in %s, want about %.0f in all: one key's limit across them, as one replica's", allowed, total, elapsed, want)
	}
	for i, s := range rs {
		if refused[i] == 0 {
			t.Errorf("replica %d refused none of the key's requests (allowed %d)", i, allowed[i])
		}
		if v := testutil.Value(t, s.m.Registry, "pdproxy_limit_rejected_total", map[string]string{"reason": "rate"}); v != float64(refused[i]) {
			t.Errorf("replica %d counted %v refusals of reason rate, it gave %d", i, v, refused[i])
		}
		if v := testutil.Value(t, s.m.Registry, "pdproxy_shared_state_errors_total", nil); v != 0 {
			t.Errorf("replica %d counted %v shared state errors, want 0: it decided some requests alone", i, v)
		}
	}
	for _, s := range rs {
		s.assertQuiet(time.Second)
	}
}

func TestRedisKilledAndRestartedMidRunFailsNoRequest(t *testing.T) {
	srv := redistest.Start(t)
	rs := sharedReplicas(t, 3, srv.Addr(), proxy.KeyLimits{RequestsPerSecond: 1000, Burst: 1000, MaxConcurrent: 100})
	var (
		mu     sync.Mutex
		failed []string
		served int
	)
	// Four clients, each alternating replicas, while Redis dies and comes back.
	run := func(d time.Duration) {
		var wg sync.WaitGroup
		for c := range 4 {
			wg.Go(func() {
				start := time.Now()
				for i := 0; time.Since(start) < d && i < 40; i++ {
					code, errCode := completionStatus(t, rs[(c+i)%len(rs)].url, fmt.Sprintf("client-%d", c))
					mu.Lock()
					if code == http.StatusOK {
						served++
					} else {
						failed = append(failed, fmt.Sprintf("%d %s", code, errCode))
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	}
	run(300 * time.Millisecond)
	srv.Stop()
	run(300 * time.Millisecond)
	srv.Restart()
	for i, s := range rs {
		testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
			v := testutil.Value(t, s.m.Registry, "pdproxy_shared_state_up", nil)
			return v == 1, fmt.Sprintf("replica %d: pdproxy_shared_state_up = %v after Redis came back", i, v)
		})
	}
	run(300 * time.Millisecond)
	if len(failed) > 0 {
		t.Fatalf("%d requests failed (of %d): %v", len(failed), len(failed)+served, failed)
	}
	errs := 0.0
	for _, s := range rs {
		errs += testutil.Value(t, s.m.Registry, "pdproxy_shared_state_errors_total", map[string]string{"op": "check"})
	}
	if errs == 0 {
		t.Error("no shared state errors counted with Redis killed mid-run")
	}
	for _, s := range rs {
		s.assertQuiet(time.Second)
	}
}
