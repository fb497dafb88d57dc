package routerconfig

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"net/url"
	"slices"
	"strings"

	"github.com/pdproxy/pdproxy/kvcache"
)

// setDefaults fills zero fields. It leaves invalid values alone for Validate to name.
func (c *Config) setDefaults() {
	for i := range c.Backends {
		b := &c.Backends[i]
		if e, ok := EngineOf(c.Engines, b.Engine); ok {
			b.Engine = e.Kind()
			orDefault(&b.KVHoldTimeout, e.KVHoldTimeout())
		}
		orDefault(&b.Weight, DefaultWeight)
		orDefault(&b.MaxInflight, DefaultMaxInflight)
	}
	c.deriveNames()
	orDefault(&c.EngineClient, DefaultEngineClient)
	orDefault(&c.PrefillPolicy, DefaultPolicy)
	orDefault(&c.DecodePolicy, DefaultPolicy)
	orDefault(&c.PrefixTokens, DefaultPrefixTokens)
	orDefault(&c.BoundedLoadFactor, DefaultBoundedLoadFactor)
	h := &c.Health
	orDefault(&h.Interval, DefaultHealthInterval)
	orDefault(&h.Timeout, DefaultHealthTimeout)
	orDefault(&h.UnhealthyThreshold, DefaultUnhealthyThreshold)
	orDefault(&h.HealthyThreshold, DefaultHealthyThreshold)
	orDefault(&h.Path, DefaultHealthPath)
	e := &c.Ejection
	orDefault(&e.ConsecutiveFailures, DefaultConsecutiveFailures)
	if e.BaseBackoff == 0 {
		e.BaseBackoff = DefaultBaseBackoff
		if h.Interval > 0 {
			e.BaseBackoff = h.Interval
		}
	}
	orDefault(&e.MaxBackoff, max(DefaultMaxBackoff, e.BaseBackoff))
	orDefault(&c.Queue.Size, DefaultQueueSize)
	orDefault(&c.Queue.Timeout, DefaultQueueTimeout)
	c.setDiscoveryDefaults()
	c.setCacheDefaults()
	if _, wants := c.policyWith(wantsTokens); c.Tokenizer == "" && wants {
		c.Tokenizer = TokenizerEngine
	}
}

// WithDefaults is c with its zero fields' defaults.
func (c CacheAwareConfig) WithDefaults() CacheAwareConfig {
	orDefault(&c.PrefillTokensPerSecond, DefaultPrefillTokensPerSecond)
	orDefault(&c.PrefillOverhead, DefaultPrefillOverhead)
	orDefault(&c.DecodeCostTokens, DefaultDecodeCostTokens)
	orDefault(&c.TreeTTL, DefaultTreeTTL)
	orDefault(&c.BalanceAbsThreshold, DefaultBalanceAbsThreshold)
	orDefault(&c.BalanceRelThreshold, DefaultBalanceRelThreshold)
	orDefault(&c.MaxTreeBytes, kvcache.DefaultMaxTreeBytes)
	return c
}

func (c *Config) setCacheDefaults() {
	c.CacheAware = c.CacheAware.WithDefaults()
	kv := &c.KVEvents
	orDefault(&kv.StaleAfter, DefaultKVEventsStaleAfter)
	orDefault(&kv.ReplayTimeout, kvcache.DefaultReplayTimeout)
	orDefault(&kv.MaxBlocksPerBackend, kvcache.DefaultMaxBlocks)
	orDefault(&c.TokenizeTimeout, DefaultTokenizeTimeout)
	orDefault(&c.TokenizeMaxTokens, DefaultTokenizeMaxTokens)
	orDefault(&c.BlockSize, DefaultBlockSize)
}

// orDefault sets *v to d when it is the zero value: a key left out takes its default.
func orDefault[T comparable](v *T, d T) {
	var zero T
	if *v == zero {
		*v = d
	}
}

