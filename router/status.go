package router

import "github.com/pdproxy/pdproxy/router/routerconfig"

// BackendStatus is one backend as shown by GET /debug/backends.
type BackendStatus struct {
	// Name is the backend's configured or derived name.
	Name string `json:"name"`
	// URL is the backend's base URL as configured.
	URL string `json:"url"`
	// Role is prefill or decode.
	Role routerconfig.Role `json:"role"`
	// Healthy is true when the backend is neither down (failed checks, a refused
	// connection) nor ejected, i.e. it may be picked when it has room.
	Healthy bool `json:"healthy"`
	// Ejected is true while passive health keeps the backend out.
	Ejected bool `json:"ejected"`
	// DownReason says why the backend is out, empty (and left out) while it may be picked:
	// "connection refused" (a call found nothing listening; back when a health check
	// passes), "health check: connection refused", "health check failed",
	// "ejected: consecutive failures", "ejected: failed on probation", or
	// "ejected: connection refused" (with active checks off).
	DownReason string `json:"down_reason,omitempty"`
	// Inflight is the number of leases counted on the backend now.
	Inflight int64 `json:"inflight"`
	// MaxInflight is the limit above which requests queue.
	MaxInflight int `json:"max_inflight"`
	// Weight is the configured weight.
	Weight int `json:"weight"`
	// Ejections counts passive ejections since the backend was added.
	Ejections int64 `json:"ejections"`
	// Engine is the engine kind.
	Engine string `json:"engine"`
	// Load is the engine's load as last scraped, for a pool whose policy weighs it
	// (least_loaded, cache_aware, precise_cache_aware); absent until the first good scrape.
	Load *LoadStatus `json:"load,omitempty"`
	// PrefixCache is what the proxy believes the engine's prefix cache holds; absent unless
	// its pool's policy is cache_aware or precise_cache_aware.
	PrefixCache *PrefixCacheStatus `json:"prefix_cache,omitempty"`
	// Cost is what a new request would find on the engine by the cost its pool places by;
	// absent unless its pool's policy is cache_aware or precise_cache_aware.
	Cost *CostStatus `json:"cost,omitempty"`
	// Models are the models the backend serves (configured, or listed by the engine);
	// absent while unknown.
	Models []string `json:"models,omitempty"`
	// Ranks are the engine's data-parallel ranks with their in-flight counts; absent for
	// an engine of one rank.
	Ranks []RankStatus `json:"ranks,omitempty"`
}

// RankStatus is one data-parallel rank of a backend.
type RankStatus struct {
	Rank     int   `json:"rank"`
	Inflight int64 `json:"inflight"`
}

func (b *Backend) rankStatus() []RankStatus {
	rp := b.st.ranks.counts.Load()
	if rp == nil || len(*rp) < 2 {
		return nil
	}
	ranks := *rp
	out := make([]RankStatus, len(ranks))
	for i := range ranks {
		out[i] = RankStatus{Rank: i, Inflight: ranks[i].Load()}
	}
	return out
}

// Backends reports every current backend in config order.
func (r *Router) Backends() []BackendStatus {
	now := r.now()
	all := r.backends()
	out := make([]BackendStatus, 0, len(all))
	for _, b := range all {
		out = append(out, BackendStatus{
			Name:        b.Name,
			URL:         b.URLString,
			Role:        b.Role,
			Healthy:     b.available(now),
			Ejected:     b.ejected(now),
			DownReason:  b.outReason(now),
			Inflight:    b.Inflight(),
			MaxInflight: b.MaxInflight,
			Weight:      b.Weight,
			Ejections:   b.Ejections(),
			Engine:      b.Engine.Kind(),
			Load:        b.loadStatus(now),
			PrefixCache: r.prefixCacheStatus(b, now),
			Cost:        r.costStatus(b, now),
			Ranks:       b.rankStatus(),
			Models:      b.Models(),
		})
	}
	return out
}
