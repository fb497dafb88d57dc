package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// identity is what a request's KV blocks are keyed by beyond its tokens: the model (an
// adapter is keyed by its name) and the cache_salt.
type identity struct{ model, salt string }

// completeAs posts a completion of prompt as id to url and returns its usage.
func completeAs(t *testing.T, url string, id identity, prompt string) (promptTokens, cached int) {
	t.Helper()
	req := map[string]any{"model": id.model, "prompt": prompt, "max_tokens": 2}
	if id.salt != "" {
		req["cache_salt"] = id.salt
	}
	body, _ := json.Marshal(req)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp := post(t, ctx, url+"/v1/completions", string(body))
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var ans struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &ans) != nil {
		t.Fatalf("POST %s/v1/completions as %+v: status %d: %s", url, id, resp.StatusCode, b)
	}
	return ans.Usage.PromptTokens, ans.Usage.PromptTokensDetails.CachedTokens
}

// metricSum sums every sample of the proxy's /metrics whose series starts with prefix.
func metricSum(t *testing.T, url, prefix string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, prefix) {
			f, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
			if err != nil {
				t.Fatalf("metric line %q: %v", l, err)
			}
			sum += f
		}
	}
	return sum
}

// identityStack runs n decoders serving model sim and its adapters ad and ad2, each
// publishing its KV events, behind a proxy routing them by policy, and, for
// precise_cache_aware, waits until the proxy hears every engine's events and knows the
// adapters.
func identityStack(t *testing.T, n int, policy string, tweak func(*sim.Config)) (*stack, []string, []*sim.Engine) {
	t.Helper()
	base := sim.DefaultConfig()
	base.Role = "decode"
	base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
	base.PrefillPerToken = 5 * time.Microsecond
	base.LoRAModules = "ad=/adapters/ad,ad2=/adapters/ad2"
	if tweak != nil {
		tweak(&base)
	}
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	cfg.Router.DecodePolicy = policy
	cfg.Router.Health.Interval = 100 * time.Millisecond
	var urls []string
	var engines []*sim.Engine
	for i := range n {
		c := base
		port := freePort(t)
		c.KVEventsEndpoint = fmt.Sprintf("tcp://*:%d", port)
		e, url := startSim(t, c)
		urls, engines = append(urls, url), append(engines, e)
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: url, Role: routerconfig.RoleDecode,
			Engine: "sim", KVEventsEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port)})
	}
	s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
	if policy != routerconfig.PolicyPreciseCacheAware {
		return s, urls, engines
	}
	// The publishers drop what they send before the proxy's subscriptions arrive.
	warm := 0
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		warm++ // a new prompt each time: a cached one publishes nothing
		heard := true
		for i, url := range urls {
			completeAs(t, url, identity{model: "sim"}, fmt.Sprintf("warm%d", warm)+tieredText("w", 8))
			heard = heard && blocksOn(s, fmt.Sprintf("d%d", i), "gpu") > 0
		}
		return heard && s.m.Router.Adapter("ad"), fmt.Sprintf("the proxy hears no KV event of every engine, or knows no adapter: %+v", s.m.Router.Backends())
	})
	return s, urls, engines
}

// predicted is the share of the prompt the proxy's picks since the counts were before
// predicted the engines it picked to hold, on average.
func predicted(t *testing.T, url string, sumBefore, countBefore float64) float64 {
	t.Helper()
	sum := metricSum(t, url, `pdproxy_prefix_cache_match_ratio_sum{policy="precise_cache_aware",role="decode"}`)
	count := metricSum(t, url, `pdproxy_prefix_cache_match_ratio_count{policy="precise_cache_aware",role="decode"}`)
	if count == countBefore {
		t.Fatal("no pick was scored by the cache")
	}
	return (sum - sumBefore) / (count - countBefore)
}

func TestAPromptComputedUnderAnotherIdentityIsPredictedAndServedUncached(t *testing.T) {
	base, adapter := identity{model: "sim"}, identity{model: "ad"}
	tenantA, tenantB := identity{model: "sim", salt: "tenant-a"}, identity{model: "sim", salt: "tenant-b"}
	tests := []struct {
		name          string
		first, second identity
		hit           bool // the second may use the first's blocks
	}{
		{"a LoRA request after the base model's identical prompt", base, adapter, false},
		{"tenant B after tenant A with another salt", tenantA, tenantB, false},
		{"an unsalted request after a salted one", tenantA, base, false},
		{"the adapter again", adapter, adapter, true},
		{"tenant A again", tenantA, tenantA, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _, _ := identityStack(t, 1, routerconfig.PolicyPreciseCacheAware, nil)
			prompt := "shared" + tieredText("p", 300) // 600 tokens
			completeAs(t, s.url, tt.first, prompt)
			toks, err := s.m.Router.Tokens(context.Background(), router.TokenizeRequest{Model: tt.first.model, Prompt: prompt})
			if err != nil {
				t.Fatal(err)
			}
			firstHint := router.Hint{Tokens: toks, CacheSalt: tt.first.salt}
			if tt.first.model == "ad" {
				firstHint.LoRA = "ad"
			}
			testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
				n, _ := s.m.Router.CachedTokens("d0", firstHint)
				return n >= len(toks)-16, fmt.Sprintf("the proxy sees %d of the first prompt's %d tokens on d0", n, len(toks))
			})
			sum := metricSum(t, s.url, `pdproxy_prefix_cache_match_ratio_sum{policy="precise_cache_aware",role="decode"}`)
			count := metricSum(t, s.url, `pdproxy_prefix_cache_match_ratio_count{policy="precise_cache_aware",role="decode"}`)
			tokens, cached := completeAs(t, s.url, tt.second, prompt)
			share := predicted(t, s.url, sum, count)
			served := float64(cached) / float64(tokens)
			t.Logf("predicted share %.3f, engine's cached share %.3f", share, served)
			if tt.hit {
				if share < 0.9 || served < 0.9 {
					t.Errorf("predicted share %.3f, engine's cached share %.3f; want both above 0.9", share, served)
				}
			} else if share > 0.05 || served > 0.05 {
				t.Errorf("predicted share %.3f, engine's cached share %.3f (%d of %d tokens); want both at most 0.05", share, served, cached, tokens)
			}
			if d := metricSum(t, s.url, "pdproxy_kv_events_dropped_total{"); d != 0 {
				t.Errorf("%v KV events dropped, want none", d)
			}
		})
	}
}