// checkCache names what is wrong with the cache-aware settings, as Validate does.
func (c *Config) checkCache() []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	ca := c.CacheAware
	if ca.CacheThreshold != 0 {
		bad("cache_aware.cache_threshold", "set to %v, but no share of the prompt gates a pick: a request goes where its prefill costs least, cached tokens saving what they save (prefill_tokens_per_second, prefill_overhead, decode_cost_tokens); remove it", ca.CacheThreshold)
	}
	if ca.PrefillTokensPerSecond < 0 || math.IsInf(ca.PrefillTokensPerSecond, 0) || math.IsNaN(ca.PrefillTokensPerSecond) {
		bad("cache_aware.prefill_tokens_per_second", "%v is not a positive rate", ca.PrefillTokensPerSecond)
	}
	if ca.PrefillOverhead < 0 {
		bad("cache_aware.prefill_overhead", "%v is negative", ca.PrefillOverhead)
	}
	if ca.DecodeCostTokens < 0 {
		bad("cache_aware.decode_cost_tokens", "%d is negative", ca.DecodeCostTokens)
	}
	if ca.Temperature < 0 {
		bad("cache_aware.temperature", "%v is negative", ca.Temperature)
	}
	if ca.TreeTTL < 0 {
		bad("cache_aware.tree_ttl", "%v is negative", ca.TreeTTL)
	}
	if ca.BalanceRelThreshold < 1 {
		bad("cache_aware.balance_rel_threshold", "%v is below 1: the most loaded is never less loaded than the least", ca.BalanceRelThreshold)
	}
	if ca.MaxTreeBytes < 0 {
		bad("cache_aware.max_tree_bytes", "%d is negative", ca.MaxTreeBytes)
	}
	kv := c.KVEvents
	if kv.Listen != "" {
		if err := kvcache.CheckEndpoint(kv.Listen, true); err != nil {
			bad("kv_events.listen", "%v", err)
		}
	}
	for i, src := range kv.AllowedSources {
		if _, err := kvcache.ParseSource(src); err != nil {
			bad(fmt.Sprintf("kv_events.allowed_sources[%d]", i), "%v", err)
		}
	}
	if len(kv.AllowedSources) > 0 && kv.Listen == "" {
		bad("kv_events.allowed_sources", "set, but kv_events.listen is not: only the listening socket takes messages from sources")
	}
	if kv.StaleAfter < 0 {
		bad("kv_events.stale_after", "%v is negative", kv.StaleAfter)
	}
	if kv.ReplayTimeout < 0 {
		bad("kv_events.replay_timeout", "%v is negative", kv.ReplayTimeout)
	}
	if kv.MaxBlocksPerBackend < 0 {
		bad("kv_events.max_blocks_per_backend", "%d is negative", kv.MaxBlocksPerBackend)
	}
	switch {
	case kv.MaxBlocks < 0:
		bad("kv_events.max_blocks", "%d is negative", kv.MaxBlocks)
	case kv.MaxBlocks > 0 && kv.MaxBlocks < kv.MaxBlocksPerBackend:
		bad("kv_events.max_blocks", "%d is below kv_events.max_blocks_per_backend (%d), which could never take effect: lower that too", kv.MaxBlocks, kv.MaxBlocksPerBackend)
	}
	switch c.Tokenizer {
	case "", TokenizerEngine:
	default:
		bad("tokenizer", "%q is not %q", c.Tokenizer, TokenizerEngine)
	}
	if name, wants := c.policyWith(wantsTokens); wants && c.Tokenizer != TokenizerEngine {
		bad("tokenizer", "%s needs the request's tokens: set tokenizer: %s", name, TokenizerEngine)
	}
	for _, model := range slices.Sorted(maps.Keys(c.Tokenizers)) {
		switch tf := c.Tokenizers[model]; {
		case model == "":
			bad("tokenizers", "an entry has no model name")
		case tf.File == "":
			bad("tokenizers."+model+".file", "is required: the model's tokenizer.json")
		}
	}
	if c.TokenizeTimeout < 0 {
		bad("tokenize_timeout", "%v is negative", c.TokenizeTimeout)
	}
	if c.TokenizeMaxTokens < 0 {
		bad("tokenize_max_tokens", "%d is negative", c.TokenizeMaxTokens)
	}
	if c.BlockSize < 0 {
		bad("block_size", "%d is negative", c.BlockSize)
	}
	sources := kv.Listen != ""
	for i, b := range c.Backends {
		f := fmt.Sprintf("backends[%d]", i)
		for _, pf := range []struct {
			name string
			port int
		}{{"kv_events_port", b.KVEventsPort}, {"kv_events_replay_port", b.KVEventsReplayPort}} {
			if pf.port < 0 || pf.port > 65535 {
				bad(f+"."+pf.name, "%d is not a port", pf.port)
			}
		}
		if b.KVEventsPort > 0 || b.KVEventsDiscover {
			sources = true
		}
		if b.KVEventsEndpoint != "" {
			sources = true
			if err := kvcache.CheckEndpoint(b.KVEventsEndpoint, false); err != nil {
				bad(f+".kv_events_endpoint", "%v", err)
			}
			if b.Discover != "" {
				// Every discovered engine would dial the same address.
				bad(f+".kv_events_endpoint", "set on a discover entry: its engines have one address each; use kv_events_port (each engine's own address), or kv_events.listen, which they dial")
			}
		}
		if b.KVEventsReplayEndpoint != "" {
			if err := kvcache.CheckEndpoint(b.KVEventsReplayEndpoint, false); err != nil {
				bad(f+".kv_events_replay_endpoint", "%v", err)
			}
			if b.KVEventsEndpoint == "" && b.KVEventsPort == 0 && kv.Listen == "" {
				bad(f+".kv_events_replay_endpoint", "set, but the engine's events are read from nowhere: set kv_events_endpoint or kv_events.listen")
			}
		}
	}
	if err := kvcache.CheckTierWeights(kv.TierWeights); err != nil {
		bad("kv_events.tier_weights", "%v", err)
	}
	if len(kv.TierWeights) > 0 && !sources {
		bad("kv_events.tier_weights", "set, but no KV events are read: set kv_events.listen, or kv_events_endpoint on the backends")
	}
	if name, needs := c.policyWith(needsKVEvents); needs && !sources {
		bad("kv_events", "%s reads the engines' KV events, and none are configured: set kv_events.listen, or kv_events_endpoint on the backends (or use cache_aware)", name)
	}
	return errs
}

