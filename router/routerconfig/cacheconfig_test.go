package routerconfig

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

func TestCacheAwareYAMLConfig(t *testing.T) {
	const doc = `
backends:
  - url: http://10.0.0.1:8000
    role: prefill
    kv_events_endpoint: tcp://10.0.0.1:5557
    kv_events_replay_endpoint: tcp://10.0.0.1:5558
  - url: http://10.0.0.2:8000
    role: decode
prefill_policy: precise_cache_aware
decode_policy: cache_aware
cache_aware:
  prefill_tokens_per_second: 20000
  prefill_overhead: 5ms
  decode_cost_tokens: 8
  temperature: 2ms
  tree_ttl: 1m
  balance_abs_threshold: 32
  balance_rel_threshold: 2
  max_tree_bytes: 1048576
kv_events:
  listen: tcp://*:5557
  stale_after: 30s
  replay_timeout: 2s
  max_blocks_per_backend: 1000
  tier_weights: {cpu: 0.5, disk: 0.1}
tokenizer: engine
tokenize_timeout: 500ms
block_size: 32
`
	var c Config
	if err := yaml.Unmarshal([]byte(doc), &c); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	if want := (CacheAwareConfig{PrefillTokensPerSecond: 20000, PrefillOverhead: 5 * time.Millisecond, DecodeCostTokens: 8, Temperature: 2 * time.Millisecond,
		TreeTTL: time.Minute, BalanceAbsThreshold: 32, BalanceRelThreshold: 2, MaxTreeBytes: 1 << 20}); c.CacheAware != want {
		t.Errorf("cache_aware = %+v, want %+v", c.CacheAware, want)
	}
	if want := (KVEventsConfig{Listen: "tcp://*:5557", StaleAfter: 30 * time.Second, ReplayTimeout: 2 * time.Second, MaxBlocksPerBackend: 1000,
		TierWeights: map[string]float64{"cpu": 0.5, "disk": 0.1}}); !reflect.DeepEqual(c.KVEvents, want) {
		t.Errorf("kv_events = %+v, want %+v", c.KVEvents, want)
	}
	if c.Tokenizer != TokenizerEngine || c.TokenizeTimeout != 500*time.Millisecond || c.BlockSize != 32 {
		t.Errorf("tokenizer %q, tokenize_timeout %v, block_size %d", c.Tokenizer, c.TokenizeTimeout, c.BlockSize)
	}
	if b := c.Backends[0]; b.KVEventsEndpoint != "tcp://10.0.0.1:5557" || b.KVEventsReplayEndpoint != "tcp://10.0.0.1:5558" {
		t.Errorf("backend kv events = %q, %q", b.KVEventsEndpoint, b.KVEventsReplayEndpoint)
	}
}

func TestCacheAwareDefaults(t *testing.T) {
	c := Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode, KVEventsEndpoint: "tcp://d:5557"}}, DecodePolicy: PolicyPreciseCacheAware}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if want := (CacheAwareConfig{PrefillTokensPerSecond: 10000, PrefillOverhead: 10 * time.Millisecond, DecodeCostTokens: 16, TreeTTL: 2 * time.Minute,
		BalanceAbsThreshold: 64, BalanceRelThreshold: 1.5, MaxTreeBytes: 64 << 20}); c.CacheAware != want {
		t.Errorf("cache_aware = %+v, want %+v", c.CacheAware, want)
	}
	if c.Tokenizer != TokenizerEngine || c.BlockSize != 16 || c.KVEvents.StaleAfter != time.Minute || c.TokenizeTimeout != time.Second {
		t.Errorf("tokenizer %q, block_size %d, stale_after %v, tokenize_timeout %v", c.Tokenizer, c.BlockSize, c.KVEvents.StaleAfter, c.TokenizeTimeout)
	}
}

