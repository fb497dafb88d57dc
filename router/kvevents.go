package router

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// kvEndpoints are the backends' KV event endpoints as the subscribers know them. Every
// backend is one, so that a topic on kv_events.listen can name it by its URL's host:port.
func kvEndpoints(all []*Backend) []kvcache.Endpoint {
	out := make([]kvcache.Endpoint, 0, len(all))
	for _, b := range all {
		ep := kvcache.Endpoint{Engine: b.Name, HostPort: routerconfig.HostPort(b.URL), Dial: b.kvEvents, Replay: b.kvReplay}
		if s := b.st.kvSources.Load(); s != nil {
			ep.Sources = *s
		}
		out = append(out, ep)
	}
	return out
}

// kvEventSource is one entry of vLLM's GET /kv_event_sources.
type kvEventSource struct {
	Rank     int     `json:"data_parallel_rank"`
	Endpoint string  `json:"endpoint"`
	Replay   *string `json:"replay_endpoint"`
}

// listKVSources asks an engine where its KV event publishers are bound (vLLM's
// GET /kv_event_sources: a JSON array, one entry per data parallel rank, of
// data_parallel_rank, endpoint, replay_endpoint, topic), and dials them from then on. An
// engine that does not answer keeps the sources it gave last.
func (r *Router) listKVSources(ctx context.Context, b *Backend, h routerconfig.HealthConfig) {
	ctx, cancel := context.WithTimeout(ctx, h.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(b.URLString, "/")+"/kv_event_sources", nil)
	if err != nil {
		return
	}
	resp, err := b.client.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	var list []kvEventSource
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list) != nil {
		if ce := r.logger.Check(zap.DebugLevel, "kv event sources not read"); ce != nil {
			ce.Write(zap.String("backend", b.Name), zap.Int("status", resp.StatusCode))
		}
		return
	}
	slices.SortFunc(list, func(a, b kvEventSource) int { return a.Rank - b.Rank })
	sources := make([]kvcache.Source, 0, len(list))
	for _, s := range list {
		src := kvcache.Source{Dial: onEngineHost(s.Endpoint, b.URL)}
		if s.Replay != nil {
			src.Replay = onEngineHost(*s.Replay, b.URL)
		}
		if kvcache.CheckEndpoint(src.Dial, false) != nil || src.Replay != "" && kvcache.CheckEndpoint(src.Replay, false) != nil {
			r.logger.Warn("kv event source not dialable, left out", zap.String("backend", b.Name), zap.Int("data_parallel_rank", s.Rank),
				zap.String("endpoint", s.Endpoint))
			continue
		}
		sources = append(sources, src)
	}
	if old := b.st.kvSources.Load(); old != nil && slices.Equal(*old, sources) {
		return
	}
	r.logger.Info("backend kv event sources", zap.String("backend", b.Name), zap.Any("sources", sources))
	b.st.kvSources.Store(&sources)
	r.events.SetEndpoints(kvEndpoints(r.backends()))
}

// onEngineHost is a source's endpoint, its host put as the engine's own when the engine
// reports the wildcard it bound ("*", 0.0.0.0, ::): the proxy dials the engine where it
// reaches its HTTP server.
func onEngineHost(ep string, engine *url.URL) string {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok || engine == nil {
		return ep
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return ep
	}
	if ip, err := netip.ParseAddr(host); host == "*" || err == nil && ip.IsUnspecified() {
		return "tcp://" + net.JoinHostPort(engine.Hostname(), port)
	}
	return ep
}

// setKVEndpoints hands the subscribers the backends and kv_events.allowed_sources.
func (r *Router) setKVEndpoints(cfg routerconfig.Config, all []*Backend) {
	allowed := make([]netip.Prefix, 0, len(cfg.KVEvents.AllowedSources))
	for _, s := range cfg.KVEvents.AllowedSources {
		if p, err := kvcache.ParseSource(s); err == nil { // Validate refused the others
			allowed = append(allowed, p)
		}
	}
	r.events.SetAllowedSources(allowed)
	r.events.SetEndpoints(kvEndpoints(all))
}

