package sim

import (
	"strings"
	"testing"
	"time"
)

// tierPrompt is a completions body of 48 tokens of c (3 full blocks): a prompt
// looks up its first 2 blocks, the last one holding the token vLLM always computes.
func tierPrompt(c string) string {
	return `{"prompt":"` + strings.Repeat(c, 4*16*3) + `","max_tokens":1}`
}

// tierConfig is a GPU pool of 8 blocks (two prompts of 3 blocks and 2 blocks
// spare) with a CPU tier of cpu blocks.
func tierConfig(cpu int) Config {
	cfg := fastConfig()
	cfg.KVBlocks = 8
	cfg.CPUOffloadBlocks = cpu
	return cfg
}

// pushOut sends a, then b, c and d: c and d evict a's 3 blocks from the GPU
// (released last block first, they are the least recently used).
func pushOut(t *testing.T, ts *testServer) {
	t.Helper()
	for _, c := range []string{"a", "b", "c", "d"} {
		answerUsage(t, ts, "/v1/completions", tierPrompt(c), nil)
		ts.waitKV(t, c+" ends", allFree)
	}
}

func TestBlocksEvictedFromTheGPUMoveToTheCPUTierAndAreReloadedNotRecomputed(t *testing.T) {
	tests := []struct {
		name                             string
		cpu                              int
		wantCached, wantGPU, wantReload  int
		wantComputedTotal, wantCPUBlocks int
	}{
		// 4 prompts of 48 computed, then a's 2 looked-up blocks reloaded and its
		// last block computed; the CPU tier holds a's 3 blocks and b's last.
		{"a CPU tier of 16 blocks reloads the prompt's blocks", 16, 32, 0, 32, 4*48 + 16, 4},
		{"without a CPU tier the prompt is recomputed", 0, 0, 0, 0, 5 * 48, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := startServer(t, tierConfig(tt.cpu))
			pushOut(t, ts)
			if s := ts.kv(t); s.CPUCachedBlocks != tt.wantCPUBlocks || s.CPUBlocksTotal != tt.cpu {
				t.Errorf("after a, b, c, d /debug/kv cpu_cached_blocks %d of %d, want %d of %d", s.CPUCachedBlocks, s.CPUBlocksTotal, tt.wantCPUBlocks, tt.cpu)
			}
			before := ts.kv(t)
			u := answerUsage(t, ts, "/v1/completions", tierPrompt("a"), nil)
			if cachedTokens(u) != tt.wantCached {
				t.Errorf("a again: usage %+v, want %d cached tokens (vLLM counts a connector's loaded tokens as cached)", u, tt.wantCached)
			}
			s := ts.waitKV(t, "a ends", allFree)
			gpu := s.PrefixCacheHitsTotal - before.PrefixCacheHitsTotal
			reload := s.ExternalPrefixCacheHitsTotal - before.ExternalPrefixCacheHitsTotal
			if gpu != tt.wantGPU || reload != tt.wantReload || s.PromptTokensComputedTotal != tt.wantComputedTotal {
				t.Errorf("a again: %d tokens hit on GPU, %d reloaded from CPU, %d computed in all; want %d, %d, %d",
					gpu, reload, s.PromptTokensComputedTotal, tt.wantGPU, tt.wantReload, tt.wantComputedTotal)
			}
			metrics := string(ts.get(t, "/metrics"))
			for _, want := range []string{
				`pdproxy_sim_external_prefix_cache_hits_total{model_name="sim"} ` + itoa(tt.wantReload),
				`pdproxy_sim_prompt_tokens_computed_total{model_name="sim"} ` + itoa(tt.wantComputedTotal),
				`vllm:prefix_cache_hits_total{model_name="sim"} 0`,
			} {
				if !strings.Contains(metrics, want) {
					t.Errorf("/metrics lacks %q", want)
				}
			}
			vllmExternal := `vllm:external_prefix_cache_hits_total{model_name="sim"} ` + itoa(tt.wantReload)
			if got := strings.Contains(metrics, vllmExternal); got != (tt.cpu > 0) {
				t.Errorf("/metrics has %q: %v, want it with a CPU tier only", vllmExternal, got)
			}
			// Reloaded, a's blocks are on the GPU again: a third a hits them there.
			before = s
			if u := answerUsage(t, ts, "/v1/completions", tierPrompt("a"), nil); cachedTokens(u) != 32 {
				t.Errorf("a a third time: usage %+v, want 32 cached tokens, from the GPU", u)
			}
			s = ts.waitKV(t, "a ends", allFree)
			if gpu := s.PrefixCacheHitsTotal - before.PrefixCacheHitsTotal; gpu != 32 || s.ExternalPrefixCacheHitsTotal != before.ExternalPrefixCacheHitsTotal {
				t.Errorf("a a third time: %d tokens hit on GPU, %d more reloaded, want 32 and none", gpu, s.ExternalPrefixCacheHitsTotal-before.ExternalPrefixCacheHitsTotal)
			}
		})
	}
}

