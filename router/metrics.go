package router

import (
	"math"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdproxy/pdproxy/kvcache"
)

// metrics are the router's Prometheus series. The per-backend gauges are read from the
// backends' atomics at scrape time, so they cannot drift from the real counts and a
// removed backend's series disappear with it.
type metrics struct {
	r *Router

	requests      *prometheus.CounterVec
	down          *prometheus.CounterVec
	queueWait     *prometheus.HistogramVec
	queueRejected *prometheus.CounterVec
	matchRatio    *prometheus.HistogramVec
	tierTokens    *prometheus.CounterVec
	// predictionError is each cost prediction's error against the time the prefill took.
	predictionError *prometheus.HistogramVec

	predictedTTFT *prometheus.Desc
	prefillRate   *prometheus.Desc

	inflight  *prometheus.Desc
	healthy   *prometheus.Desc
	ejections *prometheus.Desc
	waiting   *prometheus.Desc

	// sat is the pools' saturation and the tenants' queues (saturation.go).
	sat *saturation
}

func newMetrics(r *Router) *metrics {
	const ns = "pdproxy"
	backendLabels := []string{"backend", "role"}
	return &metrics{
		r:   r,
		sat: newSaturation(r),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "backend_requests_total",
			Help: "Requests sent to a backend by outcome: the HTTP status, \"error\" for connect or transport errors, \"canceled\" when the client went away.",
		}, []string{"backend", "role", "code"}),
		down: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "backend_down_total",
			Help: "Times a backend was taken out until its health check passes (or, with checks off, for the ejection back-off), by reason: connection_refused, host_unreachable or network_unreachable (a call or a check refused at connect), health_check (unhealthy_threshold failed checks).",
		}, []string{"backend", "role", "reason"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "queue_wait_seconds",
			Help:    "Time requests waited in the backpressure queue for a free backend, whatever the outcome, by role and priority class (none: no class configured).",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"role", "class"}),
		queueRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "queue_rejected_total",
			Help: "Requests that got no backend after queueing or could not queue, by reason: full, timeout, canceled, no_backend.",
		}, []string{"role", "reason"}),
		matchRatio: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "prefix_cache_match_ratio",
			Help:    "Share of the prompt (0 to 1) that the engine picked by cache_aware or precise_cache_aware was predicted to hold in its prefix cache, for picks scored by it (not those made because the pool was out of balance).",
			Buckets: []float64{0, .1, .2, .3, .4, .5, .6, .7, .8, .9, .95, 1},
		}, []string{"role", "policy"}),
		inflight: prometheus.NewDesc(ns+"_backend_inflight_requests",
			"Requests in flight on a backend (leases not yet released).", backendLabels, nil),
		healthy: prometheus.NewDesc(ns+"_backend_healthy",
			"1 when the backend is neither down (failed health checks, a refused connection) nor ejected, else 0.", backendLabels, nil),
		ejections: prometheus.NewDesc(ns+"_backend_ejections_total",
			"Times passive health ejected the backend.", backendLabels, nil),
		waiting: prometheus.NewDesc(ns+"_queue_waiting_requests",
			"Requests waiting in the backpressure queue now.", []string{"role"}, nil),
		predictionError: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "ttft_prediction_error_seconds",
			Help:    "For requests placed by cost (cache_aware, precise_cache_aware), the time their prefill took on the backend (to a prefill leg's answer or a stream's first byte) less the time predicted at the pick: negative when the backend was faster than predicted.",
			Buckets: []float64{-2, -1, -.5, -.25, -.1, -.05, -.025, -.01, 0, .01, .025, .05, .1, .25, .5, 1, 2},
		}, backendLabels),
		predictedTTFT: prometheus.NewDesc(ns+"_predicted_ttft_seconds",
			"The time to first token (the prefill's end) predicted for the latest request placed on the backend by cost: its uncached prompt tokens and the work ahead of it at the backend's learned rate, plus prefill_overhead.", backendLabels, nil),
		prefillRate: prometheus.NewDesc(ns+"_backend_prefill_tokens_per_second",
			"The backend's prefill rate as the proxy learned it from its prefills (uncached tokens and the work ahead of them against the time they took), for backends of a pool placing by cost once they served a prefill.", backendLabels, nil),
		tierTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "prefix_cache_matched_tokens_total",
			Help: "Prompt tokens that the engine picked by precise_cache_aware held as its KV events told, by the tier each block counted on (gpu, cpu, disk, other: a tier of its own in kv_events.tier_weights), for picks scored by it.",
		}, []string{"tier"}),
	}
}

// tierCounters are prefix_cache_matched_tokens_total's series, in CacheAware.countTiers'
// order.
func (m *metrics) tierCounters() *[4]prometheus.Counter {
	var out [4]prometheus.Counter
	for i, tier := range []string{kvcache.TierGPU, kvcache.TierCPU, kvcache.TierDisk, kvcache.TierOther} {
		out[i] = m.tierTokens.WithLabelValues(tier)
	}
	return &out
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.requests, m.down, m.queueWait, m.queueRejected, m.matchRatio, m.tierTokens, m.predictionError, m, newLoadCollector(m.r), m.sat} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// forget deletes a removed backend's series.
func (m *metrics) forget(b *Backend) {
	m.requests.DeletePartialMatch(prometheus.Labels{"backend": b.Name, "role": string(b.Role)})
	m.down.DeletePartialMatch(prometheus.Labels{"backend": b.Name, "role": string(b.Role)})
	m.predictionError.DeletePartialMatch(prometheus.Labels{"backend": b.Name, "role": string(b.Role)})
}

// Describe implements prometheus.Collector for the scrape-time gauges.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- m.inflight
	ch <- m.healthy
	ch <- m.ejections
	ch <- m.waiting
	ch <- m.predictedTTFT
	ch <- m.prefillRate
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	now := m.r.now()
	for _, b := range m.r.backends() {
		role := string(b.Role)
		healthy := 0.0
		if b.available(now) {
			healthy = 1
		}
		ch <- prometheus.MustNewConstMetric(m.inflight, prometheus.GaugeValue, float64(b.Inflight()), b.Name, role)
		ch <- prometheus.MustNewConstMetric(m.healthy, prometheus.GaugeValue, healthy, b.Name, role)
		ch <- prometheus.MustNewConstMetric(m.ejections, prometheus.CounterValue, float64(b.Ejections()), b.Name, role)
		if bits := b.st.cost.predictedTTFT.Load(); bits != 0 {
			ch <- prometheus.MustNewConstMetric(m.predictedTTFT, prometheus.GaugeValue, math.Float64frombits(bits), b.Name, role)
		}
		if s := b.st.cost.rate.SecondsPerToken(); s > 0 {
			ch <- prometheus.MustNewConstMetric(m.prefillRate, prometheus.GaugeValue, 1/s, b.Name, role)
		}
	}
	for _, p := range []*pool{m.r.prefill, m.r.decode} {
		p.mu.Lock()
		n := p.waiters.Len()
		p.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(m.waiting, prometheus.GaugeValue, float64(n), string(p.role))
	}
}
