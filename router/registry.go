package router

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// policyBuild is what a policy's constructor may take from the router. Its zero value is a
// policy on its own (NewPolicy): the wall clock, no metrics, the default settings.
type policyBuild struct {
	prefixTokens int
	// loadFactor is bounded_load_factor; zero means its default.
	loadFactor float64
	cache      routerconfig.CacheAwareConfig
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
	// sharedPlacements is Config.SharedPlacements.
	sharedPlacements bool
}

// constructors build every policy config may name (routerconfig.Policies), by name. It is
// never written: the one table of constructors, as Caddy's module registry is, without its
// registration at init.
var constructors = map[string]func(policyBuild) Policy{
	routerconfig.PolicyLeastInflight: func(policyBuild) Policy { return &LeastInflight{} },
	routerconfig.PolicyRoundRobin:    func(policyBuild) Policy { return &RoundRobin{} },
	routerconfig.PolicyPowerOfTwo:    func(policyBuild) Policy { return &PowerOfTwo{} },
	routerconfig.PolicyPrefixAffinity: func(b policyBuild) Policy {
		p := NewPrefixAffinity(b.prefixTokens)
		if b.loadFactor > 0 {
			p.factor = b.loadFactor
		}
		return p
	},
	routerconfig.PolicyLeastLoaded: func(b policyBuild) Policy { return &LeastLoaded{now: b.now} },
	routerconfig.PolicyCacheAware:  func(b policyBuild) Policy { return newCacheAware(b, nil) },
	routerconfig.PolicyPreciseCacheAware: func(b policyBuild) Policy {
		index := b.index
		if index == nil {
			index = kvcache.NewIndex(0, 0)
		}
		return newCacheAware(b, index)
	},
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
	// The placements keep a group where it first went on every replica: cache_aware may
	// spread its ties by what this replica sent each engine lately.
	p.placementsShared = index == nil && b.sharedPlacements
	return p
}

// NewPolicy returns the policy called name ("" is least_inflight); prefixTokens is used by
// prefix_affinity. The cache-aware policies come with their defaults and, for
// precise_cache_aware, an index of its own that nothing fills: the router builds its own
// with its settings and event subscribers.
func NewPolicy(name string, prefixTokens int) (Policy, bool) {
	if name == "" {
		name = routerconfig.PolicyLeastInflight
	}
	build, ok := constructors[name]
	if !ok {
		return nil, false
	}
	return build(policyBuild{prefixTokens: prefixTokens}), true
}

// newPolicy is the policy called name for role's pool, with the router's clock, index and
// metrics, and cfg's settings, and what it needs of the router.
func (r *Router) newPolicy(name string, cfg routerconfig.Config, role routerconfig.Role) (Policy, routerconfig.PolicyCaps, bool) {
	caps, known := routerconfig.CapsOf(name)
	build, ok := constructors[name]
	if !known || !ok {
		return nil, routerconfig.PolicyCaps{}, false
	}
	p := build(policyBuild{
		prefixTokens:     cfg.PrefixTokens,
		loadFactor:       cfg.BoundedLoadFactor,
		cache:            cfg.CacheAware,
		staleAfter:       cfg.KVEvents.StaleAfter,
		index:            r.index,
		now:              func() time.Time { return r.now() },
		ratio:            func() prometheus.Observer { return r.metrics.matchRatio.WithLabelValues(string(role), name) },
		tierTokens:       r.metrics.tierCounters,
		sharedPlacements: cfg.SharedPlacements,
	})
	return p, caps, true
}
