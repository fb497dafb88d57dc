package sim

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/router/enginemetrics"
)

// answerUsage posts a non-streaming body and returns its usage (a
// Responses API answer's in completions' names).
func answerUsage(t *testing.T, ts *testServer, path, body string, hdr map[string]string) usage {
	t.Helper()
	resp := ts.post(t, context.Background(), path, body, hdr)
	b := readAll(t, resp)
	var ans struct {
		Usage usage `json:"usage"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &ans) != nil {
		t.Fatalf("%s: status %d: %s", path, resp.StatusCode, b)
	}
	if path == "/v1/responses" {
		var r struct {
			Usage *struct {
				InputTokens        int `json:"input_tokens"`
				OutputTokens       int `json:"output_tokens"`
				InputTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"input_tokens_details"`
			} `json:"usage"`
		}
		if json.Unmarshal(b, &r) != nil || r.Usage == nil {
			t.Fatalf("%s: no usage in %s", path, b)
		}
		u := r.Usage
		return usage{PromptTokens: u.InputTokens, CompletionTokens: u.OutputTokens, TotalTokens: u.InputTokens + u.OutputTokens,
			PromptTokensDetails: &promptTokensDetails{CachedTokens: u.InputTokensDetails.CachedTokens}}
	}
	return ans.Usage
}

func cachedTokens(u usage) int {
	if u.PromptTokensDetails == nil {
		return -1
	}
	return u.PromptTokensDetails.CachedTokens
}

func TestAPromptSentTwiceIsAPrefixCacheHitTheSecondTime(t *testing.T) {
	prompt := strings.Repeat("abcd", 200) // 200 tokens: 12 full blocks and 8 tokens
	tests := []struct {
		name       string
		cfg        func(*Config)
		path, body string
		tokens     int
		wantCached int
	}{
		{"completions", nil, "/v1/completions", `{"prompt":"` + prompt + `","max_tokens":1}`, 200, 192},
		{"chat", nil, "/v1/chat/completions", `{"messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":1}`, 210, 208},
		{"responses, as the chat", nil, "/v1/responses", `{"input":"` + prompt + `","max_output_tokens":1}`, 210, 208},
		{"sglang, aggregated", func(c *Config) { c.Protocol, c.Role = ProtocolSGLang, "decode" }, "/v1/completions",
			`{"prompt":"` + prompt + `","max_tokens":1}`, 200, 192},
		{"a prompt of exactly 12 blocks recomputes its last block", nil, "/v1/completions",
			`{"prompt":"` + prompt[:192*4] + `","max_tokens":1}`, 192, 176},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := fastConfig()
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			ts := startServer(t, cfg)
			if u := answerUsage(t, ts, tt.path, tt.body, nil); u.PromptTokens != tt.tokens || cachedTokens(u) != 0 {
				t.Fatalf("first answer usage %+v, want %d prompt tokens, 0 cached", u, tt.tokens)
			}
			s := ts.waitKV(t, "the first request ends", allFree)
			if s.CachedBlocks != tt.tokens/16 || s.PrefixCacheQueriesTotal != tt.tokens || s.PrefixCacheHitsTotal != 0 || s.PromptTokensComputedTotal != tt.tokens {
				t.Errorf("after the first request /debug/kv = %+v, want %d cached blocks, %d queried and computed, 0 hits", s, tt.tokens/16, tt.tokens)
			}
			if u := answerUsage(t, ts, tt.path, tt.body, nil); cachedTokens(u) != tt.wantCached {
				t.Errorf("second answer usage %+v, want %d cached tokens", u, tt.wantCached)
			}
			s = ts.waitKV(t, "the second request ends", allFree)
			if s.PrefixCacheQueriesTotal != 2*tt.tokens || s.PrefixCacheHitsTotal != tt.wantCached || s.PromptTokensComputedTotal != 2*tt.tokens-tt.wantCached {
				t.Errorf("after the second request /debug/kv = %+v, want %d queried, %d hits, %d computed", s, 2*tt.tokens, tt.wantCached, 2*tt.tokens-tt.wantCached)
			}
			metrics := string(ts.get(t, "/metrics"))
			want := "pdproxy_sim_prefix_cache_hits_total{model_name=\"sim\"} " + itoa(tt.wantCached)
			if cfg.Protocol != ProtocolSGLang {
				want = "vllm:prefix_cache_hits_total{model_name=\"sim\"} " + itoa(tt.wantCached)
			}
			if !strings.Contains(metrics, want) {
				t.Errorf("/metrics lacks %q", want)
			}
			// A router reads from them what the KV pool took in against what it holds.
			l, err := enginemetrics.Parse([]byte(metrics), enginemetrics.Families)
			wantKV := enginemetrics.KV{Stored: float64(2*tt.tokens - tt.wantCached), Capacity: float64(cfg.KVBlocks * cfg.BlockSize)}
			if err != nil || l.KV != wantKV {
				t.Errorf("a router reads the KV pool as %+v (error %v), want %+v", l.KV, err, wantKV)
			}
		})
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

