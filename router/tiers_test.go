package router

import (
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// blockStoredOn and blockRemovedOn are blockStored and blockRemoved on medium, as vLLM's
// offloading connector publishes the blocks it keeps on CPU.
func blockStoredOn(medium string, hashes []uint64, parent any, tokens []uint32) []any {
	return []any{"BlockStored", hashes, parent, tokens, kvBlock, nil, medium, nil}
}

func blockRemovedOn(medium string, hashes ...uint64) []any {
	return []any{"BlockRemoved", hashes, medium}
}

// tieredRouter is a precise router over listenCfg's three decoders with tier weights, each
// engine's publisher connected.
func tieredRouter(t *testing.T, weights map[string]float64) (*preciseRouter, map[string]*kvPublisher) {
	cfg := listenCfg()
	cfg.KVEvents.TierWeights = weights
	r := startPrecise(t, cfg)
	listen := r.listenAddr(t)
	pubs := map[string]*kvPublisher{}
	for i, name := range []string{"d0", "d1", "d2"} {
		pubs[name] = newKVPublisher(t, listen, fmt.Sprintf("kv@10.0.0.%d:8000@model", i+1))
		r.connect(t, pubs[name], name)
	}
	return r, pubs
}

func (r *preciseRouter) blocksByMedium(t *testing.T, backend string) map[string]int {
	t.Helper()
	body, err := json.Marshal(r.Backends())
	if err != nil {
		t.Fatal(err)
	}
	var out []struct {
		Name        string `json:"name"`
		PrefixCache struct {
			BlocksByMedium map[string]int `json:"blocks_by_medium"`
		} `json:"prefix_cache"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatal(err)
	}
	for _, b := range out {
		if b.Name == backend {
			return b.PrefixCache.BlocksByMedium
		}
	}
	return nil
}

func TestPreciseCacheAwareWeighsTiers(t *testing.T) {
	prompt := promptTokens(0, 64*kvBlock)
	r, pubs := tieredRouter(t, nil)
	// d0, first in the pool and so the winner of a tie, holds the prompt on CPU; d2 on GPU.
	pubs["d0"].publish(blockStoredOn("CPU", hashesOf(1, 64), nil, prompt))
	pubs["d2"].publish(blockStored(hashesOf(3, 64), nil, prompt))
	r.waitBlocks(t, "d0", 64)
	r.waitBlocks(t, "d2", 64)

	if got := r.pick(t, Hint{Tokens: prompt}, nil); got != "d2" {
		t.Errorf("at equal load picked %s, want d2, which holds the prompt on GPU rather than CPU", got)
	}
	if got := r.pick(t, Hint{Tokens: prompt, Exclude: []string{"d2"}}, nil); got != "d0" {
		t.Errorf("without d2 picked %s, want d0, which holds the prompt on CPU rather than nothing", got)
	}
	for tier, want := range map[string]float64{"gpu": 1024, "cpu": 1024, "disk": 0} {
		if n := testutil.Value(t, r.reg, "pdproxy_prefix_cache_matched_tokens_total", map[string]string{"tier": tier}); n != want {
			t.Errorf("pdproxy_prefix_cache_matched_tokens_total{tier=%q} = %v, want %v", tier, n, want)
		}
	}
	if got, want := r.blocksByMedium(t, "d0"), map[string]int{"cpu": 64}; !maps.Equal(got, want) {
		t.Errorf("/debug/backends shows d0's blocks_by_medium %v, want %v", got, want)
	}
}

func TestCachedTokensWeighsTiers(t *testing.T) {
	prompt := promptTokens(0, 4*kvBlock+3)
	h := hashesOf(1, 4)
	t.Run("a block removed from the GPU but stored on CPU counts at CPU's weight", func(t *testing.T) {
		r, pubs := tieredRouter(t, nil)
		d0 := pubs["d0"]
		d0.publish(blockStored(h, nil, prompt[:4*kvBlock]))
		d0.publish(blockStoredOn("CPU", h, nil, prompt[:4*kvBlock]))
		r.waitBlocks(t, "d0", 8)
		if n, ok := r.CachedTokens("d0", Hint{Tokens: prompt}); !ok || n != 4*kvBlock {
			t.Errorf("on GPU and CPU CachedTokens = %d, %v; want %d, true", n, ok, 4*kvBlock)
		}
		d0.publish(blockRemovedOn("GPU", h...))
		r.waitBlocks(t, "d0", 4)
		if n, ok := r.CachedTokens("d0", Hint{Tokens: prompt}); !ok || n != 48 {
			t.Errorf("on CPU alone CachedTokens = %d, %v; want 48 (64 tokens at 0.75), true", n, ok)
		}
		if got, want := r.blocksByMedium(t, "d0"), map[string]int{"cpu": 4}; !maps.Equal(got, want) {
			t.Errorf("blocks_by_medium = %v, want %v", got, want)
		}
		d0.publish(blockRemovedOn("cpu", h...))
		r.waitBlocks(t, "d0", 0)
		if n, ok := r.CachedTokens("d0", Hint{Tokens: prompt}); !ok || n != 0 {
			t.Errorf("after the CPU copies went CachedTokens = %d, %v; want 0, true", n, ok)
		}
	})
	t.Run("a parent on GPU chains blocks offloaded to CPU and disk", func(t *testing.T) {
		r, pubs := tieredRouter(t, nil)
		d0 := pubs["d0"]
		d0.publish(blockStored(h[:2], nil, prompt[:2*kvBlock]))
		d0.publish(blockStoredOn("CPU", h[2:3], h[1], prompt[2*kvBlock:3*kvBlock]))
		d0.publish(blockStoredOn("LocalDisk", h[3:], h[2], prompt[3*kvBlock:4*kvBlock]))
		r.waitBlocks(t, "d0", 4)
		if n, _ := r.CachedTokens("d0", Hint{Tokens: prompt}); n != 32+12+4 {
			t.Errorf("CachedTokens = %d, want 48: 32 on GPU, 16 on CPU at 0.75, 16 on disk at 0.25", n)
		}
	})
	t.Run("tier_weights cpu 0 makes CPU blocks count nothing", func(t *testing.T) {
		r, pubs := tieredRouter(t, map[string]float64{"cpu": 0})
		pubs["d0"].publish(blockStoredOn("CPU", h, nil, prompt[:4*kvBlock]))
		r.waitBlocks(t, "d0", 4)
		if n, ok := r.CachedTokens("d0", Hint{Tokens: prompt}); !ok || n != 0 {
			t.Errorf("CachedTokens = %d, %v; want 0, true", n, ok)
		}
	})
}

func TestReloadTierWeights(t *testing.T) {
	prompt := promptTokens(0, 4*kvBlock)
	cfg := listenCfg()
	cfg.KVEvents.TierWeights = map[string]float64{"cpu_tier2": 0.5}
	r := startPrecise(t, cfg)
	d0 := newKVPublisher(t, r.listenAddr(t), "kv@10.0.0.1:8000@model")
	r.connect(t, d0, "d0")
	d0.publish(blockStoredOn("CPU", hashesOf(1, 4), nil, prompt))
	r.waitBlocks(t, "d0", 4)

	changed := listenCfg()
	changed.DecodePolicy = routerconfig.PolicyPreciseCacheAware
	changed.Health.Interval = -1
	changed.KVEvents.TierWeights = map[string]float64{"CPU": 0.5, "cpu_tier2": 0.1}
	if err := r.Reload(changed); err != nil {
		t.Fatalf("Reload changing the weights = %v, want it applied", err)
	}
	if n, _ := r.CachedTokens("d0", Hint{Tokens: prompt}); n != 32 {
		t.Errorf("after the reload CachedTokens = %d, want 32 (64 on CPU at 0.5)", n)
	}
	changed.KVEvents.TierWeights = map[string]float64{"cpu": 0.5, "cpu_tier3": 0.1}
	if err := r.Reload(changed); err == nil || !strings.Contains(err.Error(), "read at start") {
		t.Errorf("Reload naming another tier of its own = %v, want it refused", err)
	}
}

func TestValidateTierWeights(t *testing.T) {
	withEvents := []routerconfig.BackendConfig{{URL: "http://d:1", Role: routerconfig.RoleDecode, KVEventsEndpoint: "tcp://d:5557"}}
	tests := []struct {
		name    string
		backend []routerconfig.BackendConfig
		weights map[string]float64
		want    string
	}{
		{"a weight above 1", withEvents, map[string]float64{"cpu": 1.2}, "kv_events.tier_weights: tier cpu: weight 1.2 is not in [0, 1]"},
		{"a negative weight", withEvents, map[string]float64{"disk": -1}, "is not in [0, 1]"},
		{"gpu other than 1", withEvents, map[string]float64{"gpu": 0.8}, "kv_events.tier_weights: tier gpu: weight 0.8 is not 1"},
		{"a disk medium's name", withEvents, map[string]float64{"SSD": 0.5}, "a medium of tier disk, whose weight it takes: set disk"},
		{"one tier in two cases", withEvents, map[string]float64{"cpu": 0.5, "Cpu": 0.5}, "the same tier"},
		{"more tiers of their own than the index keeps", withEvents, map[string]float64{"a": 1, "b": 1, "c": 1, "d": 1, "e": 1, "f": 1}, "at most 5"},
		{"weights without KV events", []routerconfig.BackendConfig{{URL: "http://d:1", Role: routerconfig.RoleDecode}}, map[string]float64{"cpu": 0.5}, "kv_events.tier_weights: set, but no KV events are read"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := routerconfig.Config{Backends: tt.backend, KVEvents: routerconfig.KVEventsConfig{TierWeights: tt.weights}}
			if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate() = %v, want it to contain %q", err, tt.want)
			}
		})
	}
	ok := routerconfig.Config{Backends: withEvents, KVEvents: routerconfig.KVEventsConfig{TierWeights: map[string]float64{"GPU": 1, "cpu": 0.5, "disk": 0, "cpu_tier2": 0.3}}}
	if err := ok.Validate(); err != nil {
		t.Errorf("Validate() of good weights = %v", err)
	}
}
