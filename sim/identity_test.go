package sim

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// keyedCompletion is a completions body of prompt for model, with a cache_salt unless salt is "".
func keyedCompletion(model, prompt, salt string) string {
	b := `{"model":"` + model + `","prompt":"` + prompt + `","max_tokens":1`
	if salt != "" {
		b += `,"cache_salt":"` + salt + `"`
	}
	return b + "}"
}

func TestAPromptIsReusedOnlyUnderTheLoRAAndSaltItWasComputedWith(t *testing.T) {
	prompt := strings.Repeat("abcd", 200) // 200 tokens: the first 12 blocks are looked up
	type req struct{ model, salt string }
	base, adapter, other := req{"sim", ""}, req{"ad", ""}, req{"ad2", ""}
	tenantA, tenantB := req{"sim", "tenant-a"}, req{"sim", "tenant-b"}
	tests := []struct {
		name          string
		first, second req
		wantCached    int
	}{
		{"the base model again", base, base, 192},
		{"an adapter after the base model", base, adapter, 0},
		{"the base model after an adapter", adapter, base, 0},
		{"an adapter after itself", adapter, adapter, 192},
		{"an adapter after another", adapter, other, 0},
		{"a tenant after another with another salt", tenantA, tenantB, 0},
		{"an unsalted request after a salted one", tenantA, base, 0},
		{"a salted request after an unsalted one", base, tenantA, 0},
		{"a tenant after itself", tenantA, tenantA, 192},
		{"an adapter's tenant after the adapter", adapter, req{"ad", "tenant-a"}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := fastConfig()
			cfg.LoRAModules = "ad=/adapters/ad,ad2=/adapters/ad2"
			ts := startServer(t, cfg)
			answerUsage(t, ts, "/v1/completions", keyedCompletion(tt.first.model, prompt, tt.first.salt), nil)
			ts.waitKV(t, "the first request ends", allFree)
			u := answerUsage(t, ts, "/v1/completions", keyedCompletion(tt.second.model, prompt, tt.second.salt), nil)
			if got := cachedTokens(u); got != tt.wantCached {
				t.Errorf("second request cached %d tokens, want %d", got, tt.wantCached)
			}
		})
	}
}

func TestAnEmptyCacheSaltIsRefusedAsVLLMRefusesIt(t *testing.T) {
	ts := startServer(t, fastConfig())
	resp := ts.post(t, t.Context(), "/v1/completions", `{"prompt":"hi","cache_salt":""}`, nil)
	if b := readAll(t, resp); resp.StatusCode != 400 || !strings.Contains(string(b), "cache_salt") {
		t.Errorf("status %d: %s; want a 400 naming cache_salt", resp.StatusCode, b)
	}
}

// storedEvents are the BlockStored events the engine published so far, from its replay.
func storedEvents(t *testing.T, ts *testServer) []wireEvent {
	t.Helper()
	waitPublished(t, ts)
	ep := strings.Replace(ts.e.KVEventsReplayAddr(), "0.0.0.0", "127.0.0.1", 1)
	var out []wireEvent
	for _, b := range replayFrom(t, ep, 0) {
		for _, e := range b.Events {
			if e.Type == "BlockStored" {
				out = append(out, e)
			}
		}
	}
	return out
}

