package router

import (
	"math"
	"slices"
	"sync"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/prometheus/client_golang/prometheus"
)

// saturation is what an autoscaler and an operator read of the pools' load: each pool's
// saturation, its predicted time to first token, the prefill:decode ratio the backlogs ask
// for, and each tenant's queue. Everything but the waits is computed at scrape time from the
// pools themselves, so it cannot drift from them.
type saturation struct {
	r *Router

	flowWait *prometheus.HistogramVec

	poolSaturation *prometheus.Desc
	poolTTFT       *prometheus.Desc
	pdRatio        *prometheus.Desc
	flowDepth      *prometheus.Desc

	mu sync.Mutex
	// labels are the tenant labels seen: a closed set (Flow.Label), each shown until the
	// process ends, at 0 when nothing of it waits, so that a dashboard's series do not vanish.
	labels map[string]bool
}

func newSaturation(r *Router) *saturation {
	const ns = "pdproxy"
	return &saturation{
		r: r,
		flowWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "flow_queue_wait_seconds",
			Help:    "Time requests of a tenant waited in the wait queues (both roles) for a free backend, whatever the outcome, by tenant (a flow_control tenant's name, or default).",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"tenant"}),
		poolSaturation: prometheus.NewDesc(ns+"_pool_saturation",
			"The role's requests in flight and waiting over the max_inflight of its usable backends: 0 idle, 1 every backend at max_inflight, above 1 as the queue builds. With no usable backend, 1 plus the requests waiting.", []string{"role"}, nil),
		poolTTFT: prometheus.NewDesc(ns+"_pool_predicted_ttft_seconds",
			"The least predicted time to first token (the prefill's end) over the role's usable backends for a request of no tokens of its own: the work already ahead there at the learned rate, plus prefill_overhead. Only for a role placed by cost (cache_aware, precise_cache_aware).", []string{"role"}, nil),
		pdRatio: prometheus.NewDesc(ns+"_pd_ratio_recommended",
			"Prefillers per decoder that would put both roles at the same saturation with today's backlogs: (prefill saturation × prefillers) / (decode saturation × decoders). Only while both roles have backends and the decoders have load.", nil, nil),
		flowDepth: prometheus.NewDesc(ns+"_flow_queue_depth",
			"Requests of a tenant waiting in the wait queues now (both roles), by tenant (a flow_control tenant's name, or default).", []string{"tenant"}, nil),
		labels: make(map[string]bool),
	}
}

// Describe implements prometheus.Collector.
func (s *saturation) Describe(ch chan<- *prometheus.Desc) {
	s.flowWait.Describe(ch)
	ch <- s.poolSaturation
	ch <- s.poolTTFT
	ch <- s.pdRatio
	ch <- s.flowDepth
}

// Collect implements prometheus.Collector.
func (s *saturation) Collect(ch chan<- prometheus.Metric) {
	s.flowWait.Collect(ch)
	depth := make(map[string]int)
	var load [2]PoolLoad
	for i, p := range []*pool{s.r.prefill, s.r.decode} {
		load[i] = p.load(depth)
		if load[i].Backends == 0 {
			continue
		}
		ch <- prometheus.MustNewConstMetric(s.poolSaturation, prometheus.GaugeValue, load[i].Saturation(), string(p.role))
		if load[i].PredictedTTFT >= 0 {
			ch <- prometheus.MustNewConstMetric(s.poolTTFT, prometheus.GaugeValue, load[i].PredictedTTFT, string(p.role))
		}
	}
	if r, ok := RecommendedRatio(load[0], load[1]); ok {
		ch <- prometheus.MustNewConstMetric(s.pdRatio, prometheus.GaugeValue, r)
	}
	s.mu.Lock()
	for l := range depth {
		s.labels[l] = true
	}
	labels := make([]string, 0, len(s.labels))
	for l := range s.labels {
		labels = append(labels, l)
	}
	s.mu.Unlock()
	slices.Sort(labels)
	for _, l := range labels {
		ch <- prometheus.MustNewConstMetric(s.flowDepth, prometheus.GaugeValue, float64(depth[l]), l)
	}
}

// PoolLoad is one role's load now, as pdproxy_pool_saturation shows it.
type PoolLoad struct {
	// Backends is how many backends the role has, usable or not; Usable how many may take
	// requests now, and Capacity the sum of their max_inflight.
	Backends, Usable, Capacity int
	// Inflight is the requests in flight on the role's backends, Queued those waiting.
	Inflight, Queued int
	// PredictedTTFT is the least predicted time to first token over the usable backends, in
	// seconds; -1 when the role is not placed by cost.
	PredictedTTFT float64
	// TTFTBound is the pool's TTFT bound (Queue.TTFTBound) in seconds; 0 when it has none.
	TTFTBound float64
}

// Saturation is (in flight + waiting) / capacity: 0 idle, 1 full, above 1 as the queue
// builds; with no capacity, 1 plus the requests waiting. Under a TTFT bound, which saturates
// a pool as its slots do, it is at least the predicted TTFT over the bound, and 1 plus the
// waiting over capacity while requests wait, however many slots are free.
func (l PoolLoad) Saturation() float64 {
	if l.Capacity == 0 {
		return 1 + float64(l.Queued)
	}
	s := float64(l.Inflight+l.Queued) / float64(l.Capacity)
	if l.TTFTBound > 0 {
		s = max(s, l.PredictedTTFT/l.TTFTBound)
		if l.Queued > 0 {
			s = max(s, 1+float64(l.Queued)/float64(l.Capacity))
		}
	}
	return s
}

// RecommendedRatio is the prefillers per decoder that the backlogs ask for: the engines each
// role would need at saturation 1, prefill's over decode's. ok is false while either role has
// no backend or the decoders have no load.
func RecommendedRatio(prefill, decode PoolLoad) (ratio float64, ok bool) {
	if prefill.Backends == 0 || decode.Backends == 0 {
		return 0, false
	}
	d := decode.Saturation() * float64(decode.Backends)
	if d <= 0 {
		return 0, false
	}
	return prefill.Saturation() * float64(prefill.Backends) / d, true
}

// load reads the pool's load, adding its waiters to depth by their flow's label.
func (p *pool) load(depth map[string]int) PoolLoad {
	now := p.r.now()
	l := PoolLoad{PredictedTTFT: -1}
	p.mu.Lock()
	defer p.mu.Unlock()
	l.TTFTBound = p.ttftBound.Seconds()
	m := p.costModelLocked()
	for _, b := range p.backends {
		l.Backends++
		l.Inflight += int(b.Inflight())
		if !b.available(now) {
			continue
		}
		l.Usable++
		l.Capacity += b.MaxInflight
		if m != nil {
			if t := m.Seconds(b.workAhead(m, now)); l.PredictedTTFT < 0 || t < l.PredictedTTFT {
				l.PredictedTTFT = t
			}
		}
	}
	l.Queued = p.waiters.Len()
	for _, f := range p.waiters.active {
		if f.Label != "" {
			depth[f.Label] += f.waiters.Len()
		}
	}
	if math.IsNaN(l.PredictedTTFT) || math.IsInf(l.PredictedTTFT, 0) {
		l.PredictedTTFT = -1
	}
	return l
}

// Load is role's load now: what pdproxy_pool_saturation and pdproxy_pool_predicted_ttft_seconds
// show.
func (r *Router) Load(role routerconfig.Role) PoolLoad {
	p := r.pool(role)
	if p == nil {
		return PoolLoad{PredictedTTFT: -1}
	}
	return p.load(map[string]int{})
}