func TestACachedPrefixIsNotComputedAgain(t *testing.T) {
	// A fake clock and a second per token: the first prefill needs 200s,
	// the second (192 tokens cached) 8s. Advancing the clock 8s ends the
	// second and not the first.
	prompt := `{"prompt":"` + strings.Repeat("abcd", 200) + `","max_tokens":1}`
	tests := []struct {
		name    string
		disable bool
		warm    bool // the prompt was served once before
		done    bool // the request ends 8s after its admission
	}{
		{"a cold prompt computes every token", false, false, false},
		{"a warm prompt computes its uncached tokens only", false, true, true},
		{"without prefix caching a warm prompt computes every token", true, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			cfg := fastConfig()
			cfg.Clock, cfg.PrefillTime, cfg.PrefillPerToken, cfg.ITL = clock, 0, time.Second, 0
			cfg.DisablePrefixCache = tt.disable
			ts := startServer(t, cfg)
			run := func() <-chan usage {
				out := make(chan usage, 1)
				go func() {
					resp, err := ts.do(context.Background(), "/v1/completions", prompt, nil)
					if err != nil {
						close(out)
						return
					}
					var ans struct {
						Usage usage `json:"usage"`
					}
					_ = json.NewDecoder(resp.Body).Decode(&ans)
					resp.Body.Close()
					out <- ans.Usage
				}()
				return out
			}
			if tt.warm {
				first := run()
				ts.waitKV(t, "the warm-up is admitted", func(s KVStats) bool { return s.RunningRequests == 1 })
				clock.Advance(200 * time.Second)
				<-first
				ts.waitKV(t, "the warm-up ends", allFree)
			}
			got := run()
			ts.waitKV(t, "the request is admitted", func(s KVStats) bool { return s.RunningRequests == 1 })
			clock.Advance(8 * time.Second)
			if tt.done {
				if u := <-got; cachedTokens(u) != 192 {
					t.Errorf("usage %+v, want 192 cached tokens", u)
				}
				return
			}
			// Not done: one more second, and it is still running; the rest
			// of its prefill ends it.
			clock.Advance(time.Second)
			if s := ts.kv(t); s.RunningRequests != 1 {
				t.Fatalf("/debug/kv = %+v 9s into a 200s prefill, want it running", s)
			}
			clock.Advance(200 * time.Second)
			if u := <-got; cachedTokens(u) > 0 {
				t.Errorf("usage %+v, want nothing cached", u)
			}
		})
	}
}

// pulledWith is how many of the blocks of prompt a decoder pulls when it
// served warm before: all but the leading full blocks the two share (short
// of the last token, which is always computed).
func pulledWith(warm, prompt string) int {
	a, b := promptTokens(warm), promptTokens(prompt)
	common := 0
	for common < min(len(a), len(b)) && a[common] == b[common] {
		common++
	}
	if warm == "" {
		common = 0
	}
	hits := min(common/16, (len(b)-1)/16)
	return (len(b)+15)/16 - hits
}

