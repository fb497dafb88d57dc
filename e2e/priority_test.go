package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
)

// TestInteractiveWaitStaysBoundedBehindABatchBurst: with the decoder at max_inflight and a
// burst of batch requests queued for it, an interactive request is served next: it waits for
// the batch request in service only, ahead of every batch request queued before it, while
// every batch request is still served. A client over its key's rate gets a 429 that the
// engines never see.
func TestInteractiveWaitStaysBoundedBehindABatchBurst(t *testing.T) {
	s := startStack(t, func(c *app.Config) {
		c.Sims[0].PrefillTime = 2 * time.Millisecond
		c.Sims[1].PrefillTime = 2 * time.Millisecond
		c.Sims[1].ITL = 4 * time.Millisecond
		c.Sims[1].MaxInflight = 1
		// The batch class writes its priority into the body: the engines schedule by it,
		// and would refuse it otherwise, as vLLM does.
		c.Sims[0].SchedulingPolicy, c.Sims[1].SchedulingPolicy = "priority", "priority"
		c.Proxy.Priority = proxy.PriorityConfig{Header: "X-Priority", Classes: []proxy.PriorityClass{
			{Name: "interactive", Priority: 0},
			{Name: "batch", Priority: 10, MaxQueueWait: time.Minute, SetPriority: true},
		}}
		c.Proxy.Limits = proxy.LimitsConfig{PerKey: proxy.KeyLimits{RequestsPerSecond: 0.01, Burst: 1}, TenantHeader: "X-Tenant"}
	})
	const body = `{"model":"sim","prompt":"%s","max_tokens":25,"ignore_eos":true}`
	type answer struct {
		name string
		code int
		took time.Duration
		// done is the answer's place among those the test's clients read to their end:
		// 1 for the first.
		done int64
	}
	var answered atomic.Int64
	send := func(name, class string) <-chan answer {
		ch := make(chan answer, 1)
		start := time.Now()
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			code := 0
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/completions", strings.NewReader(fmt.Sprintf(body, name)))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Priority", class)
			// Each request is its own tenant: the rate limit is not what this part is about.
			req.Header.Set("X-Tenant", name)
			if resp, err := http.DefaultClient.Do(req); err == nil {
				if _, err := io.Copy(io.Discard, resp.Body); err == nil {
					code = resp.StatusCode
				}
				resp.Body.Close()
			}
			ch <- answer{name, code, time.Since(start), answered.Add(1)}
		}()
		return ch
	}
	queued := func(n int) {
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			v := testutil.Value(t, s.m.Registry, "pdproxy_queue_waiting_requests", map[string]string{"role": "decode"})
			return v == float64(n), fmt.Sprintf("%v requests queued for the decoder, want %d", v, n)
		})
	}

	solo := testutil.Recv(t, 30*time.Second, send("solo", "interactive"), "a request on an idle stack")
	if solo.code != http.StatusOK {
		t.Fatalf("a request on an idle stack: %d", solo.code)
	}
	service := solo.took
	answered.Store(0) // the burst's answers are counted from 1

	const batches = 8
	var batch []<-chan answer
	batch = append(batch, send("batch-0", "batch"))
	queued(0)
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		for _, b := range s.m.Router.Backends() {
			if b.Role == "decode" && b.Inflight == 1 {
				return true, ""
			}
		}
		return false, "the decoder is not busy yet"
	})
	for i := 1; i <= batches; i++ {
		batch = append(batch, send(fmt.Sprintf("batch-%d", i), "batch"))
	}
	queued(batches)
	interactive := testutil.Recv(t, 30*time.Second, send("interactive", "interactive"), "the interactive request")

	for i, ch := range batch {
		b := testutil.Recv(t, 30*time.Second, ch, "a batch request")
		if b.code != http.StatusOK {
			t.Errorf("%s: %d, want 200: no class starves", b.name, b.code)
		}
		if i > 0 && b.done < interactive.done {
			t.Errorf("%s, queued before the interactive request, finished first", b.name)
		}
	}
	t.Logf("a request alone %v; the interactive one behind the burst %v", service, interactive.took)
	if interactive.code != http.StatusOK {
		t.Fatalf("interactive: %d", interactive.code)
	}
	// It waits for the batch request in service, then is served: the second answer of the
	// burst's ten, not the last. Counted, not timed: the machine is shared.
	if interactive.done != 2 {
		t.Errorf("the interactive request was answered %d of %d; want second, after only the batch request in service", interactive.done, batches+2)
	}

	// Over its rate: 429 with Retry-After, and nothing reaches the engines.
	before := testutil.Value(t, s.m.Registry, "pdproxy_backend_requests_total", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp := post(t, ctx, s.url+"/v1/completions", fmt.Sprintf(body, "again"), "X-Tenant", "solo")
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Errorf("a tenant over its rate: %d, Retry-After %q; want 429 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if after := testutil.Value(t, s.m.Registry, "pdproxy_backend_requests_total", nil); after != before {
		t.Errorf("backend requests went from %v to %v for a refused request", before, after)
	}
	s.assertQuiet(10 * time.Second)
}
