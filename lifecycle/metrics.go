package lifecycle

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	inflight        *prometheus.GaugeVec
	aborts          *prometheus.CounterVec
	releases        *prometheus.CounterVec
	handoffs        *prometheus.CounterVec
	held            prometheus.Gauge
	late            *prometheus.CounterVec
	expiredForwards prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "pdproxy", Name: "inflight_requests",
			Help: "Requests in flight through the proxy, by lifecycle state.",
		}, []string{"state"}),
		aborts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "aborts_total",
			Help: "Requests aborted because the client left, by the stage they were in.",
		}, []string{"stage"}),
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "kv_releases_total",
			Help: "KV holds on prefillers that ended, by how: decoded, drained, aborted, expired.",
		}, []string{"reason"}),
		handoffs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "kv_hold_handoffs_total",
			Help: "KV holds on prefillers that ended, by who frees the blocks: handed_over (a decoder acknowledged the decode: it pulls them, or tells the prefiller), released (the proxy freed them: a drain or the engine's abort), left_to_engine (nobody did: the prefiller's own lease will).",
		}, []string{"result"}),
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "pdproxy", Name: "kv_held_requests",
			Help: "Requests whose KV a prefiller holds for them and that no decoder has acknowledged yet (by answering the decode).",
		}),
		late: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "late_events_total",
			Help: "Events a request could not take (it had ended, was unknown, or was in a state the event does not apply to); each was a no-op.",
		}, []string{"event"}),
		expiredForwards: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "kv_hold_deadline_exceeded_total",
			Help: "Decodes sent without the prefiller's kv_transfer_params because the hold deadline had passed (the decoder recomputed).",
		}),
	}
	// Every state and reason series exists from the start, so a dashboard (or a test) sees 0,
	// not a missing series.
	for s := Received; s < Finished; s++ {
		m.inflight.WithLabelValues(s.String())
		m.aborts.WithLabelValues(s.String())
	}
	for _, r := range []ReleaseReason{ReleaseDecoded, ReleaseDrained, ReleaseAborted, ReleaseExpired} {
		m.releases.WithLabelValues(string(r))
		m.handoffs.WithLabelValues(r.handoff())
	}
	if reg != nil {
		reg.MustRegister(m.inflight, m.aborts, m.releases, m.handoffs, m.held, m.late, m.expiredForwards)
	}
	return m
}