func TestADecoderHoldingAPrefixPullsOnlyTheRest(t *testing.T) {
	system := strings.Repeat("system prompt words ", 40) // a shared prefix of 15 blocks
	user := " user one" + strings.Repeat(" more words", 10)
	body := func(text, kv string) string {
		b := `{"prompt":"` + text + `","max_tokens":2,"ignore_eos":true`
		if kv != "" {
			b += `,"kv_transfer_params":` + kv
		}
		return b + "}"
	}
	tests := []struct {
		name       string
		warm       string // what the decoder served before, aggregated ("" nothing)
		disable    bool
		wantPulled int
	}{
		{"a cold decoder pulls every block", "", false, pulledWith("", system+user)},
		{"a decoder that served the same prompt pulls only its partial last block", system + user, false, 1},
		{"a decoder that served the shared prefix pulls the rest", system + " another user entirely", false, pulledWith(system+" another user entirely", system+user)},
		{"without prefix caching a warm decoder pulls every block", system + user, true, pulledWith("", system+user)},
	}
	if c, s := tests[0].wantPulled, tests[2].wantPulled; s <= 1 || s >= c {
		t.Fatalf("the shared-prefix case pulls %d of %d blocks: the workload does not tell the cases apart", s, c)
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startServer(t, fastConfig())
			dc := fastConfig()
			dc.DisablePrefixCache = tt.disable
			d := startServer(t, dc)
			if tt.warm != "" {
				answerUsage(t, d, "/v1/completions", body(tt.warm, ""), nil)
			}
			rid := "pull-" + itoa(i)
			kv := prefillHold(t, p, rid, body(system+user, prefillKV[len(`"kv_transfer_params":`):]))
			var params kvTransferParams
			if err := json.Unmarshal([]byte(kv), &params); err != nil {
				t.Fatal(err)
			}
			u := answerUsage(t, d, "/v1/completions", body(system+user, kv), map[string]string{"X-Request-Id": rid})
			p.waitKV(t, "the prefiller frees its hold", allFree)
			s := d.waitKV(t, "the decoder ends", allFree)
			if s.KVBlocksPulledTotal != tt.wantPulled {
				t.Errorf("decoder pulled %d of %d blocks (usage %+v), want %d", s.KVBlocksPulledTotal, len(params.RemoteBlockIDs), u, tt.wantPulled)
			}
			full := len(promptTokens(system+user)) / 16
			if !tt.disable && s.CachedBlocks < full {
				t.Errorf("decoder caches %d blocks after the pull, want the prompt's %d full blocks among them", s.CachedBlocks, full)
			}
			if tt.disable && s.CachedBlocks != 0 {
				t.Errorf("decoder without prefix caching caches %d blocks", s.CachedBlocks)
			}
		})
	}
}

func TestCachedBlocksNobodyReferencesAreFreeAndEvictedOldestFirst(t *testing.T) {
	cfg := fastConfig()
	cfg.KVBlocks = 8
	ts := startServer(t, cfg)
	prompt := func(c string) string { return `{"prompt":"` + strings.Repeat(c, 4*16*3) + `","max_tokens":1}` } // 48 tokens: 3 full blocks
	for _, c := range []string{"a", "b"} {
		answerUsage(t, ts, "/v1/completions", prompt(c), nil)
	}
	s := ts.waitKV(t, "both ended", allFree)
	if s.CachedBlocks != 6 || s.BlocksFree != 8 {
		t.Fatalf("/debug/kv = %+v, want 6 cached blocks, all 8 free", s)
	}
	// A third prompt needs 3 blocks: 2 free ones and the oldest cached one.
	answerUsage(t, ts, "/v1/completions", prompt("c"), nil)
	ts.waitKV(t, "c ended", allFree)
	if u := answerUsage(t, ts, "/v1/completions", prompt("b"), nil); cachedTokens(u) != 32 {
		t.Errorf("b after c: usage %+v, want its first 2 blocks still cached (32 tokens; the last is recomputed)", u)
	}
	if u := answerUsage(t, ts, "/v1/completions", prompt("a"), nil); cachedTokens(u) == 32 {
		t.Errorf("a after c: usage %+v, want a's blocks (the least recently used) evicted, at least in part", u)
	}
}

