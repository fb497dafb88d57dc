package router

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvcache"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Router owns the backend pools. Its methods are safe for concurrent use.
type Router struct {
	logger  *zap.Logger
	metrics *metrics
	// now is the clock for ejection; tests replace it before use.
	now func() time.Time

	prefill, decode *pool

	// all is every current backend in config order, replaced on Reload.
	all atomic.Pointer[[]*Backend]
	// settings holds the parts of the config read outside the pools.
	settings atomic.Pointer[settings]
	// shares carries the fair queues' service to other replicas (ShareFlows); nil shares
	// nothing.
	shares FlowShares
	// reloaded wakes Run when a Reload may have changed the check interval.
	reloaded chan struct{}
	// reloadMu serializes New's first apply and Reloads.
	reloadMu sync.Mutex
	// disc resolves the discover entries; every config goes through it to apply.
	disc *discovery
	// index is what the engines' KV events say each holds, fed by events; shared by the
	// pools (backend names are unique across them). kvStart is the part of the config
	// they were built with, which a reload may not change.
	index   *kvcache.Index
	events  *kvcache.Events
	kvStart kvStart
	// tokenizer is routerconfig.Config.EngineTokenizer, read at New; nil tokenizes nothing.
	tokenizer routerconfig.Tokenizer
	// local are routerconfig.Config.LocalTokenizers by model (localtokens.go), and tokenizerFiles the
	// routerconfig.Config.Tokenizers they were read from, which a reload may not change.
	local          map[string]*localTokenizer
	tokenBufs      sync.Pool // of *[]uint32: the buffers Tokens tokenizes into in the proxy
	tokenizerFiles map[string]routerconfig.TokenizerFiles
	// staleAfter is kv_events.stale_after in force.
	staleAfter atomic.Pointer[time.Duration]
	// modelViews are Models' answers, current while their generation is modelGen's, which
	// forgetModels moves on.
	modelViews atomic.Pointer[modelViews]
	modelGen   atomic.Uint64
}

type settings struct {
	health          routerconfig.HealthConfig
	ejection        routerconfig.EjectionConfig
	scrapeInterval  time.Duration
	tokenizeTimeout time.Duration
}

// kvStart is the KV event settings read once, at New.
type kvStart struct {
	listen                         string
	blockSize, maxBlocks, maxTotal int
	replayTimeout                  time.Duration
	// namedTiers are kv_events.tier_weights' tiers besides gpu, cpu and disk, joined by
	// commas.
	namedTiers string
}

func kvStartOf(cfg routerconfig.Config) kvStart {
	kv := cfg.KVEvents
	return kvStart{listen: kv.Listen, blockSize: cfg.BlockSize, maxBlocks: kv.MaxBlocksPerBackend, maxTotal: kv.MaxBlocks,
		replayTimeout: kv.ReplayTimeout, namedTiers: strings.Join(kvcache.NamedTiers(kv.TierWeights), ",")}
}

// New validates cfg (filling its defaults) and builds a router. It starts nothing: Run
// runs the active health checks. A nil logger logs nothing; a nil reg registers no
// metrics.
func New(cfg routerconfig.Config, logger *zap.Logger, reg prometheus.Registerer) (*Router, error) {
	if logger == nil {
		logger = zap.NewNop()
	}
	cfg.Backends = slices.Clone(cfg.Backends) // Validate writes defaults into it
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("router config: %w", err)
	}
	r := &Router{
		logger:    logger,
		now:       time.Now,
		reloaded:  make(chan struct{}, 1),
		tokenizer: cfg.EngineTokenizer,
	}
	r.prefill = &pool{role: routerconfig.RolePrefill, r: r}
	r.decode = &pool{role: routerconfig.RoleDecode, r: r}
	r.metrics = newMetrics(r)
	r.disc = newDiscovery(r)
	r.kvStart = kvStartOf(cfg)
	r.index = kvcache.NewIndex(cfg.KVEvents.MaxBlocksPerBackend, cfg.BlockSize)
	r.index.SetMaxTotal(cfg.KVEvents.MaxBlocks)
	ev, err := kvcache.NewEvents(kvcache.EventsConfig{Listen: cfg.KVEvents.Listen, ReplayTimeout: cfg.KVEvents.ReplayTimeout},
		r.index, logger.Named("kv_events"), reg)
	if err != nil {
		return nil, err
	}
	r.events = ev
	if r.local, err = newLocalTokenizers(cfg, reg); err != nil {
		return nil, err
	}
	r.tokenizerFiles = maps.Clone(cfg.Tokenizers)
	if reg != nil {
		if err := r.metrics.register(reg); err != nil {
			return nil, fmt.Errorf("register router metrics: %w", err)
		}
		if err := reg.Register(r.disc.errors); err != nil {
			return nil, fmt.Errorf("register router metrics: %w", err)
		}
	}
	if err := r.disc.install(cfg); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *Router) pool(role routerconfig.Role) *pool {
	switch role {
	case routerconfig.RolePrefill:
		return r.prefill
	case routerconfig.RoleDecode:
		return r.decode
	}
	return nil
}

func (r *Router) backends() []*Backend {
	if p := r.all.Load(); p != nil {
		return *p
	}
	return nil
}

