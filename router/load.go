package router

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/prometheus/client_golang/prometheus"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/router/costmodel"
	"github.com/pdproxy/pdproxy/router/enginemetrics"
)

// Routing on the load the engines report: the one load picture. Every proxy replica scrapes
// the same engines, so all replicas see the same load, their own requests and everyone
// else's, without talking to each other: what an engine reports needs no state shared
// between replicas. Between two scrapes a replica adds what it alone knows: the requests it
// sent the engine since the report and takes away those that ended since, never its whole
// in-flight count, which the report already holds. least_loaded picks by it; the cache-aware
// policies weigh their balance and their bounded loads by it, and sessions their bounds;
// where a pool scrapes nothing, it is the in-flight count alone.

// Load scraping parameters.
const (
	// staleScrapes intervals after the last good scrape, its figures are stale: the backend
	// is weighed by this replica's in-flight count alone. Three tolerate a slow or
	// lost scrape or two without flapping between the two ways of scoring.
	staleScrapes = 3
	// kvFullUsage is the KV usage (0 to 1) from which a prefiller is avoided: its pool is
	// mostly KV held for decoders, which its waiting and running counts do not show, and a
	// new prefill there would wait for blocks to be freed.
	kvFullUsage = 0.9
)

// engineLoad is one good scrape of an engine: the load it reported, and when.
type engineLoad struct {
	enginemetrics.Load
	// started is how many leases this replica had ever started on the backend when the answer
	// came, ended how many it had ended when the scrape was sent: a request started during the
	// scrape is taken as in the report (its figure is of the moment it answered), and so is
	// one that ended during it, which the engine may still have been running.
	started, ended int64
	// at is when the answer came; staleAt is at plus staleScrapes intervals (router clock).
	at, staleAt time.Time
	// peers is what the engine's count of the requests it served says of other clients.
	peers enginemetrics.Peers
}

// soleAfter is how long after its engine last showed a request this replica did not send (in
// its count of requests served, or waiting or running) a backend is shared: the cache-aware
// policies then place a new prompt by its rendezvous order alone, as every replica does, not
// by what this replica sent each engine (Backend.sole).
const soleAfter = 10 * time.Minute

// sole reports whether b's engine, by its fresh scrape, has served no request but this
// replica's for soleAfter (or since this replica first read its count): no other replica
// sends it work. An engine that does not count its requests is never sole.
func (b *Backend) sole(now time.Time) bool {
	l := b.st.load.last.Load()
	return l != nil && now.Before(l.staleAt) && l.peers.Sole(now, soleAfter)
}

// loadState is a backend's scraped load and its counters. It lives in backendState, so that
// a reload keeping the backend keeps them.
type loadState struct {
	last atomic.Pointer[engineLoad]
	// stale counts picks that scored the backend by in-flight alone; errors failed scrapes.
	stale, errors atomic.Int64
	// failing is set by a failed scrape and cleared by a good one: the change is logged once.
	failing atomic.Bool
	// turnover reads the engine's count of stored prompt tokens against its free KV pool.
	turnover costmodel.Turnover
}

// loadScore is b's load at now, the one load picture every policy that weighs load reads:
// the engine's waiting plus running requests at the last scrape, plus this replica's requests
// started on it since, minus those it ended since (they were in the report; the report holds
// everyone's, this replica's among them, so its whole in-flight count on top would count those
// twice), and never less than this replica's in-flight count there (a decoder reserved before
// its prefill runs nothing yet). fresh is false when there is no scrape newer than
// staleScrapes intervals, as in a pool whose policy scrapes nothing: the score is then the
// in-flight count alone. full is true for a prefiller whose fresh scrape shows its KV pool at
// least kvFullUsage used.
func (b *Backend) loadScore(now time.Time) (score int64, full, fresh bool) {
	n := b.Inflight()
	l := b.st.load.last.Load()
	if l == nil || !now.Before(l.staleAt) {
		return n, false, false
	}
	started := b.st.started.Load()
	startedSince, endedSince := started-l.started, started-n-l.ended
	score = max(l.Waiting+l.Running+startedSince-endedSince, n)
	return score, b.Role == routerconfig.RolePrefill && l.Usage >= kvFullUsage, true
}

// LeastLoaded picks the backend whose engine reports the least work (waiting plus running
// requests, from its /metrics, scraped every scrape_interval by Router.Run), corrected by this
// replica's own requests since the scrape. A prefiller whose KV pool is at least 90% used is
// avoided while another is not. A backend without a scrape newer than three intervals is
// scored by its in-flight count, as least_inflight would, and counted in
// pdproxy_backend_scrape_stale_total. Ties go to the higher weight, then rotate.
type LeastLoaded struct {
	next atomic.Uint64
	// now is the clock staleness is judged by; nil means time.Now. The router sets its own.
	now func() time.Time
}

var _ Policy = (*LeastLoaded)(nil)

// scored is a candidate's score for one pick.
type scored struct {
	score int64
	full  bool
}

