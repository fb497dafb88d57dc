package app

import (
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestParseConfigReadsTheCacheAwareKeys(t *testing.T) {
	const doc = `
prefill_policy: precise_cache_aware
decode_policy: cache_aware
cache_aware:
  prefill_tokens_per_second: 5000
  tree_ttl: 30s
  balance_abs_threshold: 16
  balance_rel_threshold: 1.25
  max_tree_bytes: 8388608
kv_events:
  listen: "tcp://*:5557"
  stale_after: 20s
tokenizer: engine
block_size: 32
backends:
  - url: http://10.0.0.11:8100
    role: prefill
    kv_events_endpoint: tcp://10.0.0.11:5557
    kv_events_replay_endpoint: tcp://10.0.0.11:5558
  - url: http://10.0.0.12:8200
    role: decode
`
	c, err := ParseConfig([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	rc := c.Router
	rc.Engines = EngineCatalog{}
	if err := rc.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	if rc.PrefillPolicy != routerconfig.PolicyPreciseCacheAware || rc.DecodePolicy != routerconfig.PolicyCacheAware {
		t.Errorf("policies %q, %q", rc.PrefillPolicy, rc.DecodePolicy)
	}
	if want := (routerconfig.CacheAwareConfig{PrefillTokensPerSecond: 5000, PrefillOverhead: routerconfig.DefaultPrefillOverhead, DecodeCostTokens: routerconfig.DefaultDecodeCostTokens,
		TreeTTL: 30 * time.Second, BalanceAbsThreshold: 16, BalanceRelThreshold: 1.25, MaxTreeBytes: 8 << 20}); rc.CacheAware != want {
		t.Errorf("cache_aware = %+v, want %+v", rc.CacheAware, want)
	}
	if rc.KVEvents.Listen != "tcp://*:5557" || rc.KVEvents.StaleAfter != 20*time.Second || rc.Tokenizer != "engine" || rc.BlockSize != 32 {
		t.Errorf("kv_events = %+v, tokenizer %q, block_size %d", rc.KVEvents, rc.Tokenizer, rc.BlockSize)
	}
	if b := rc.Backends[0]; b.KVEventsEndpoint != "tcp://10.0.0.11:5557" || b.KVEventsReplayEndpoint != "tcp://10.0.0.11:5558" {
		t.Errorf("backends[0] kv events = %q, %q", b.KVEventsEndpoint, b.KVEventsReplayEndpoint)
	}
}

func TestParseConfigRejectsUnknownCacheAwareKeys(t *testing.T) {
	tests := []struct{ name, doc, want string }{
		{"a misspelt cache_aware key", "cache_aware:\n  cache_treshold: 0.5\n", "cache_treshold"},
		{"a misspelt kv_events key", "kv_events:\n  listne: tcp://*:5557\n", "listne"},
		{"a misspelt backend key", "backends:\n  - url: http://d:1\n    role: decode\n    kv_event_endpoint: tcp://d:5557\n", "kv_event_endpoint"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tt.doc))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("ParseConfig = %v, want an error naming %q", err, tt.want)
			}
		})
	}
}

func TestParseConfigReadsTheLimitsAndPriorityKeys(t *testing.T) {
	const doc = `
limits:
  per_key: {max_concurrent: 4, requests_per_second: 2.5, burst: 10}
  tenant_header: X-Tenant
  max_identities: 500
priority:
  header: X-Priority
  classes:
    - {name: interactive, priority: 0, max_queue_wait: 0s}
    - {name: batch, priority: 10, max_queue_wait: 5s, set_priority: true}
  default_class: interactive
`
	c, err := ParseConfig([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Proxy.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	l := c.Proxy.Limits
	if l.PerKey.MaxConcurrent != 4 || l.PerKey.RequestsPerSecond != 2.5 || l.PerKey.Burst != 10 || l.TenantHeader != "X-Tenant" || l.MaxIdentities != 500 {
		t.Errorf("limits = %+v", l)
	}
	p := c.Proxy.Priority
	if p.Header != "X-Priority" || p.DefaultClass != "interactive" || len(p.Classes) != 2 {
		t.Fatalf("priority = %+v", p)
	}
	if b := p.Classes[1]; b.Name != "batch" || b.Priority != 10 || b.MaxQueueWait != 5*time.Second || !b.SetPriority {
		t.Errorf("priority.classes[1] = %+v", b)
	}
	if _, err := ParseConfig([]byte("limits:\n  per_key:\n    max_concurent: 4\n")); err == nil || !strings.Contains(err.Error(), "max_concurent") {
		t.Errorf("a misspelt limits key: %v", err)
	}
}