func TestTheCPUTierDropsItsLeastRecentlyUsedBlockWhenFull(t *testing.T) {
	// A CPU tier of 2 blocks: a's 3 blocks go there as c and d evict them, last
	// block first, and b's last block after them; the tier keeps the 2 latest.
	ts := startServer(t, tierConfig(2))
	pushOut(t, ts)
	if s := ts.kv(t); s.CPUCachedBlocks != 2 {
		t.Fatalf("cpu_cached_blocks %d, want the tier's 2", s.CPUCachedBlocks)
	}
	// The tier holds a's first block and b's last: a finds its first block on
	// CPU, its second nowhere.
	before := ts.kv(t)
	if u := answerUsage(t, ts, "/v1/completions", tierPrompt("a"), nil); cachedTokens(u) != 16 {
		t.Errorf("a again: usage %+v, want 16 cached tokens (its first block, reloaded)", u)
	}
	s := ts.waitKV(t, "a ends", allFree)
	if reload := s.ExternalPrefixCacheHitsTotal - before.ExternalPrefixCacheHitsTotal; reload != 16 || s.CPUCachedBlocks > 2 {
		t.Errorf("a again: %d tokens reloaded, tier holds %d blocks; want 16 and at most 2", reload, s.CPUCachedBlocks)
	}
}

func TestAReloadFromCPUCostsItsBlocksReloadTimeInsteadOfTheirRecompute(t *testing.T) {
	const (
		prefill  = 20 * time.Millisecond
		perToken = time.Millisecond
		reload   = 2 * time.Millisecond
	)
	tests := []struct {
		name string
		cpu  int
		// a comes back after evict (b, c, d) or not; a's first token is due after ttft.
		evict bool
		ttft  time.Duration
	}{
		{"on the GPU: its last block computed", 16, false, prefill + 16*perToken},
		{"on the CPU: 2 blocks reloaded, its last block computed", 16, true, prefill + 2*reload + 16*perToken},
		{"evicted without a CPU tier: recomputed whole", 0, true, prefill + 48*perToken},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := scriptedConfig()
			cfg.KVBlocks = 8
			cfg.PrefillTime, cfg.PrefillPerToken, cfg.CPUReloadPerBlock = prefill, perToken, reload
			cfg.CPUOffloadBlocks = tt.cpu
			s := newScripted(t, cfg, newFakeClock())
			prompts := []string{"a"}
			if tt.evict {
				prompts = append(prompts, "b", "c", "d")
			}
			for _, c := range prompts {
				s.runPrompt(t, c, 0)
			}
			s.runPrompt(t, "a", tt.ttft)
		})
	}
}

// runPrompt runs a 48-token prompt of c, one output token, to its end; with
// ttft > 0 it checks that the token comes exactly ttft after the admission.
func (s *scripted) runPrompt(t *testing.T, c string, ttft time.Duration) {
	t.Helper()
	tokens := make([]uint32, 48)
	for i := range tokens {
		tokens[i] = uint32(c[0])
	}
	r, err := s.newRequest("r-"+c, &apiRequest{promptTokens: len(tokens), tokens: [][]uint32{tokens}, maxTokens: 1, ignoreEOS: true, kind: kindAggregated})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.submit(r); err != nil {
		t.Fatal(err)
	}
	s.stepNow()
	start := s.clock.Now()
	for step := 0; ; step++ {
		if step > 1000 {
			t.Fatalf("%s: no token after %s", c, s.clock.Now().Sub(start))
		}
		if outs := r.take(); len(outs) > 0 {
			if outs[len(outs)-1].finish == "" {
				t.Fatalf("%s: outputs %+v, want its one token", c, outs)
			}
			break
		}
		s.clock.Advance(time.Millisecond)
		s.stepNow()
	}
	if got := s.clock.Now().Sub(start); ttft > 0 && got != ttft {
		t.Errorf("%s: first token %s after admission, want %s", c, got, ttft)
	}
}