// deriveNames names the backends that have no name after their address, host:port. One
// engine may serve in both roles (vLLM with kv_role kv_both, common in small deployments):
// an address named by unnamed backends of both roles gets the role in front,
// "prefill-host:port" and "decode-host:port", and only then, so that an address used once
// keeps the name, and the metrics' backend label, it always had.
func (c *Config) deriveNames() {
	derived := make([]string, len(c.Backends))
	roles := make(map[string]map[Role]bool)
	for i, b := range c.Backends {
		if b.Name != "" {
			continue
		}
		if u, err := url.Parse(b.URL); err == nil && u.Host != "" {
			derived[i] = HostPort(u)
			if roles[derived[i]] == nil {
				roles[derived[i]] = make(map[Role]bool)
			}
			roles[derived[i]][b.Role] = true
		}
	}
	for i, name := range derived {
		if name == "" {
			continue
		}
		b := &c.Backends[i]
		if len(roles[name]) > 1 {
			name = string(b.Role) + "-" + name
		}
		b.Name = name
	}
}

// Validate fills the defaults of zero fields in place, then checks the config. The
// error names every bad field, e.g. "backends[1].url: ...".
func (c *Config) Validate() error {
	c.setDefaults()
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if _, ok := c.policyWith(byCost); c.Queue.TTFTBound > 0 && !ok {
		bad("flow_control.saturation_ttft", "%v needs a pool placed by cost, whose time to first token is predicted, and neither prefill_policy nor decode_policy is (%s or %s)",
			c.Queue.TTFTBound, PolicyCacheAware, PolicyPreciseCacheAware)
	} else if c.Queue.TTFTBound < 0 {
		bad("flow_control.saturation_ttft", "%v is negative", c.Queue.TTFTBound)
	}
	if c.EngineClient != EngineClientLean && c.EngineClient != EngineClientStdlib {
		bad("engine_client", "%q is not %q or %q", c.EngineClient, EngineClientLean, EngineClientStdlib)
	}
	names := make(map[string]int, len(c.Backends))
	decoders := 0
	for i, b := range c.Backends {
		f := fmt.Sprintf("backends[%d]", i)
		if err := CheckURL(b.URL); err != nil {
			bad(f+".url", "%v", err)
		}
		switch b.Role {
		case RolePrefill:
		case RoleDecode:
			decoders++
		default:
			bad(f+".role", "%q is not %q or %q", b.Role, RolePrefill, RoleDecode)
		}
		if b.Name == "" {
			if b.URL != "" {
				bad(f+".name", "empty and not derivable from the url")
			}
		} else if j, dup := names[b.Name]; dup {
			bad(f+".name", "%q already names backends[%d]; set distinct names", b.Name, j)
		} else {
			names[b.Name] = i
		}
		if b.Weight < 0 {
			bad(f+".weight", "%d is negative", b.Weight)
		}
		if b.MaxInflight < 0 {
			bad(f+".max_inflight", "%d is negative", b.MaxInflight)
		}
		if b.DataParallelSize < 0 || b.DataParallelSize > maxDataParallelSize {
			bad(f+".data_parallel_size", "%d is not between 0 and %d", b.DataParallelSize, maxDataParallelSize)
		}
		if _, ok := EngineOf(c.Engines, b.Engine); !ok {
			bad(f+".engine", "unknown engine %q (want one of %s)", b.Engine, strings.Join(c.Engines.Kinds(), ", "))
		}
		if b.KVHoldTimeout < 0 {
			bad(f+".kv_hold_timeout", "%v is negative", b.KVHoldTimeout)
		}
		if b.AdminAPIKey != "" && b.AdminAPIKeyEnv != "" {
			bad(f+".admin_api_key_env", "set together with admin_api_key; set one")
		}
		for j, m := range b.Models {
			if strings.TrimSpace(m) == "" {
				bad(fmt.Sprintf("%s.models[%d]", f, j), "empty model name")
			}
		}
		if b.BootstrapPort < 0 || b.BootstrapPort > 65535 {
			bad(f+".bootstrap_port", "%d is not a port", b.BootstrapPort)
		}
		if b.APIKey != "" && b.APIKeyEnv != "" {
			bad(f+".api_key_env", "set together with api_key; set one")
		}
		if u, err := url.Parse(b.URL); err == nil && u.Scheme != "https" {
			// TLS settings on a plain-HTTP URL would be silently ignored: the operator
			// believes the link is protected while prompts cross it in clear text.
			for _, o := range []struct {
				field string
				set   bool
			}{{"tls_ca_file", b.TLSCAFile != ""}, {"tls_server_name", b.TLSServerName != ""}, {"tls_insecure_skip_verify", b.TLSInsecureSkipVerify}} {
				if o.set {
					bad(f+"."+o.field, "set, but the url %q is not https", b.URL)
				}
			}
		}
		if b.TLSInsecureSkipVerify && b.TLSCAFile != "" {
			bad(f+".tls_insecure_skip_verify", "contradicts tls_ca_file: a CA is pointless when nothing is verified")
		}
	}
	if decoders == 0 {
		bad("backends", "at least one backend with role %q is required", RoleDecode)
	}
	for _, p := range []struct{ field, name string }{
		{"prefill_policy", c.PrefillPolicy},
		{"decode_policy", c.DecodePolicy},
	} {
		if _, ok := CapsOf(p.name); !ok {
			bad(p.field, "unknown policy %q (want %s)", p.name, strings.Join(PolicyNames(), ", "))
		}
	}
	if c.PrefixTokens < 0 {
		bad("prefix_tokens", "%d is negative", c.PrefixTokens)
	}
	switch f := c.BoundedLoadFactor; {
	case !(f >= 1):
		// The least loaded engine is at most at the average, so only a bound of c times the
		// average with c of 1 or more always has an engine within it; below, a key could find
		// none, and where it goes would no longer depend on the key.
		bad("bounded_load_factor", "%v is below 1: the bound is c × the average load, and below 1 no engine need be within it; set 1 (perfectly even) or more, or leave it unset (%v)", f, DefaultBoundedLoadFactor)
	case math.IsInf(f, 1):
		bad("bounded_load_factor", "%v is infinite: every engine would always be within its bound, and a hot key would never spread", f)
	}
	h := c.Health
	if h.Timeout < 0 {
		bad("health.timeout", "%v is negative", h.Timeout)
	}
	if h.UnhealthyThreshold < 0 {
		bad("health.unhealthy_threshold", "%d is negative", h.UnhealthyThreshold)
	}
	if h.HealthyThreshold < 0 {
		bad("health.healthy_threshold", "%d is negative", h.HealthyThreshold)
	}
	if !strings.HasPrefix(h.Path, "/") {
		bad("health.path", "%q does not start with /", h.Path)
	}
	e := c.Ejection
	if e.BaseBackoff < 0 {
		bad("ejection.base_backoff", "%v is negative", e.BaseBackoff)
	} else if h.Interval > 0 && e.BaseBackoff < h.Interval {
		// Refused rather than raised: a config whose value is silently replaced misleads
		// whoever reads it.
		bad("ejection.base_backoff", "%v is shorter than health.interval %v: an ejected backend would take requests again before a health check could look at it; set at least %v, or leave it unset (one interval)",
			e.BaseBackoff, h.Interval, h.Interval)
	}
	if e.MaxBackoff < e.BaseBackoff {
		bad("ejection.max_backoff", "%v is less than base_backoff %v", e.MaxBackoff, e.BaseBackoff)
	}
	if c.Queue.Timeout < 0 {
		bad("queue.timeout", "%v is negative", c.Queue.Timeout)
	}
	errs = append(errs, c.checkDiscovery()...)
	errs = append(errs, c.checkCache()...)
	if c.ScrapeInterval != 0 && c.ScrapeInterval < minScrapeInterval {
		bad("scrape_interval", "%v is shorter than %v", c.ScrapeInterval, minScrapeInterval)
	}
	return errors.Join(errs...)
}