func TestAnSGLangDecoderHoldingThePromptPullsOnlyItsLastBlockAndBothEnginesCache(t *testing.T) {
	prompt := strings.Repeat("abcd", 200) // 200 tokens: 13 blocks, 12 full
	body := `{"model":"sim","prompt":"` + prompt + `","max_tokens":2,"ignore_eos":true}`
	pr := startPair(t, sglangConfig("prefill"), sglangConfig("decode"))
	for i, wantPulled := range []int{13, 13 + 1} {
		leg := pr.leg(t, body, "sg-cache-"+itoa(i), uint64(7000+i), 1)
		pLeg := pr.p.send(context.Background(), "/v1/completions", leg, nil)
		dLeg := pr.d.send(context.Background(), "/v1/completions", leg, nil)
		d, p := recvAnswer(t, dLeg, "the decoder's answer"), recvAnswer(t, pLeg, "the prefiller's answer")
		if d.status != http.StatusOK || p.status != http.StatusOK {
			t.Fatalf("round %d: decoder %d %s\nprefiller %d %s", i, d.status, d.body, p.status, p.body)
		}
		ds := pr.d.waitKV(t, "the decoder ends", sglangDone)
		ps := pr.p.waitKV(t, "the prefiller frees the room", sglangDone)
		if ds.KVBlocksPulledTotal != wantPulled || ds.CachedBlocks != 12 || ps.CachedBlocks != 12 {
			t.Errorf("round %d: decoder pulled %d blocks in all, caches %d; prefiller caches %d; want %d pulled, 12 cached on each",
				i, ds.KVBlocksPulledTotal, ds.CachedBlocks, ps.CachedBlocks, wantPulled)
		}
		if want := 192 * i; ps.PrefixCacheHitsTotal != want || ds.PrefixCacheHitsTotal != want {
			t.Errorf("round %d: hits prefiller %d, decoder %d, want %d each", i, ps.PrefixCacheHitsTotal, ds.PrefixCacheHitsTotal, want)
		}
	}
}

func TestPrefillsShareTheEnginesComputeWithAStepBudget(t *testing.T) {
	// A fake clock and a second per token: two 200-token prompts arriving together each
	// need 200s alone. Sharing the compute, the second ends 200s after the first.
	prompt := func(word string) string {
		return `{"prompt":"` + strings.Repeat(word, 200) + `","max_tokens":1}`
	}
	tests := []struct {
		name    string
		batched int
		// second is how long after the first the second prefill ends.
		second time.Duration
	}{
		{"with a step budget two prefills take twice as long as one", 2048, 200 * time.Second},
		{"without one each computes on its own", 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := newFakeClock()
			cfg := fastConfig()
			cfg.Clock, cfg.PrefillTime, cfg.PrefillPerToken, cfg.ITL = clock, 0, time.Second, 0
			cfg.MaxNumBatchedTokens = tt.batched
			ts := startServer(t, cfg)
			done := make(chan string, 2)
			for _, w := range []string{"abcd", "wxyz"} {
				go func() {
					resp, err := ts.do(context.Background(), "/v1/completions", prompt(w), nil)
					if err == nil {
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
					done <- w
				}()
			}
			ts.waitKV(t, "both are admitted", func(s KVStats) bool { return s.RunningRequests == 2 })
			clock.Advance(200 * time.Second)
			<-done
			if tt.second == 0 {
				<-done
				return
			}
			clock.Advance(tt.second - time.Second)
			if s := ts.kv(t); s.RunningRequests != 1 {
				t.Fatalf("/debug/kv = %+v a second before the second prefill's end, want it running", s)
			}
			clock.Advance(time.Second)
			<-done
		})
	}
}