// Acquire picks a backend of role and counts one in-flight request on it. While every
// eligible backend is at max_inflight it waits in a bounded queue that serves its flows
// (h.Flow) by weight and each flow's requests earliest deadline first (arrival plus h.Slack;
// first come, first served among equal Slacks). Errors: ErrNoBackend (no healthy backend of
// the role), ErrQueueFull, ErrTenantQueueFull, ErrPoolSaturated, ErrQueueTimeout, or
// ctx.Err() as soon as ctx is done. The caller must Release the lease.
func (r *Router) Acquire(ctx context.Context, role routerconfig.Role, h Hint) (*Lease, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p := r.pool(role)
	if p == nil {
		return nil, fmt.Errorf("role %q: %w", role, ErrNoBackend)
	}
	p.mu.Lock()
	if p.reservedSlots > 0 {
		p.flowSlots.arrived(h.Flow.Key, r.now())
	}
	if p.waiters.Len() > 0 {
		// A slot freed by an ejection ending or a check passing belongs to the
		// waiters first.
		p.dispatchLocked()
	}
	var b *Backend
	avail, choice, cost := true, SessionChoice(""), Cost{}
	if p.ttftBound == 0 || p.waiters.Len() == 0 {
		// Under a TTFT bound, requests still waiting after the dispatch are held back by
		// it, not by slots: one that came later waits behind them, in its tenant's turn.
		b, avail, choice, cost = p.pickLocked(h)
	}
	if b != nil {
		l := p.leaseLocked(b, choice, cost, h.Flow.Key)
		p.mu.Unlock()
		return l, nil
	}
	if !avail {
		p.mu.Unlock()
		return nil, ErrNoBackend
	}
	if err := p.waiters.admitLocked(h, max(p.queueSize, 0)); err != nil {
		p.mu.Unlock()
		r.metrics.queueRejected.WithLabelValues(string(role), reason(err)).Inc()
		return nil, err
	}
	start := time.Now()
	// The deadline is on the router's clock, which tests move.
	w := &waiter{h: h, ch: make(chan waitResult, 1), deadline: r.now().Add(max(h.Slack, 0)), since: start}
	p.waiters.push(w)
	if p.ttftBound > 0 {
		// Under the bound it was not picked because others wait (above): in its tenant's
		// turn it may go at once, where those held back are of other models or engines.
		p.dispatchLocked()
	}
	timeout, depth := p.queueTimeout, p.waiters.Len()
	if h.MaxWait > 0 {
		timeout = h.MaxWait
	}
	p.mu.Unlock()
	if ce := r.logger.Check(zap.DebugLevel, "request queued for a backend"); ce != nil {
		ce.Write(zap.String("request_id", h.RequestID), zap.String("role", string(role)), zap.Int("queue_depth", depth),
			zap.String("class", h.Class))
	}

	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var res waitResult
	select {
	case res = <-w.ch:
	case <-ctx.Done():
		res = p.leave(w, ctx.Err())
	case <-timer.C:
		res = p.leave(w, ErrQueueTimeout)
	}
	class := h.Class
	if class == "" {
		class = "none"
	}
	waited := time.Since(start).Seconds()
	r.metrics.queueWait.WithLabelValues(string(role), class).Observe(waited)
	if h.Flow.Label != "" {
		r.metrics.sat.flowWait.WithLabelValues(h.Flow.Label).Observe(waited)
	}
	if res.err != nil {
		r.metrics.queueRejected.WithLabelValues(string(role), reason(res.err)).Inc()
	}
	return res.lease, res.err
}

// Has reports whether any backend of role is configured, healthy or not: a discover entry
// counts even while its name has no address.
func (r *Router) Has(role routerconfig.Role) bool {
	for _, b := range r.backends() {
		if b.Role == role {
			return true
		}
	}
	return r.disc.declares(role)
}

// Ready reports whether at least one decode backend is healthy and not ejected: the
// proxy can serve.
func (r *Router) Ready() bool {
	now := r.now()
	for _, b := range r.backends() {
		if b.Role == routerconfig.RoleDecode && b.available(now) {
			return true
		}
	}
	return false
}

// Available returns the backends of role that may be picked now (passing active checks,
// not ejected, not removed by a Reload), in config order, whether or not they have room
// under max_inflight. It is for calls made outside a lease, such as listing models: make
// them through each backend's Client, which carries its key and TLS settings. The
// backends are shared and read-only.
func (r *Router) Available(role routerconfig.Role) []*Backend {
	now := r.now()
	var out []*Backend
	for _, b := range r.backends() {
		if b.Role == role && b.available(now) {
			out = append(out, b)
		}
	}
	return out
}

// Usable reports whether b may take requests now: up, not ejected, not removed. A request
// that reserved b earlier asks again before it sends b a leg, so that no pair goes out half
// to an engine ejected meanwhile.
func (r *Router) Usable(b *Backend) bool { return b.available(r.now()) }

// MinKVHoldTimeout is the smallest engine KV hold timeout among the backends of role,
// or 0 when there are none: a proxy hold longer than it would forward KV params that the
// engine may already have freed. A discover entry counts for the backends it may add.
func (r *Router) MinKVHoldTimeout(role routerconfig.Role) time.Duration {
	var m time.Duration
	holds := r.disc.holds(role)
	for _, b := range r.backends() {
		if b.Role == role {
			holds = append(holds, b.KVHoldTimeout)
		}
	}
	for _, h := range holds {
		if h > 0 && (m == 0 || h < m) {
			m = h
		}
	}
	return m
}

// CloseIdleConnections drops every backend's idle keep-alive connections. The pools refill on
// demand; this is for shutdown, and for tests that count goroutines after a run.
func (r *Router) CloseIdleConnections() {
	for _, b := range r.backends() {
		b.closeIdle()
	}
}
