package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// tieredText is n words of prefix, 2 tokens each (" w001": " w00" and "1").
func tieredText(prefix string, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, " %s%03d", prefix, i%1000)
	}
	return b.String()
}

// completeOn posts a completion of prompt to url and returns its usage.
func completeOn(t *testing.T, url, prompt string) (promptTokens, cached int) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "sim", "prompt": prompt, "max_tokens": 2})
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
		t.Fatalf("POST %s/v1/completions: status %d: %s", url, resp.StatusCode, b)
	}
	return ans.Usage.PromptTokens, ans.Usage.PromptTokensDetails.CachedTokens
}

// TestASessionOnCPUGoesToItsEngineUnlessAnotherHoldsItOnGPU runs two engines with a CPU tier
// behind precise_cache_aware (decode-only, KV events dialed). A session's first turn was served
// on engine a, whose GPU other prompts then filled: a's events moved the session's blocks to
// CPU. Its next turn goes to a, which reloads those blocks from CPU instead of computing them,
// and says so in its counters and in the answer's cached_tokens. When engine b holds the same
// turn on its GPU, b wins: a CPU block weighs 0.75 of a GPU one.
func TestASessionOnCPUGoesToItsEngineUnlessAnotherHoldsItOnGPU(t *testing.T) {
	tests := []struct {
		name      string
		bOnGPU    bool   // b served the first turn too, and keeps it on its GPU
		wantOn    string // the engine the next turn goes to
		wantTiers string // the proxy's matched tokens by tier for the pick
	}{
		{"the session's engine holds it on CPU and reloads it", false, "a", "cpu"},
		{"another engine holding it on GPU wins over a CPU copy", true, "b", "gpu"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := sim.DefaultConfig()
			base.Role = "decode"
			base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
			base.KVBlocks = 64 // 1,024 tokens: the first turn and two fillers, not three
			base.CPUOffloadBlocks = 256
			base.PrefillPerToken, base.CPUReloadPerBlock = 10*time.Microsecond, 20*time.Microsecond
			urls, ports := map[string]string{}, map[string]int{}
			engines := map[string]*sim.Engine{}
			var backends []routerconfig.BackendConfig
			for _, name := range []string{"a", "b"} {
				cfg := base
				ports[name] = freePort(t)
				cfg.KVEventsEndpoint = fmt.Sprintf("tcp://*:%d", ports[name])
				engines[name], urls[name] = startSim(t, cfg)
				backends = append(backends, routerconfig.BackendConfig{Name: name, URL: urls[name], Role: routerconfig.RoleDecode, Engine: "sim",
					KVEventsEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", ports[name])})
			}
			cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
			cfg.Router.DecodePolicy = routerconfig.PolicyPreciseCacheAware
			cfg.Router.Backends = backends
			s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
			// The publishers drop what they send before the proxy's subscriptions arrive.
			warm := 0
			testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
				warm++ // a new prompt each time: a cached one publishes nothing
				for _, name := range []string{"a", "b"} {
					completeOn(t, urls[name], fmt.Sprintf("warm%d", warm)+tieredText(name, 8))
				}
				return blocksOn(s, "a", "gpu") > 0 && blocksOn(s, "b", "gpu") > 0,
					fmt.Sprintf("the proxy hears no KV event of both engines: %+v", s.m.Router.Backends())
			})

			// The first turn: 400 tokens, 25 full blocks.
			turn1 := "session" + tieredText("t", 200)
			turn1Tokens, _ := completeOn(t, urls["a"], turn1)
			blocks := turn1Tokens / 16
			if tt.bOnGPU {
				completeOn(t, urls["b"], turn1)
			}
			// Three other prompts of 25 blocks fill a's 64: the session's blocks move to CPU.
			for _, f := range []string{"f", "g", "h"} {
				completeOn(t, urls["a"], "filler"+tieredText(f, 200))
			}
			if st := engines["a"].Stats(); st.CPUCachedBlocks < blocks {
				t.Fatalf("engine a's CPU tier holds %d blocks after the fillers, want the session's %d among them", st.CPUCachedBlocks, blocks)
			}
			testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
				ok := blocksOn(s, "a", "cpu") >= blocks && (!tt.bOnGPU || blocksOn(s, "b", "gpu") >= blocks)
				return ok, fmt.Sprintf("the proxy's view: %+v", s.m.Router.Backends())
			})

			// The next turn adds a tool result through the proxy.
			before := map[string]sim.KVStats{"a": engines["a"].Stats(), "b": engines["b"].Stats()}
			matchedBefore := metricValue(t, s.url, `pdproxy_prefix_cache_matched_tokens_total{tier="`+tt.wantTiers+`"}`)
			turn2Tokens, cached := completeOn(t, s.url, turn1+tieredText("r", 50))
			after := map[string]sim.KVStats{"a": engines["a"].Stats(), "b": engines["b"].Stats()}
			other := map[string]string{"a": "b", "b": "a"}[tt.wantOn]
			if got := after[tt.wantOn].RequestsTotal - before[tt.wantOn].RequestsTotal; got != 1 || after[other].RequestsTotal != before[other].RequestsTotal {
				t.Fatalf("the next turn went to %s %d times and to %s %d times, want once to %s", tt.wantOn, got, other,
					after[other].RequestsTotal-before[other].RequestsTotal, tt.wantOn)
			}
			st, was := after[tt.wantOn], before[tt.wantOn]
			gpu := st.PrefixCacheHitsTotal - was.PrefixCacheHitsTotal
			reloaded := st.ExternalPrefixCacheHitsTotal - was.ExternalPrefixCacheHitsTotal
			computed := st.PromptTokensComputedTotal - was.PromptTokensComputedTotal
			wantGPU, wantReloaded := 0, blocks*16
			if tt.wantOn == "b" {
				wantGPU, wantReloaded = blocks*16, 0
			}
			if gpu != wantGPU || reloaded != wantReloaded || computed != turn2Tokens-wantGPU-wantReloaded || cached != wantGPU+wantReloaded {
				t.Errorf("engine %s: %d tokens hit on GPU, %d reloaded from CPU, %d computed, %d cached in the answer, of %d; want %d, %d, %d, %d",
					tt.wantOn, gpu, reloaded, computed, cached, turn2Tokens, wantGPU, wantReloaded, turn2Tokens-wantGPU-wantReloaded, wantGPU+wantReloaded)
			}
			if got := metricValue(t, s.url, `pdproxy_prefix_cache_matched_tokens_total{tier="`+tt.wantTiers+`"}`) - matchedBefore; got < float64(blocks*16) {
				t.Errorf("the proxy counted %v matched tokens on %s for the pick, want the session's %d", got, tt.wantTiers, blocks*16)
			}
		})
	}
}

// blocksOn is how many blocks of tier the proxy's index holds for backend name.
func blocksOn(s *stack, name, tier string) int {
	for _, b := range s.m.Router.Backends() {
		if b.Name == name && b.PrefixCache != nil {
			return b.PrefixCache.BlocksByMedium[tier]
		}
	}
	return 0
}
