package router

import (
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.uber.org/zap"
)

// Reload switches to cfg without dropping requests in flight. A backend kept under the
// same name, URL and role keeps its in-flight count and health; a removed backend is no
// longer picked, its leases still release cleanly, and its metric series go away. A discover
// entry kept under the same name, URL and role keeps the addresses it last resolved to; a new
// one is resolved before Reload returns. An invalid cfg returns the error and leaves the
// router as it was.
func (r *Router) Reload(cfg routerconfig.Config) error {
	cfg.Backends = slices.Clone(cfg.Backends)
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("router config: %w", err)
	}
	return r.disc.install(cfg)
}

// apply installs a validated config.
func (r *Router) apply(cfg routerconfig.Config) error {
	if start := kvStartOf(cfg); r.kvStart != start && r.kvStart.namedTiers != start.namedTiers {
		return fmt.Errorf("router config: kv_events.tier_weights: the tiers besides gpu, cpu and disk are read at start (%q, not %q): the index counts each block's copies in a place per tier; restart the proxy to change them (their weights may change)",
			r.kvStart.namedTiers, start.namedTiers)
	} else if r.kvStart != start {
		return fmt.Errorf("router config: kv_events.listen, kv_events.max_blocks_per_backend, kv_events.max_blocks, kv_events.replay_timeout and block_size are read at start; restart the proxy to change them")
	}
	if !maps.Equal(r.tokenizerFiles, cfg.Tokenizers) {
		return fmt.Errorf("router config: tokenizers are read at start; restart the proxy to change them")
	}
	pre, preCaps, ok1 := r.newPolicy(cfg.PrefillPolicy, cfg, routerconfig.RolePrefill)
	dec, decCaps, ok2 := r.newPolicy(cfg.DecodePolicy, cfg, routerconfig.RoleDecode)
	if !ok1 || !ok2 { // Validate checked; keep apply honest anyway
		return fmt.Errorf("router config: unknown policy")
	}

	opts := make([]clientOptions, len(cfg.Backends))
	var errs []error
	for i, bc := range cfg.Backends {
		var err error
		if opts[i], err = resolveClientOptions(bc); err != nil {
			errs = append(errs, fmt.Errorf("backends[%d].%w", i, err))
		}
		opts[i].engineClient = cfg.EngineClient
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("router config: %w", err)
	}

	r.reloadMu.Lock()
	defer r.reloadMu.Unlock()

	old := make(map[string]*Backend)
	for _, b := range r.backends() {
		old[b.Name] = b
	}
	all := make([]*Backend, 0, len(cfg.Backends))
	kept := make(map[*backendState]bool)
	var replaced []*http.Client
	for i, bc := range cfg.Backends {
		var st *backendState
		var client *http.Client
		if o, ok := old[bc.Name]; ok && o.URLString == bc.URL && o.Role == bc.Role {
			st = o.st
			kept[st] = true
			client = o.clientIfSame(opts[i])
			if client == nil {
				replaced = append(replaced, o.client)
			}
		}
		if client == nil {
			client = newClient(opts[i])
			if opts[i].skipVerify {
				r.logger.Warn("tls certificate verification is off for a backend: anyone on the network path can pose as it and read every prompt (tls_insecure_skip_verify)",
					zap.String("backend", bc.Name), zap.String("url", bc.URL))
			}
		}
		eng, _ := routerconfig.EngineOf(cfg.Engines, bc.Engine)
		b := newBackend(bc, eng, client, st)
		b.opts = opts[i]
		b.withAdmin(opts[i])
		all = append(all, b)
	}
	if cfg.Health.Interval <= 0 {
		// Without active checks nothing would ever mark a down backend up again.
		for _, b := range all {
			b.st.up.Store(true)
		}
	}
	if err := r.index.SetTierWeights(cfg.KVEvents.TierWeights); err != nil { // the names checked above
		return fmt.Errorf("router config: kv_events.tier_weights: %w", err)
	}
	stale := cfg.KVEvents.StaleAfter
	r.staleAfter.Store(&stale)
	r.settings.Store(&settings{health: cfg.Health, ejection: cfg.Ejection, scrapeInterval: cfg.ScrapeInterval,
		tokenizeTimeout: cfg.TokenizeTimeout})
	r.limitLocalTokens(cfg.TokenizeMaxTokens)

	// Lock both pools (always prefill first) so that a Release sees a backend either
	// current or removed, never half way, and its counter series is not re-created
	// after deletion.
	r.prefill.mu.Lock()
	r.decode.mu.Lock()
	for _, p := range []*pool{r.prefill, r.decode} {
		var mine []*Backend
		for _, b := range all {
			if b.Role == p.role {
				mine = append(mine, b)
			}
		}
		policyName, pol, caps := cfg.DecodePolicy, dec, decCaps
		if p.role == routerconfig.RolePrefill {
			policyName, pol, caps = cfg.PrefillPolicy, pre, preCaps
		}
		cache := cacheSettings{cfg.CacheAware, cfg.KVEvents.StaleAfter, cfg.BoundedLoadFactor}
		if p.policy == nil || p.policyName != policyName || p.prefixTokens != cfg.PrefixTokens || p.cache != cache {
			p.policy, p.policyName, p.caps, p.prefixTokens, p.cache = pol, policyName, caps, cfg.PrefixTokens, cache
		}
		if w, ok := p.policy.(poolWatcher); ok {
			w.SetPool(mine)
		}
		p.backends = mine
		p.queueSize, p.queueTimeout, p.ttftBound, p.reservedSlots = cfg.Queue.Size, cfg.Queue.Timeout, cfg.Queue.TTFTBound, cfg.Queue.ReservedSlots
		p.bounded.Store(cfg.Queue.TTFTBound > 0)
		p.loadFactor = cfg.BoundedLoadFactor
	}
	var removed []*Backend
	for _, b := range old {
		if !kept[b.st] {
			b.st.removed.Store(true)
			b.st.leaving.Load().close()
			r.metrics.forget(b)
			removed = append(removed, b)
		}
	}
	r.all.Store(&all)
	r.forgetModels()
	r.prefill.dispatchLocked()
	r.decode.dispatchLocked()
	r.decode.mu.Unlock()
	r.prefill.mu.Unlock()

	// After the pools, so that a removed backend is no candidate when its blocks go.
	r.setKVEndpoints(cfg, all)
	for _, c := range replaced {
		// Calls in flight on the old client keep their connections; idle ones would linger.
		c.CloseIdleConnections()
	}
	for _, b := range removed {
		if b.Inflight() == 0 {
			b.closeIdle()
		}
		r.logger.Info("backend removed", zap.String("backend", b.Name), zap.String("role", string(b.Role)), zap.Int64("inflight", b.Inflight()))
	}
	select {
	case r.reloaded <- struct{}{}:
	default:
	}
	r.logger.Info("router config applied", zap.Int("backends", len(all)), zap.Int("removed", len(removed)))
	return nil
}

// clientIfSame returns b's client when it was built from o (same pool sizing, key and TLS
// settings, CA file content included), so a reload that keeps a backend keeps its warm
// connections; nil otherwise.
func (b *Backend) clientIfSame(o clientOptions) *http.Client {
	if b.opts != o {
		return nil
	}
	return b.client
}
