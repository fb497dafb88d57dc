package router

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvcache"
)

// Errors returned by Acquire. The proxy maps them to HTTP answers.
var (
	// ErrNoBackend means no healthy backend of the role is available: answer 503.
	ErrNoBackend = errors.New("router: no healthy backend")
	// ErrQueueFull means every eligible backend is full and so is the wait queue: 429.
	ErrQueueFull = errors.New("router: all backends busy and queue full")
	// ErrQueueTimeout means the request waited queue.timeout for a free backend: 503.
	ErrQueueTimeout = errors.New("router: timed out waiting for a free backend")
)

// Hint carries what a policy and the wait queue may use about a request. Only Class, a
// name from the proxy's config, reaches a metric label.
type Hint struct {
	// RequestID identifies the request in logs.
	RequestID string
	// Prefix is the start of the prompt, for prefix_affinity; empty means no affinity.
	Prefix string
	// Text is the whole prompt as it repeats across a session's turns, for cache_aware: a
	// completion's prompt, or a chat's messages array as the client sent it (its JSON
	// grows at the end turn after turn, as the rendered conversation does). Empty means
	// the cache-aware policies pick the least in flight and record nothing.
	Text string
	// Tokens are the prompt's token ids as the engines tokenize it (Router.Tokens), for
	// precise_cache_aware; nil means it scores the request by Text alone.
	Tokens []uint32
	// Model is the model the request names, as the engines serve it (an alias resolved):
	// only backends that serve it (Backend.Serves) are picked, and a request for a model
	// no backend serves waits for none. Empty means any backend.
	Model string
	// Exclude names backends not to pick, e.g. the ones a retry already tried.
	Exclude []string
	// Accept, when set, restricts the pick to backends whose engine it accepts: one request
	// never mixes engines that speak different protocols.
	Accept func(Engine) bool
	// Overcommit lets the pick go past max_inflight instead of waiting. It is for the
	// proxy's own release traffic (a one-token drain that makes a decoder pull and free a
	// prefiller's KV): that must never queue behind the load whose memory it frees.
	Overcommit bool
	// Class names the request's priority class, from the proxy's config (a closed set): the
	// class label of pdproxy_queue_wait_seconds. Empty shows as "none".
	Class string
	// Slack is how long the request may wait in the queue before nothing that arrives later
	// is served ahead of it: the queue serves the earliest deadline first, a waiter's
	// deadline being its arrival plus its Slack. Zero, the default for every request, makes
	// the queue first come, first served; a batch class with a Slack of seconds lets
	// interactive requests (Slack 0) overtake it for that long, and no longer, so none
	// starves.
	Slack time.Duration
}

// Result is what happened to the request sent under a lease. Its zero value means the
// lease was never used (e.g. a decoder reserved for a prefill that then failed): it
// counts nothing for the backend, neither a request nor a health signal.
type Result struct {
	// Status is the HTTP status the backend answered, 0 if none.
	Status int
	// Err is a connect or transport error talking to the backend.
	Err error
	// Canceled means the client went away; it takes precedence over Err and Status and
	// is never held against the backend.
	Canceled bool
}

// outcome turns a result into its metric code and whether it counts for passive health.
func (res Result) outcome() (code string, counted, failed bool) {
	switch {
	case res.Canceled:
		return "canceled", false, false
	case res.Err != nil:
		return "error", true, true
	case res.Status != 0:
		return fmtStatus(res.Status), true, res.Status >= 500
	}
	return "", false, false
}

// fmtStatus avoids strconv allocations for the common codes on the release path.
func fmtStatus(s int) string {
	switch s {
	case 200:
		return "200"
	case 400:
		return "400"
	case 429:
		return "429"
	case 500:
		return "500"
	case 502:
		return "502"
	case 503:
		return "503"
	}
	return fmt.Sprint(s)
}

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
	// staleAfter is kv_events.stale_after in force.
	staleAfter atomic.Pointer[time.Duration]
	// modelViews are Models' answers, current while their generation is modelGen's, which
	// forgetModels moves on.
	modelViews atomic.Pointer[modelViews]
	modelGen   atomic.Uint64
}

// kvStart is the KV event settings read once, at New.
type kvStart struct {
	listen               string
	blockSize, maxBlocks int
	replayTimeout        time.Duration
}

