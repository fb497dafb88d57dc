package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// flowAnswer is one answer as a client of the flood test sees it.
type flowAnswer struct {
	code int
	// done is whether a 200 stream ended with [DONE].
	done bool
	// retryAfter is the Retry-After header; errCode and errType the OpenAI error's code and
	// type, "" when the body is not in the OpenAI shape.
	retryAfter, errCode, errType string
	err                          error
}

// flowRequest sends a streamed completion as tenant and reads its answer to the end.
func flowRequest(ctx context.Context, client *http.Client, url, tenant, prompt string, maxTokens int) flowAnswer {
	body := fmt.Sprintf(`{"model":"sim","prompt":%q,"max_tokens":%d,"ignore_eos":true,"stream":true}`, prompt, maxTokens)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return flowAnswer{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Tenant", tenant)
	resp, err := client.Do(req)
	if err != nil {
		return flowAnswer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return flowAnswer{code: resp.StatusCode, err: err}
	}
	a := flowAnswer{code: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After")}
	if resp.StatusCode == http.StatusOK {
		a.done = strings.HasSuffix(strings.TrimSpace(string(b)), "data: [DONE]")
		return a
	}
	var e struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    string `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &e) == nil && e.Error != nil && e.Error.Message != "" {
		a.errCode, a.errType = e.Error.Code, e.Error.Type
	}
	return a
}

// TestAFloodingTenantIsRefusedWhileAQuietTenantIsServed: two tenants named by a header share
// a decoder of max_inflight 2 and a small queue; the noisy one floods it with 16 concurrent
// streams while the quiet one sends its requests one after another. Every quiet request is
// answered 200; the noisy tenant's excess is refused 429 tenant_queue_full with Retry-After
// in the OpenAI shape, never 503 (the queue of 8 never fills: 2 noisy waiters at most, 1
// quiet); the engines got exactly one request per 200 (a refused request reaches none:
// the decoder's slot is reserved before the prefill); and nothing is in flight, queued or
// held on the engines after. Counts and statuses only: the machine is shared.
func TestAFloodingTenantIsRefusedWhileAQuietTenantIsServed(t *testing.T) {
	const (
		floodClients   = 16
		quietRequests  = 12
		maxInflight    = 2
		maxQueueTenant = 2
	)
	s := startStack(t, fastSims, func(c *app.Config) {
		c.Sims[1].MaxInflight = maxInflight
		c.Router.Queue = routerconfig.QueueConfig{Size: 8}
		c.Proxy.FlowControl = proxy.FlowControlConfig{
			TenantHeader:      "X-Tenant",
			Tenants:           map[string]proxy.TenantConfig{"noisy": {}, "quiet": {}},
			MaxQueuePerTenant: maxQueueTenant,
			// Far beyond any wait here: a 503 queue_timeout would be the machine's, not
			// the flow control's.
			QueueTimeout: time.Minute,
		}
	})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: floodClients + 1}}
	t.Cleanup(client.CloseIdleConnections)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The flood: each client sends stream after stream until the quiet tenant is done,
	// pausing briefly after a refusal (a flooding client, not a spinning one).
	var (
		mu    sync.Mutex
		noisy []flowAnswer
		wg    sync.WaitGroup
	)
	refused := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, a := range noisy {
			if a.code == http.StatusTooManyRequests {
				n++
			}
		}
		return n
	}
	stop := make(chan struct{})
	for c := range floodClients {
		wg.Go(func() {
			pause := time.NewTimer(0)
			defer pause.Stop()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-pause.C:
				}
				a := flowRequest(ctx, client, s.url, "noisy", fmt.Sprintf("noisy %d %d", c, i), 32)
				mu.Lock()
				noisy = append(noisy, a)
				mu.Unlock()
				if a.err != nil {
					return
				}
				var next time.Duration
				if a.code != http.StatusOK {
					next = 10 * time.Millisecond
				}
				pause.Reset(next)
			}
		})
	}
	// The decoder is saturated once the noisy tenant is refused.
	testutil.WaitFor(t, 30*time.Second, func() (bool, string) {
		return refused() > 0, "the noisy tenant's flood was never refused"
	})

	var quiet []flowAnswer
	for i := range quietRequests {
		quiet = append(quiet, flowRequest(ctx, client, s.url, "quiet", fmt.Sprintf("quiet %d", i), 8))
	}
	refusedDuringQuiet := refused()
	close(stop)
	wg.Wait()

	ok, refusals := 0, 0 // over both tenants: what the engines and the proxy's counters saw
	for i, a := range quiet {
		switch a.code {
		case http.StatusOK:
			ok++
		case http.StatusTooManyRequests:
			refusals++
		}
		if a.err != nil || a.code != http.StatusOK || !a.done {
			t.Errorf("quiet request %d: status %d, [DONE] %v, err %v; want 200 to its end: a flood of another tenant delays it, never refuses it",
				i, a.code, a.done, a.err)
		}
	}
	statuses := map[int]int{}
	for _, a := range noisy {
		statuses[a.code]++
		switch {
		case a.err != nil:
			t.Errorf("a noisy request: %v", a.err)
		case a.code == http.StatusOK:
			ok++
			if !a.done {
				t.Error("a noisy stream answered 200 did not end with [DONE]")
			}
		case a.code == http.StatusTooManyRequests:
			if ra, err := strconv.Atoi(a.retryAfter); err != nil || ra < 1 {
				t.Errorf("a noisy 429 with Retry-After %q, want a number of seconds", a.retryAfter)
			}
			if a.errCode != "tenant_queue_full" || a.errType == "" {
				t.Errorf("a noisy 429: error code %q, type %q; want tenant_queue_full in the OpenAI shape", a.errCode, a.errType)
			}
		default:
			t.Errorf("a noisy request answered %d: want 200 or 429 (the queue never fills, so no 503)", a.code)
		}
	}
	t.Logf("noisy: %v (%d refused before the quiet tenant was done); quiet: %d answered, %d of them 200", statuses, refusedDuringQuiet, len(quiet), ok-statuses[http.StatusOK])
	if statuses[http.StatusTooManyRequests] == 0 || statuses[http.StatusOK] == 0 {
		t.Errorf("noisy: %v; want both 200s (its share) and 429s (its excess)", statuses)
	}

	refusals += statuses[http.StatusTooManyRequests]

	s.assertQuiet(10 * time.Second)
	reg := s.m.Registry
	for _, u := range s.allSimURLs() {
		if n := kv(t, u).RequestsTotal; n != ok {
			t.Errorf("%s got %d requests for %d answered 200: a refused request reached an engine", u, n, ok)
		}
	}
	if v := testutil.Value(t, reg, "pdproxy_requests_total", map[string]string{"code": "429"}); v != float64(refusals) {
		t.Errorf("pdproxy_requests_total{code=429} = %v, want the %d the clients got", v, refusals)
	}
	if v := testutil.Value(t, reg, "pdproxy_queue_rejected_total", map[string]string{"role": "decode", "reason": "tenant_full"}); v != float64(refusals) {
		t.Errorf("pdproxy_queue_rejected_total{decode,tenant_full} = %v, want the %d 429s", v, refusals)
	}
	for _, tenant := range []string{"noisy", "quiet"} {
		if v := testutil.Value(t, reg, "pdproxy_flow_queue_depth", map[string]string{"tenant": tenant}); v != 0 {
			t.Errorf("pdproxy_flow_queue_depth{tenant=%s} = %v after the flood, want 0", tenant, v)
		}
	}
	if v := testutil.Value(t, reg, "pdproxy_queue_waiting_requests", nil); v != 0 {
		t.Errorf("pdproxy_queue_waiting_requests = %v after the flood, want 0", v)
	}
}