// runEvents runs the KV event subscribers until ctx is done.
func (r *Router) runEvents(ctx context.Context) {
	if err := r.events.Run(ctx); err != nil {
		r.logger.Error("kv events stopped", zap.Error(err))
	}
}

// forgetCache drops what the proxy believes b's prefix cache holds: an engine that went
// down may come back empty, and until it does it is no candidate anyway.
func (r *Router) forgetCache(b *Backend) {
	r.index.Forget(b.Name)
	if p := r.pool(b.Role); p != nil {
		p.mu.Lock()
		pol := p.policy
		p.mu.Unlock()
		if f, ok := pol.(forgetter); ok {
			f.Forget(b.Name)
		}
	}
}

// prefixCacheStatus is what the pool's cache-aware policy believes b holds, nil under
// another policy.
func (r *Router) prefixCacheStatus(b *Backend, now time.Time) *PrefixCacheStatus {
	p := r.pool(b.Role)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	pol := p.policy
	p.mu.Unlock()
	if ca, ok := pol.(*CacheAware); ok {
		return ca.prefixCacheStatus(b, now)
	}
	return nil
}

// costStatus is b's cost figures under its pool's cost model, nil under a policy of none.
func (r *Router) costStatus(b *Backend, now time.Time) *CostStatus {
	p := r.pool(b.Role)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	m := p.costModelLocked()
	p.mu.Unlock()
	if m == nil {
		return nil
	}
	return b.costStatus(m, now)
}

// CachedBlocks returns up to limit of the index's keys of the blocks that the backend called
// name holds as its KV events told, in no order: for showing an engine's cache as the proxy
// sees it (its count is in Backends' PrefixCache). Nil when the proxy has none of its events.
func (r *Router) CachedBlocks(name string, limit int) []uint64 { return r.index.BlockKeys(name, limit) }

// CachedTokens returns how many of h.Tokens' leading tokens the backend called name holds
// in its prefix cache as its KV events tell, under h's LoRA and CacheSalt (the identity the
// blocks are keyed by beyond their tokens), each block weighed by its tier
// (kv_events.tier_weights) and rounded down: how many tokens' compute the cache saves,
// what conditional disaggregation weighs against the prompt's length. A prompt held on CPU
// at weight 0.75 counts three quarters of its length: its reload costs a quarter of its
// compute. ok is false when the proxy has no events of the backend newer than
// kv_events.stale_after, so nothing can be said.
func (r *Router) CachedTokens(name string, h Hint) (n int, ok bool) {
	v := r.index.Match(kvcache.NewMatcherFor(h.Tokens, h.cacheIdentity()), name)
	stale := r.staleAfter.Load()
	if v.Last.IsZero() || stale == nil || r.now().Sub(v.Last) >= *stale {
		return 0, false
	}
	return weightedTokens(v), true
}

// cacheIdentity is what h's prompt's blocks are keyed by beyond its tokens.
func (h Hint) cacheIdentity() kvcache.Identity {
	return kvcache.Identity{LoRA: h.LoRA, Salt: h.CacheSalt}
}

// kvEngineIn is b's engine in index x, its handle kept on the backend's state: a pick looks
// every candidate up, and a name's lookup under the index's lock for each of a thousand
// engines would cost more than the match.
func (b *Backend) kvEngineIn(x *kvcache.Index) *kvcache.Engine {
	if e := b.st.kvEngine.Load(); e != nil && e.Index() == x && !e.Removed() {
		return e
	}
	e := x.Engine(b.Name)
	b.st.kvEngine.Store(e)
	return e
}

// eventsDialed reports whether the router dials b's KV event publishers: configured, or
// listed by the engine (kv_events_discover).
func (b *Backend) eventsDialed() bool { return b.kvEvents != "" || b.st.kvSources.Load() != nil }

// weightedTokens is v's weighted match in whole tokens; the epsilon keeps a sum of weights
// such as 0.1 that floats cannot hold from losing a token.
func weightedTokens(v kvcache.View) int { return int(v.Weighted + 1e-9) }