// conversationsHitRatio serves convs conversations of turns turns each through the proxy
// at url, the odd ones on adapter ad, the even ones on the base model, turn after turn, and
// returns the share of each's prompt tokens the engines served from their caches.
func conversationsHitRatio(t *testing.T, url string, convs, turns int) (base, adapter float64) {
	t.Helper()
	var tokens, cached [2]int
	for turn := 1; turn <= turns; turn++ {
		for c := range convs {
			id := identity{model: "sim"}
			if c%2 == 1 {
				id.model = "ad"
			}
			// The same conversations for both: conversation c's text does not depend on
			// the model it is on.
			prompt := fmt.Sprintf("conversation %d:", c/2) + tieredText(fmt.Sprintf("c%d", c/2), 120)
			for k := 1; k < turn; k++ {
				prompt += tieredText(fmt.Sprintf("t%dk%d", c/2, k), 40)
			}
			p, h := completeAs(t, url, id, prompt)
			tokens[c%2] += p
			cached[c%2] += h
		}
	}
	return float64(cached[0]) / float64(tokens[0]), float64(cached[1]) / float64(tokens[1])
}

func TestConversationsOnAnAdapterHitTheCacheAsOftenAsOnTheBaseModel(t *testing.T) {
	const convs, turns = 10, 4 // 10 conversations on 4 engines: a rotation does not keep them in place
	s, _, _ := identityStack(t, 4, routerconfig.PolicyPreciseCacheAware, nil)
	base, adapter := conversationsHitRatio(t, s.url, convs, turns)
	if d := metricSum(t, s.url, "pdproxy_kv_events_dropped_total{"); d != 0 {
		t.Errorf("%v KV events dropped, want none", d)
	}
	li, _, _ := identityStack(t, 4, routerconfig.PolicyLeastInflight, nil)
	liBase, liAdapter := conversationsHitRatio(t, li.url, convs, turns)
	t.Logf("hit ratio: base %.3f, adapter %.3f; least_inflight: base %.3f, adapter %.3f", base, adapter, liBase, liAdapter)
	if diff := base - adapter; diff > 0.05 || diff < -0.05 {
		t.Errorf("the adapter's hit ratio %.3f is %.3f off the base model's %.3f: want within 0.05", adapter, diff, base)
	}
	if adapter < liAdapter+0.1 {
		t.Errorf("the adapter's hit ratio %.3f is less than 0.1 above least_inflight's %.3f", adapter, liAdapter)
	}
}

func TestAHybridModelsPrefixIsCreditedOnlyAsFarAsItsWindowReaches(t *testing.T) {
	// Blocks of 16 tokens, a sliding window of 64: the engine reuses a prefix only up to an
	// end before which its window group holds 4 blocks, and caches only each prompt's last 4.
	s, _, _ := identityStack(t, 1, routerconfig.PolicyPreciseCacheAware, func(c *sim.Config) { c.SlidingWindow = 64 })
	base := identity{model: "sim"}
	prompt := "hybrid" + tieredText("h", 300) // 600 tokens, 37 blocks
	completeAs(t, s.url, base, prompt)
	toks, err := s.m.Router.Tokens(context.Background(), router.TokenizeRequest{Model: "sim", Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		n, _ := s.m.Router.CachedTokens("d0", router.Hint{Tokens: toks})
		return n >= len(toks)-16, fmt.Sprintf("the proxy sees %d of the prompt's %d tokens on d0", n, len(toks))
	})
	tests := []struct {
		name   string
		prompt string
		hit    bool
	}{
		{"a prompt sharing its first half: the window holds nothing before that end", "hybrid" + tieredText("h", 150) + tieredText("x", 150), false},
		{"its continuation: the window holds the blocks before the shared end", prompt + tieredText("y", 40), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sum := metricSum(t, s.url, `pdproxy_prefix_cache_match_ratio_sum{policy="precise_cache_aware",role="decode"}`)
			count := metricSum(t, s.url, `pdproxy_prefix_cache_match_ratio_count{policy="precise_cache_aware",role="decode"}`)
			tokens, cached := completeAs(t, s.url, base, tt.prompt)
			share, served := predicted(t, s.url, sum, count), float64(cached)/float64(tokens)
			t.Logf("predicted share %.3f, engine's cached share %.3f", share, served)
			if tt.hit && (share < 0.8 || served < 0.8) || !tt.hit && (share > 0.05 || served > 0.05) {
				t.Errorf("predicted share %.3f, engine's cached share %.3f (%d of %d tokens); want both %s", share, served, cached, tokens,
					map[bool]string{true: "above 0.8", false: "at most 0.05"}[tt.hit])
			}
		})
	}
	if d := metricSum(t, s.url, "pdproxy_kv_events_dropped_total{"); d != 0 {
		t.Errorf("%v KV events dropped, want none", d)
	}
}