func TestKVEventsSayWhichMediumHoldsEachBlockAsVLLMsOffloadingConnector(t *testing.T) {
	for _, format := range []string{KVEventsFormatArray, KVEventsFormatMap} {
		t.Run(format, func(t *testing.T) {
			cfg := tierConfig(2)
			cfg.KVEventsFormat = format
			cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint = "tcp://*:0", "tcp://*:0"
			ts := startServer(t, cfg)
			pushOut(t, ts)
			answerUsage(t, ts, "/v1/completions", tierPrompt("a"), nil) // reloads a's first block
			s := ts.waitKV(t, "a ends", allFree)
			waitPublished(t, ts)

			// The replay has every batch: a consumer keeps one set of blocks per medium.
			held := map[string]map[uint64]bool{"GPU": {}, "CPU": {}}
			stored := map[string]int{}
			for _, b := range replayFrom(t, strings.Replace(ts.e.KVEventsReplayAddr(), "0.0.0.0", "127.0.0.1", 1), 0) {
				for _, e := range b.Events {
					medium, _ := e.Medium.(string)
					if held[medium] == nil {
						t.Fatalf("batch %d: %s with medium %v, want GPU or CPU", b.Seq, e.Type, e.Medium)
					}
					switch e.Type {
					case "BlockStored":
						if len(e.Tokens) != 16*len(e.Hashes) || e.BlockSize != 16 {
							t.Errorf("batch %d: %s BlockStored of %d blocks with %d tokens, block size %d: want the blocks' own tokens",
								b.Seq, medium, len(e.Hashes), len(e.Tokens), e.BlockSize)
						}
						if e.Parent != nil && !held["GPU"][*e.Parent] && !held["CPU"][*e.Parent] {
							t.Errorf("batch %d: %s BlockStored whose parent no medium holds", b.Seq, medium)
						}
						for _, h := range e.Hashes {
							if held[medium][h] {
								t.Errorf("batch %d: block %x stored on %s twice", b.Seq, h, medium)
							}
							held[medium][h] = true
							stored[medium]++
						}
					case "BlockRemoved":
						for _, h := range e.Hashes {
							if !held[medium][h] {
								t.Errorf("batch %d: block %x removed from %s, which does not hold it", b.Seq, h, medium)
							}
							delete(held[medium], h)
							if medium == "GPU" && !held["CPU"][h] {
								t.Errorf("batch %d: block %x left the GPU before its copy was stored on CPU", b.Seq, h)
							}
						}
					default:
						t.Errorf("batch %d: unexpected %s", b.Seq, e.Type)
					}
				}
			}
			// Evicted: a's 3 blocks, b's last (by d), then 3 more by a again.
			if stored["CPU"] != 7 {
				t.Errorf("%d blocks stored on CPU, want the 7 the GPU evicted", stored["CPU"])
			}
			if len(held["CPU"]) != s.CPUCachedBlocks || s.CPUCachedBlocks != 2 || len(held["GPU"]) != s.CachedBlocks {
				t.Errorf("the consumer holds %d blocks on CPU and %d on GPU; /debug/kv says %d and %d (CPU tier of 2)",
					len(held["CPU"]), len(held["GPU"]), s.CPUCachedBlocks, s.CachedBlocks)
			}
		})
	}
}

func TestCPUTierSettingsThatCannotWorkAreRejected(t *testing.T) {
	tests := []struct {
		name    string
		cfg     func(*Config)
		wantErr string
	}{
		{"a negative size", func(c *Config) { c.CPUOffloadBlocks = -1 }, "cpu offload blocks -1"},
		{"a negative reload time", func(c *Config) { c.CPUOffloadBlocks, c.CPUReloadPerBlock = 8, -time.Millisecond }, "must not be negative"},
		{"a CPU tier without the prefix cache it holds blocks of", func(c *Config) { c.CPUOffloadBlocks, c.DisablePrefixCache = 8, true }, "prefix cache is off"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := fastConfig()
			tt.cfg(&cfg)
			if _, err := New(cfg, nil); err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("New: %v, want an error saying %q", err, tt.wantErr)
			}
		})
	}
}