func TestKVEventsCarryWhatTheBlocksAreKeyedBy(t *testing.T) {
	prompt := strings.Repeat("abcd", 48) // 48 tokens: three blocks of 16
	for _, format := range []string{KVEventsFormatArray, KVEventsFormatMap} {
		t.Run(format, func(t *testing.T) {
			cfg := fastConfig()
			cfg.LoRAModules = "ad=/adapters/ad,ad2=/adapters/ad2"
			cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint, cfg.KVEventsFormat = "tcp://*:0", "tcp://*:0", format
			ts := startServer(t, cfg)
			answerUsage(t, ts, "/v1/completions", keyedCompletion("ad2", prompt, "s"), nil)
			answerUsage(t, ts, "/v1/completions", keyedCompletion("sim", prompt+"efgh", ""), nil)
			ts.waitKV(t, "the requests end", allFree)
			evs := storedEvents(t, ts)
			if len(evs) != 2 {
				t.Fatalf("%d BlockStored events, want 2: %+v", len(evs), evs)
			}
			lora, plain := evs[0], evs[1]
			wantExtra := []any{[]any{"ad2", "s"}, []any{"ad2"}, []any{"ad2"}}
			if lora.LoRAName != "ad2" || lora.LoRAID != int64(2) || fmt.Sprint(lora.Extra) != fmt.Sprint(wantExtra) ||
				lora.Group != 0 || lora.Kind != "full_attention" || lora.Window != nil {
				t.Errorf("the adapter's salted blocks: lora_name %v, lora_id %v, extra_keys %v, group %d, kind %v, window %v; "+
					"want ad2, 2, %v, 0, full_attention, none", lora.LoRAName, lora.LoRAID, lora.Extra, lora.Group, lora.Kind, lora.Window, wantExtra)
			}
			if plain.LoRAName != nil || plain.LoRAID != nil || !plain.HasExtra || slices.ContainsFunc(plain.Extra, func(x any) bool { return x != nil }) {
				t.Errorf("the base model's blocks: lora_name %v, lora_id %v, extra_keys %v (given %v); want none, none, one nil per block",
					plain.LoRAName, plain.LoRAID, plain.Extra, plain.HasExtra)
			}
			if slices.ContainsFunc(lora.Hashes, func(h uint64) bool { return slices.Contains(plain.Hashes, h) }) {
				t.Errorf("the same tokens under another key share a block hash: %v and %v", lora.Hashes, plain.Hashes)
			}
		})
	}
}

func TestAHybridModelReusesAPrefixOnlyAsFarAsItsWindowReaches(t *testing.T) {
	// Blocks of 16, a window of 64 tokens: a prefix is reused up to an end the window
	// group holds cdiv(63, 16) = 4 blocks before.
	prompt := strings.Repeat("abcd", 200) // 200 tokens, 12 full blocks
	shares8 := prompt[:8*16*4] + strings.Repeat("wxyz", 72)
	tests := []struct {
		name       string
		window     int
		second     string
		wantCached int
	}{
		{"the same prompt: the window holds its last blocks", 64, prompt, 192},
		{"a continuation of it", 64, prompt + strings.Repeat("efgh", 40), 192},
		{"a prompt sharing its first 8 blocks: the window holds none before their end", 64, shares8, 0},
		{"without a window the shared blocks are reused", 0, shares8, 128},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := fastConfig()
			cfg.SlidingWindow = tt.window
			cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint = "tcp://*:0", "tcp://*:0"
			ts := startServer(t, cfg)
			answerUsage(t, ts, "/v1/completions", keyedCompletion("sim", prompt, ""), nil)
			ts.waitKV(t, "the first request ends", allFree)
			u := answerUsage(t, ts, "/v1/completions", keyedCompletion("sim", tt.second, ""), nil)
			if got := cachedTokens(u); got != tt.wantCached {
				t.Errorf("second request cached %d tokens, want %d", got, tt.wantCached)
			}
			if tt.window == 0 {
				return
			}
			evs := storedEvents(t, ts)
			if len(evs) < 2 {
				t.Fatalf("%d BlockStored events, want the first prompt's of both groups", len(evs))
			}
			full, window := evs[0], evs[1]
			if full.Group != 0 || full.Kind != "full_attention" || len(full.Hashes) != 12 {
				t.Errorf("the full-attention group stored %d blocks of group %d, kind %v; want 12 of group 0, full_attention", len(full.Hashes), full.Group, full.Kind)
			}
			if window.Group != 1 || window.Kind != "sliding_window" || window.Window != int64(64) || len(window.Hashes) != 4 ||
				len(window.Tokens) != 192 || !slices.Equal(window.Hashes, full.Hashes[8:]) || window.Parent != nil {
				t.Errorf("the window group stored %d blocks (%d token ids, parent %v) of group %d, kind %v, window %v; "+
					"want the last 4 of 12 with every token id, as vLLM leaves the null blocks out, of group 1, sliding_window, 64",
					len(window.Hashes), len(window.Tokens), window.Parent, window.Group, window.Kind, window.Window)
			}
		})
	}
}