func TestCacheAwareValidateNamesTheBadField(t *testing.T) {
	decoder := BackendConfig{URL: "http://d:1", Role: RoleDecode}
	withEvents := BackendConfig{URL: "http://d:1", Role: RoleDecode, KVEventsEndpoint: "tcp://d:5557"}
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"precise_cache_aware with no source of events", Config{Backends: []BackendConfig{decoder}, DecodePolicy: PolicyPreciseCacheAware}, "kv_events: precise_cache_aware reads"},
		{"a tokenizer that is not the engine", Config{Backends: []BackendConfig{withEvents}, DecodePolicy: PolicyPreciseCacheAware, Tokenizer: "hf"}, "tokenizer: \"hf\" is not"},
		{"a cache_threshold, which no pick by cost reads", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{CacheThreshold: 0.3}}, "cache_aware.cache_threshold: set to 0.3, but no share of the prompt gates a pick"},
		{"a negative prefill rate", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{PrefillTokensPerSecond: -1}}, "cache_aware.prefill_tokens_per_second:"},
		{"a negative prefill overhead", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{PrefillOverhead: -time.Millisecond}}, "cache_aware.prefill_overhead:"},
		{"a negative decode cost", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{DecodeCostTokens: -1}}, "cache_aware.decode_cost_tokens:"},
		{"a negative temperature", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{Temperature: -time.Millisecond}}, "cache_aware.temperature:"},
		{"a negative tree_ttl", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{TreeTTL: -time.Second}}, "cache_aware.tree_ttl:"},
		{"a balance_rel_threshold below 1", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{BalanceRelThreshold: 0.5}}, "cache_aware.balance_rel_threshold:"},
		{"a negative max_tree_bytes", Config{Backends: []BackendConfig{decoder}, CacheAware: CacheAwareConfig{MaxTreeBytes: -1}}, "cache_aware.max_tree_bytes:"},
		{"a listen endpoint that is not tcp", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{Listen: "ipc:///tmp/kv"}}, "kv_events.listen:"},
		{"a listen endpoint without a port", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{Listen: "tcp://*"}}, "kv_events.listen:"},
		{"an allowed source that is no address", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{Listen: "tcp://127.0.0.1:0", AllowedSources: []string{"10.0.0.0/8", "engine-0"}}}, "kv_events.allowed_sources[1]: \"engine-0\" is neither an IP address nor a CIDR prefix"},
		{"an allowed source with bits past its prefix", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{Listen: "tcp://127.0.0.1:0", AllowedSources: []string{"10.0.0.7/8"}}}, "kv_events.allowed_sources[0]: \"10.0.0.7/8\" has bits set past its /8"},
		{"allowed sources without a listening socket", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{AllowedSources: []string{"10.0.0.7"}}}, "kv_events.allowed_sources: set, but kv_events.listen is not"},
		{"a negative stale_after", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{StaleAfter: -time.Second}}, "kv_events.stale_after:"},
		{"a dialed endpoint with a wildcard host", Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode, KVEventsEndpoint: "tcp://*:5557"}}}, "backends[0].kv_events_endpoint:"},
		{"a replay endpoint with no events to replay", Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode, KVEventsReplayEndpoint: "tcp://d:5558"}}}, "backends[0].kv_events_replay_endpoint: set, but"},
		{"an events endpoint on a discover entry", Config{Backends: []BackendConfig{{Name: "pool", URL: "http://svc:1", Role: RoleDecode, Discover: DiscoverDNS, KVEventsEndpoint: "tcp://svc:5557"}}}, "backends[0].kv_events_endpoint: set on a discover entry"},
		{"a negative max_blocks", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{MaxBlocks: -1}}, "kv_events.max_blocks: -1 is negative"},
		{"a max_blocks below the default per backend", Config{Backends: []BackendConfig{decoder}, KVEvents: KVEventsConfig{MaxBlocks: 1000}}, "kv_events.max_blocks: 1000 is below kv_events.max_blocks_per_backend (1048576)"},
		{"a negative block_size", Config{Backends: []BackendConfig{decoder}, BlockSize: -16}, "block_size:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate() = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}