// Select implements Policy.
func (p *LeastLoaded) Select(cands []*Backend, _ Hint) *Backend {
	if len(cands) == 0 {
		return nil
	}
	now := time.Now()
	if p.now != nil {
		now = p.now()
	}
	return leastLoadedOf(cands, now, &p.next, true)
}

// leastLoadedOf is the least loaded of cands at now, by Backend.loadScore: a prefiller whose KV
// pool is nearly full only if all are, ties to the higher weight, then in turn by next.
// countStale counts each candidate scored without a fresh scrape, for least_loaded's
// pdproxy_backend_scrape_stale_total.
func leastLoadedOf(cands []*Backend, now time.Time, next *atomic.Uint64, countStale bool) *Backend {
	if len(cands) == 0 {
		return nil
	}
	// Score each candidate once: the scores move under us (other pools' releases, a scrape),
	// and a stale one must be counted once per pick. Pools up to 16 score on the stack.
	var buf [candidatesOnStack]scored
	scores := buf[:0]
	for _, b := range cands {
		s, full, fresh := b.loadScore(now)
		if !fresh && countStale {
			b.st.load.stale.Add(1)
		}
		scores = append(scores, scored{s, full})
	}
	better := func(i, j int) bool { // is candidate i better than j?
		a, b := scores[i], scores[j]
		if a.full != b.full {
			return !a.full
		}
		if a.score != b.score {
			return a.score < b.score
		}
		return cands[i].Weight > cands[j].Weight
	}
	return cands[bestOf(len(cands), better, next)]
}

// bestOf is the best of n candidates as better ranks them (is i better than j?), ties taken
// in turn by next.
func bestOf(n int, better func(i, j int) bool, next *atomic.Uint64) int {
	best, ties := 0, 1
	for i := 1; i < n; i++ {
		switch {
		case better(i, best):
			best, ties = i, 1
		case !better(best, i):
			ties++
		}
	}
	k := int((next.Add(1) - 1) % uint64(ties))
	for i := range n {
		if !better(best, i) && !better(i, best) {
			if k == 0 {
				return i
			}
			k--
		}
	}
	return best
}

// scrapeLoop scrapes the engines of every pool whose policy weighs load, every
// scrape_interval, until ctx is done. Each round scrapes all of them at once, so that one slow
// engine does not delay the others' figures, and waits for them all.
func (r *Router) scrapeLoop(ctx context.Context) {
	timer := time.NewTimer(0) // the first round at once: the load is in-flight alone until then
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		timer.Reset(r.scrapeAll(ctx, r.settings.Load().scrapeInterval))
	}
}

// scrapeAll scrapes, once, every backend that may be picked in a pool whose policy weighs load,
// each read bounded by the interval it answers: interval, or where it is 0 (scrape_interval
// left out) routerconfig.AutoScrapeInterval of the engines scraped. A backend out of rotation
// is not scraped: nothing picks it, and a down engine would only count errors. One back in
// rotation is scored by in-flight until its next round.
func (r *Router) scrapeAll(ctx context.Context, interval time.Duration) time.Duration {
	now := r.now()
	var scraped []*Backend
	for _, p := range []*pool{r.prefill, r.decode} {
		p.mu.Lock()
		on := p.caps.ScrapesLoad
		backends := p.backends // replaced, never modified, by a reload
		p.mu.Unlock()
		for _, b := range backends {
			if on && b.available(now) {
				scraped = append(scraped, b)
			}
		}
	}
	if interval == 0 {
		interval = routerconfig.AutoScrapeInterval(len(scraped))
	}
	var wg sync.WaitGroup
	for _, b := range scraped {
		wg.Go(func() { r.scrape(ctx, b, interval) })
	}
	wg.Wait()
	return interval
}

// scrape reads b's load once and records it, or counts and logs the failure. The last good
// scrape stays in use until it is stale.
func (r *Router) scrape(ctx context.Context, b *Backend, interval time.Duration) {
	ended := b.st.started.Load() - b.Inflight()
	l, err := fetchLoad(ctx, b, interval)
	if ctx.Err() != nil {
		return // shutting down: a failed scrape says nothing about the engine
	}
	st := &b.st.load
	if err != nil {
		st.errors.Add(1)
		if st.failing.CompareAndSwap(false, true) {
			r.logger.Warn("backend load scrape failed; its load is weighed by in-flight requests once its last scrape is stale",
				zap.String("backend", b.Name), zap.String("role", string(b.Role)), zap.Error(err))
		} else if ce := r.logger.Check(zap.DebugLevel, "backend load scrape failed"); ce != nil {
			ce.Write(zap.String("backend", b.Name), zap.Error(err))
		}
		return
	}
	if st.failing.CompareAndSwap(true, false) {
		r.logger.Info("backend load scrape recovered", zap.String("backend", b.Name), zap.String("role", string(b.Role)))
	}
	now := r.now()
	l.started, l.ended = b.st.started.Load(), ended
	l.at, l.staleAt = now, now.Add(staleScrapes*interval)
	var before enginemetrics.Peers
	if prev := st.last.Load(); prev != nil {
		before = prev.peers
	}
	l.peers = before.Next(enginemetrics.Scrape{Load: l.Load, Started: l.started, Ended: l.ended}, now)
	free := l.KV.Capacity
	if l.Usage >= 0 {
		free *= 1 - min(l.Usage, 1)
	}
	st.turnover.Observe(now, l.KV.Stored, l.KV.Capacity, free)
	st.last.Store(l)
}