func kvStartOf(cfg Config) kvStart {
	kv := cfg.KVEvents
	return kvStart{listen: kv.Listen, blockSize: cfg.BlockSize, maxBlocks: kv.MaxBlocksPerBackend,
		replayTimeout: kv.ReplayTimeout}
}

type settings struct {
	health          HealthConfig
	ejection        EjectionConfig
	scrapeInterval  time.Duration
	tokenizeTimeout time.Duration
}

// New validates cfg (filling its defaults) and builds a router. It starts nothing: Run
// runs the active health checks. A nil logger logs nothing; a nil reg registers no
// metrics.
func New(cfg Config, logger *zap.Logger, reg prometheus.Registerer) (*Router, error) {
	if logger == nil {
		logger = zap.NewNop()
	}
	cfg.Backends = slices.Clone(cfg.Backends) // Validate writes defaults into it
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("router config: %w", err)
	}
	r := &Router{
		logger:   logger,
		now:      time.Now,
		reloaded: make(chan struct{}, 1),
	}
	r.prefill = &pool{role: RolePrefill, r: r}
	r.decode = &pool{role: RoleDecode, r: r}
	r.metrics = newMetrics(r)
	r.disc = newDiscovery(r)
	r.kvStart = kvStartOf(cfg)
	r.index = kvcache.NewIndex(cfg.KVEvents.MaxBlocksPerBackend, cfg.BlockSize)
	ev, err := kvcache.NewEvents(kvcache.EventsConfig{Listen: cfg.KVEvents.Listen, ReplayTimeout: cfg.KVEvents.ReplayTimeout},
		r.index, logger.Named("kv_events"), reg)
	if err != nil {
		return nil, err
	}
	r.events = ev
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

