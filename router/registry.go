package router

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdproxy/pdproxy/kvcache"
)

// Policy names accepted by Config.PrefillPolicy and Config.DecodePolicy.
const (
	PolicyLeastInflight  = "least_inflight"
	PolicyRoundRobin     = "round_robin"
	PolicyPowerOfTwo     = "power_of_two"
	PolicyPrefixAffinity = "prefix_affinity"
	PolicyLeastLoaded    = "least_loaded"
	// PolicyCacheAware routes by the text routed to each engine before (see CacheAware).
	PolicyCacheAware = "cache_aware"
	// PolicyPreciseCacheAware routes by the blocks each engine's KV events say it holds,
	// falling back to cache_aware's view (see CacheAware).
	PolicyPreciseCacheAware = "precise_cache_aware"
)

// policyBuild is what a policy's constructor may take from the router. Its zero value is a
// policy on its own (NewPolicy): the wall clock, no metrics, the default settings.
type policyBuild struct {
	prefixTokens int
	// loadFactor is bounded_load_factor; zero means its default.
	loadFactor float64
	cache      CacheAwareConfig
	staleAfter time.Duration
	// index is the router's view of the engines' KV events; nil gives precise_cache_aware
	// an index of its own that nothing fills.
	index *kvcache.Index
	// now is the router's clock; nil means time.Now.
	now func() time.Time
	// ratio makes the series the policy observes its picks' predicted share in; it is
	// called only by the policies that observe one, so that the others show no series.
	// Nil observes nothing.
	ratio func() prometheus.Observer
	// tierTokens makes the series precise_cache_aware counts its picks' matched tokens by
	// tier in, called only by it. Nil counts nothing.
	tierTokens func() *[4]prometheus.Counter
}

// policyEntry is one policy config may name: its constructor and its capabilities.
type policyEntry struct {
	name string
	caps policyCaps
	new  func(policyBuild) Policy
}

// policies is every policy config may name, in the order an error lists them (hence a
// slice, not a map). It is never written: the one table of names, as Caddy's module
// registry is, without its registration at init.
var policies = []policyEntry{
	{name: PolicyLeastInflight, new: func(policyBuild) Policy { return &LeastInflight{} }},
	{name: PolicyRoundRobin, new: func(policyBuild) Policy { return &RoundRobin{} }},
	{name: PolicyPowerOfTwo, new: func(policyBuild) Policy { return &PowerOfTwo{} }},
	{name: PolicyPrefixAffinity, new: func(b policyBuild) Policy {
		p := NewPrefixAffinity(b.prefixTokens)
		if b.loadFactor > 0 {
			p.factor = b.loadFactor
		}
		return p
	}},
	{name: PolicyLeastLoaded, caps: policyCaps{scrapesLoad: true},
		new: func(b policyBuild) Policy { return &LeastLoaded{now: b.now} }},
	{name: PolicyCacheAware, caps: policyCaps{scrapesLoad: true, byCost: true}, new: func(b policyBuild) Policy { return newCacheAware(b, nil) }},
	{name: PolicyPreciseCacheAware, caps: policyCaps{wantsTokens: true, needsKVEvents: true, scrapesLoad: true, byCost: true},
		new: func(b policyBuild) Policy {
			index := b.index
			if index == nil {
				index = kvcache.NewIndex(0, 0)
			}
			return newCacheAware(b, index)
		}},
}

// newCacheAware is NewCacheAware with b's settings, clock and match ratio series.
func newCacheAware(b policyBuild, index *kvcache.Index) *CacheAware {
	p := NewCacheAware(b.cache, index, b.staleAfter)
	p.now = b.now
	if b.prefixTokens > 0 {
		p.keyTokens = b.prefixTokens
	}
	if b.loadFactor > 0 {
		p.loadFactor = b.loadFactor
	}
	if b.ratio != nil {
		p.ratio = b.ratio()
	}
	if index != nil && b.tierTokens != nil {
		p.tierTokens = b.tierTokens()
	}
	return p
}

// policyByName is the policy config calls name.
func policyByName(name string) (policyEntry, bool) {
	for _, e := range policies {
		if e.name == name {
			return e, true
		}
	}
	return policyEntry{}, false
}

func policyNames() []string {
	names := make([]string, len(policies))
	for i, e := range policies {
		names[i] = e.name
	}
	return names
}

func knownPolicy(name string) bool {
	_, ok := policyByName(name)
	return ok
}

// NewPolicy returns the policy called name ("" is least_inflight); prefixTokens is used by
// prefix_affinity. The cache-aware policies come with their defaults and, for
// precise_cache_aware, an index of its own that nothing fills: the router builds its own
// with its settings and event subscribers.
func NewPolicy(name string, prefixTokens int) (Policy, bool) {
	if name == "" {
		name = PolicyLeastInflight
	}
	e, ok := policyByName(name)
	if !ok {
		return nil, false
	}
	return e.new(policyBuild{prefixTokens: prefixTokens}), true
}

// newPolicy is the policy called name for role's pool, with the router's clock, index and
// metrics, and cfg's settings, and what it needs of the router.
func (r *Router) newPolicy(name string, cfg Config, role Role) (Policy, policyCaps, bool) {
	e, ok := policyByName(name)
	if !ok {
		return nil, policyCaps{}, false
	}
	p := e.new(policyBuild{
		prefixTokens: cfg.PrefixTokens,
		loadFactor:   cfg.BoundedLoadFactor,
		cache:        cfg.CacheAware,
		staleAfter:   cfg.KVEvents.StaleAfter,
		index:        r.index,
		now:          func() time.Time { return r.now() },
		ratio:        func() prometheus.Observer { return r.metrics.matchRatio.WithLabelValues(string(role), name) },
		tierTokens:   r.metrics.tierCounters,
	})
	return p, e.caps, true
}

// policyWith is the first of the config's policies that has the capability has, by name;
// ok is false when neither has it.
func (c *Config) policyWith(has func(policyCaps) bool) (name string, ok bool) {
	for _, n := range []string{c.PrefillPolicy, c.DecodePolicy} {
		if e, known := policyByName(n); known && has(e.caps) {
			return n, true
		}
	}
	return "", false
}

// Capabilities, for Config.policyWith.
func wantsTokens(c policyCaps) bool   { return c.wantsTokens }
func needsKVEvents(c policyCaps) bool { return c.needsKVEvents }
func byCost(c policyCaps) bool        { return c.byCost }

// UsesTokens reports whether a pool's policy scores requests by their tokens
// (precise_cache_aware), for which the request is tokenized before it is routed.
func (c *Config) UsesTokens() bool {
	_, ok := c.policyWith(wantsTokens)
	return ok
}