// fetchLoad is one GET {url}/metrics with the backend's own client (its key, its CA), bounded
// by one interval: a later answer would be overtaken by the next round anyway.
func fetchLoad(ctx context.Context, b *Backend, timeout time.Duration) (*engineLoad, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	l, err := enginemetrics.Fetch(ctx, b.client, b.URLString, enginemetrics.NamesOf(b.Engine))
	if err != nil {
		return nil, err
	}
	return &engineLoad{Load: l}, nil
}

// LoadStatus is a backend's load as the policies that weigh load see it, in GET
// /debug/backends.
type LoadStatus struct {
	// Waiting and Running are the engine's gauges at the last good scrape.
	Waiting int64 `json:"waiting"`
	Running int64 `json:"running"`
	// KVUsage is the engine's KV cache usage, 0 to 1, at the last good scrape; absent when
	// the engine does not report it.
	KVUsage *float64 `json:"kv_usage,omitempty"`
	// AgeSeconds is how long ago the last good scrape answered.
	AgeSeconds float64 `json:"age_seconds"`
	// Stale is true when the scrape is too old to be used: the backend is scored by its
	// in-flight count.
	Stale bool `json:"stale"`
	// Score is the load weighed now (Backend.loadScore; least_loaded picks the lowest).
	Score int64 `json:"score"`
	// KVFull is true for a prefiller avoided because its KV pool is nearly full.
	KVFull bool `json:"kv_full,omitempty"`
	// Alone is whether the engine has served no request but this replica's lately, by its
	// count of requests (Backend.sole); absent when it reports no count.
	Alone *bool `json:"alone,omitempty"`
}

// loadStatus is b's LoadStatus at now, nil before its first good scrape.
func (b *Backend) loadStatus(now time.Time) *LoadStatus {
	l := b.st.load.last.Load()
	if l == nil {
		return nil
	}
	score, full, fresh := b.loadScore(now)
	s := &LoadStatus{Waiting: l.Waiting, Running: l.Running, AgeSeconds: now.Sub(l.at).Seconds(),
		Stale: !fresh, Score: score, KVFull: full}
	if l.Usage >= 0 {
		u := l.Usage
		s.KVUsage = &u
	}
	if l.peers.Counted() {
		alone := b.sole(now)
		s.Alone = &alone
	}
	return s
}

// loadCollector exports the scrape counters and the KV turnover, read from the backends'
// atomics at scrape time like the other per-backend series, so a removed backend's go with it.
type loadCollector struct {
	r                       *Router
	stale, errors, turnover *prometheus.Desc
}

func newLoadCollector(r *Router) *loadCollector {
	labels := []string{"backend", "role"}
	return &loadCollector{
		r: r,
		stale: prometheus.NewDesc("pdproxy_backend_scrape_stale_total",
			"Picks by least_loaded that scored the backend by this replica's in-flight requests alone, because its last good /metrics scrape was older than 3 scrape_interval (or there was none yet).", labels, nil),
		errors: prometheus.NewDesc("pdproxy_backend_scrape_errors_total",
			"Failed scrapes of the backend's /metrics, for a policy that weighs load (least_loaded, cache_aware, precise_cache_aware): no answer within scrape_interval, a status other than 200, a body that is not the Prometheus text format, or without the engine's waiting and running gauges.", labels, nil),
		turnover: prometheus.NewDesc("pdproxy_backend_kv_turnover_seconds",
			"How long the engine took, by its scraped counters, to store as many prompt tokens as its KV pool has free (held by no request), to the latest scrape: text routed there longer ago, and not since, is evicted and no longer counted as cached there. Absent until the counters cover that many, and for an engine that does not report them.", labels, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *loadCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.stale
	ch <- c.errors
	ch <- c.turnover
}

// Collect implements prometheus.Collector.
func (c *loadCollector) Collect(ch chan<- prometheus.Metric) {
	for _, b := range c.r.backends() {
		role := string(b.Role)
		ch <- prometheus.MustNewConstMetric(c.stale, prometheus.CounterValue, float64(b.st.load.stale.Load()), b.Name, role)
		ch <- prometheus.MustNewConstMetric(c.errors, prometheus.CounterValue, float64(b.st.load.errors.Load()), b.Name, role)
		if d := b.st.load.turnover.Period(); d > 0 {
			ch <- prometheus.MustNewConstMetric(c.turnover, prometheus.GaugeValue, d.Seconds(), b.Name, role)
		}
	}
}