func (r *Router) pool(role Role) *pool {
	switch role {
	case RolePrefill:
		return r.prefill
	case RoleDecode:
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
// eligible backend is at max_inflight it waits in a bounded queue that serves the earliest
// deadline first (arrival plus h.Slack; first come, first served among equal Slacks). Errors:
// ErrNoBackend (no healthy backend of the role), ErrQueueFull, ErrQueueTimeout, or
// ctx.Err() as soon as ctx is done. The caller must Release the lease.
func (r *Router) Acquire(ctx context.Context, role Role, h Hint) (*Lease, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	p := r.pool(role)
	if p == nil {
		return nil, fmt.Errorf("role %q: %w", role, ErrNoBackend)
	}
	p.mu.Lock()
	if p.waiters.Len() > 0 {
		// A slot freed by an ejection ending or a check passing belongs to the
		// waiters first.
		p.dispatchLocked()
	}
	b, avail := p.pickLocked(h)
	if b != nil {
		l := p.leaseLocked(b)
		p.mu.Unlock()
		return l, nil
	}
	if !avail {
		p.mu.Unlock()
		return nil, ErrNoBackend
	}
	if p.waiters.Len() >= max(p.queueSize, 0) {
		p.mu.Unlock()
		r.metrics.queueRejected.WithLabelValues(string(role), "full").Inc()
		return nil, ErrQueueFull
	}
	start := time.Now()
	// The deadline is on the router's clock, which tests move.
	w := &waiter{h: h, ch: make(chan waitResult, 1), deadline: r.now().Add(max(h.Slack, 0))}
	p.enqueueLocked(w)
	timeout, depth := p.queueTimeout, p.waiters.Len()
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
	r.metrics.queueWait.WithLabelValues(string(role), class).Observe(time.Since(start).Seconds())
	if res.err != nil {
		r.metrics.queueRejected.WithLabelValues(string(role), reason(res.err)).Inc()
	}
	return res.lease, res.err
}

func reason(err error) string {
	switch {
	case errors.Is(err, ErrQueueTimeout):
		return "timeout"
	case errors.Is(err, ErrNoBackend):
		return "no_backend"
	}
	return "canceled"
}

// Has reports whether any backend of role is configured, healthy or not: a discover entry
// counts even while its name has no address.
func (r *Router) Has(role Role) bool {
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
		if b.Role == RoleDecode && b.available(now) {
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
func (r *Router) Available(role Role) []*Backend {
	now := r.now()
	var out []*Backend
	for _, b := range r.backends() {
		if b.Role == role && b.available(now) {
			out = append(out, b)
		}
	}
	return out
}

// Models returns every model a backend of role serves, sorted, each once (shared: the caller
// must not modify it), and whether that is all of them: false while a backend's models are
// unknown (its engine has not answered /v1/models yet), when a model absent from the list
// may still be served. A discover entry's configured models count even before its name
// resolves.
//
// Every request asks it: the answer is kept until a backend's models, the backends or the
// discover entries change (forgetModels).
func (r *Router) Models(role Role) (models []string, complete bool) {
	views := r.modelViews.Load()
	if gen := r.modelGen.Load(); views == nil || views.gen != gen {
		// Read the generation before the state: a change while this runs makes the next
		// call work it out again.
		views = &modelViews{gen: gen, v: [2]modelView{r.modelsOf(RolePrefill), r.modelsOf(RoleDecode)}}
		r.modelViews.Store(views)
	}
	if role == RoleDecode {
		return views.v[1].models, views.v[1].complete
	}
	return views.v[0].models, views.v[0].complete
}

// modelViews are Models' answers for prefill and decode, as of generation gen.
type modelViews struct {
	gen uint64
	v   [2]modelView
}

// modelView is what Models answers for one role.
type modelView struct {
	models   []string
	complete bool
}

// forgetModels makes the answers Models keeps stale, after what they were made of changed.
func (r *Router) forgetModels() { r.modelGen.Add(1) }

// modelsOf is Models, worked out.
func (r *Router) modelsOf(role Role) modelView {
	var models []string
	complete := true
	seen := map[string]bool{}
	for _, t := range r.disc.entryTemplates() {
		if t.Role != role {
			continue
		}
		for _, m := range t.Models {
			if !seen[m] {
				seen[m] = true
				models = append(models, m)
			}
		}
	}
	for _, b := range r.backends() {
		if b.Role != role || b.st.removed.Load() {
			continue
		}
		ms := b.Models()
		if ms == nil {
			complete = false
		}
		for _, m := range ms {
			if !seen[m] {
				seen[m] = true
				models = append(models, m)
			}
		}
	}
	slices.Sort(models)
	return modelView{models, complete}
}

// MinKVHoldTimeout is the smallest engine KV hold timeout among the backends of role,
// or 0 when there are none: a proxy hold longer than it would forward KV params that the
// engine may already have freed. A discover entry counts for the backends it may add.
func (r *Router) MinKVHoldTimeout(role Role) time.Duration {
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

// BackendStatus is one backend as shown by GET /debug/backends.
type BackendStatus struct {
	// Name is the backend's configured or derived name.
	Name string `json:"name"`
	// URL is the backend's base URL as configured.
	URL string `json:"url"`
	// Role is prefill or decode.
	Role Role `json:"role"`
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
	// Load is the engine's load as least_loaded last scraped it; absent until least_loaded
	// first scraped the backend.
	Load *LoadStatus `json:"load,omitempty"`
	// PrefixCache is what the proxy believes the engine's prefix cache holds; absent unless
	// its pool's policy is cache_aware or precise_cache_aware.
	PrefixCache *PrefixCacheStatus `json:"prefix_cache,omitempty"`
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
	rp := b.st.ranks.Load()
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
			Ranks:       b.rankStatus(),
			Models:      b.Models(),
		})
	}
	return out
}

// Reload switches to cfg without dropping requests in flight. A backend kept under the
// same name, URL and role keeps its in-flight count and health; a removed backend is no
// longer picked, its leases still release cleanly, and its metric series go away. A discover
// entry kept under the same name, URL and role keeps the addresses it last resolved to; a new
// one is resolved before Reload returns. An invalid cfg returns the error and leaves the
// router as it was.
func (r *Router) Reload(cfg Config) error {
	cfg.Backends = slices.Clone(cfg.Backends)
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("router config: %w", err)
	}
	return r.disc.install(cfg)
}

// apply installs a validated config.
func (r *Router) apply(cfg Config) error {
	if r.kvStart != kvStartOf(cfg) {
		return fmt.Errorf("router config: kv_events.listen, kv_events.max_blocks_per_backend, kv_events.replay_timeout and block_size are read at start; restart the proxy to change them")
	}
	pre, ok1 := r.newPolicy(cfg.PrefillPolicy, cfg, RolePrefill)
	dec, ok2 := r.newPolicy(cfg.DecodePolicy, cfg, RoleDecode)
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
		eng, _ := engineOf(cfg.Engines, bc.Engine)
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
	stale := cfg.KVEvents.StaleAfter
	r.staleAfter.Store(&stale)
	r.settings.Store(&settings{health: cfg.Health, ejection: cfg.Ejection, scrapeInterval: cfg.ScrapeInterval,
		tokenizeTimeout: cfg.TokenizeTimeout})

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
		policyName := cfg.DecodePolicy
		pol := dec
		if p.role == RolePrefill {
			policyName, pol = cfg.PrefillPolicy, pre
		}
		cache := cacheSettings{cfg.CacheAware, cfg.KVEvents.StaleAfter}
		if p.policy == nil || p.policyName != policyName || p.prefixTokens != cfg.PrefixTokens || p.cache != cache {
			p.policy, p.policyName, p.prefixTokens, p.cache = pol, policyName, cfg.PrefixTokens, cache
		}
		if w, ok := p.policy.(poolWatcher); ok {
			w.SetPool(mine)
		}
		p.backends = mine
		p.queueSize, p.queueTimeout = cfg.Queue.Size, cfg.Queue.Timeout
	}
	var removed []*Backend
	for _, b := range old {
		if !kept[b.st] {
			b.st.removed.Store(true)
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

// pool is the backends of one role, their policy and their wait queue.
type pool struct {
	role Role
	r    *Router

	mu           sync.Mutex
	backends     []*Backend
	policy       Policy
	policyName   string
	prefixTokens int
	cache        cacheSettings
	queueSize    int
	queueTimeout time.Duration
	waiters      list.List // of *waiter, earliest deadline first
	scratch      []*Backend
}

// cacheSettings are what a cache-aware policy is built with: a change rebuilds it.
type cacheSettings struct {
	CacheAwareConfig
	staleAfter time.Duration
}

type waiter struct {
	h    Hint
	ch   chan waitResult // buffered 1: the dispatcher never blocks
	elem *list.Element
	// deadline is when the waiter arrived plus its Hint's Slack: the queue's order.
	deadline time.Time
}

// enqueueLocked puts w after every waiter whose deadline is not later than its own: the
// earliest deadline first, and first come, first served among equal deadlines. A waiter is
// overtaken only by those that arrive before its deadline, so no class starves. The scan
// starts at the back, where a waiter of the most common class usually belongs.
func (p *pool) enqueueLocked(w *waiter) {
	for e := p.waiters.Back(); e != nil; e = e.Prev() {
		if !e.Value.(*waiter).deadline.After(w.deadline) {
			w.elem = p.waiters.InsertAfter(w, e)
			return
		}
	}
	w.elem = p.waiters.PushFront(w)
}

type waitResult struct {
	lease *Lease
	err   error
}

// pickLocked selects a backend for h. avail reports whether any backend could take h
// were it not full, which tells "wait" from "no backend".
func (p *pool) pickLocked(h Hint) (b *Backend, avail bool) {
	now := p.r.now()
	cands := p.scratch[:0]
	for _, b := range p.backends {
		if !b.available(now) || slices.Contains(h.Exclude, b.Name) || !b.Serves(h.Model) || h.Accept != nil && !h.Accept(b.Engine) {
			continue
		}
		avail = true
		if !b.full() || h.Overcommit {
			cands = append(cands, b)
		}
	}
	p.scratch = cands[:0]
	if len(cands) == 0 {
		return nil, avail
	}
	b = p.policy.Select(cands, h)
	if b == nil || !slices.Contains(cands, b) {
		b = cands[0] // a policy must pick a candidate; never let a bug pick a full one
	}
	clear(cands) // do not keep backends alive through the scratch slice
	return b, true
}

func (p *pool) leaseLocked(b *Backend) *Lease {
	b.st.inflight.Add(1)
	l := &Lease{b: b, p: p, rank: -1}
	if rp := b.st.ranks.Load(); rp != nil && len(*rp) > 1 {
		ranks := *rp
		// The rank with the fewest in flight; ties rotate, so that an idle engine's ranks
		// share the work too.
		n := len(ranks)
		start := int(b.st.rankNext.Add(1) % uint64(n))
		best := start
		for k := 1; k < n; k++ {
			if i := (start + k) % n; ranks[i].Load() < ranks[best].Load() {
				best = i
			}
		}
		ranks[best].Add(1)
		l.rank, l.rankCount = best, &ranks[best]
	}
	return l
}

// dispatchLocked hands free slots to waiters in queue order (earliest deadline first). A waiter that excludes the
// free backends does not block the ones behind it.
func (p *pool) dispatchLocked() {
	for e := p.waiters.Front(); e != nil; {
		next := e.Next()
		w := e.Value.(*waiter)
		b, avail := p.pickLocked(w.h)
		switch {
		case b != nil:
			p.waiters.Remove(e)
			w.elem = nil
			w.ch <- waitResult{lease: p.leaseLocked(b)}
		case !avail:
			// Every backend it could use went down while it waited: waiting longer
			// would only turn a clear 503 into a slow one.
			p.waiters.Remove(e)
			w.elem = nil
			w.ch <- waitResult{err: ErrNoBackend}
		case len(w.h.Exclude) == 0 && w.h.Model == "":
			// Everything is full; nobody behind can be served either. A waiter restricted
			// to some backends (by exclusion or model) says nothing about the others.
			return
		}
		e = next
	}
}

// leave takes w out of the queue after its ctx ended or its time ran out. If a
// dispatcher already served it, the result is waiting in w.ch: a lease is given back
// unused, and an error stands.
func (p *pool) leave(w *waiter, err error) waitResult {
	p.mu.Lock()
	if w.elem != nil { // still queued: w.elem is cleared under p.mu when served
		p.waiters.Remove(w.elem)
		w.elem = nil
		p.mu.Unlock()
		return waitResult{err: err}
	}
	p.mu.Unlock()
	res := <-w.ch
	if res.lease != nil {
		res.lease.Release(Result{})
		return waitResult{err: err}
	}
	return res
}

// kick dispatches waiters after a change that may free capacity outside a Release.
func (p *pool) kick() {
	p.mu.Lock()
	p.dispatchLocked()
	p.mu.Unlock()
}

// release ends one lease on b.
func (p *pool) release(b *Backend, code string) {
	p.mu.Lock()
	removed := b.st.removed.Load()
	if code != "" && !removed {
		p.r.metrics.requests.WithLabelValues(b.Name, string(b.Role), code).Inc()
	}
	left := b.st.inflight.Add(-1)
	p.dispatchLocked()
	p.mu.Unlock()
	if left < 0 {
		// Cannot happen: a lease decrements once after incrementing once. Say so
		// loudly rather than hide a broken invariant.
		p.r.logger.Error("backend in-flight count went negative", zap.String("backend", b.Name), zap.Int64("inflight", left))
	}
	if removed && left == 0 {
		b.closeIdle()
	}
}

// Lease is one in-flight request counted on a backend, from Acquire until Release.
type Lease struct {
	b        *Backend
	p        *pool
	released atomic.Bool
	// rank is the data-parallel rank the lease took, -1 for an engine of one rank;
	// rankCount its counter.
	rank      int
	rankCount *atomic.Int64
}

// Rank is the data-parallel rank the lease took on its backend; ok is false for an engine
// of one rank, whose calls name none.
func (l *Lease) Rank() (rank int, ok bool) {
	if l == nil || l.rank < 0 {
		return 0, false
	}
	return l.rank, true
}

// Backend is the backend the lease counts on.
func (l *Lease) Backend() *Backend {
	if l == nil {
		return nil
	}
	return l.b
}

// Release ends the lease. Only the first call counts; later calls, from any goroutine,
// do nothing, so a deferred Release may back up an explicit one. res feeds passive
// health: a connect error or a 5xx counts a failure, a success resets the streak, a
// client cancel or the zero Result counts nothing against the backend. A connection refused
// (or with no route) takes the backend out at once: see Router.refused.
func (l *Lease) Release(res Result) {
	if l == nil || !l.released.CompareAndSwap(false, true) {
		return
	}
	if l.rankCount != nil {
		l.rankCount.Add(-1)
	}
	r := l.p.r
	code, counted, failed := res.outcome()
	if counted {
		if ref, ok := refusalOf(res.Err); ok {
			r.refused(l.b, ref, res.Err)
		} else if d := l.b.observe(failed, r.now(), r.settings.Load().ejection); d > 0 {
			r.logger.Warn("backend ejected",
				zap.String("backend", l.b.Name), zap.String("role", string(l.b.Role)),
				zap.Duration("backoff", d), zap.Int64("ejections", l.b.Ejections()))
		}
	}
	l.p.release(l.b, code)
}

// CloseIdleConnections drops every backend's idle keep-alive connections. The pools refill on
// demand; this is for shutdown, and for tests that count goroutines after a run.
func (r *Router) CloseIdleConnections() {
	for _, b := range r.backends() {
		b.closeIdle()
	}
}
