package sharedstate

import "github.com/prometheus/client_golang/prometheus"

// metrics are a Store's, on the registry New is given.
type metrics struct {
	errors       *prometheus.CounterVec
	dropped      *prometheus.CounterVec
	up           prometheus.Gauge
	slots        prometheus.Gauge
	checkSeconds prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "shared_state_errors_total",
			Help: "Operations on the shared state that Redis did not take when they were made: failed, timed out, or skipped in the back-off after a failure (a check: one request decided on its replica's own state).",
		}, []string{"op"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "shared_state_dropped_total",
			Help: "Operations off the request path dropped because their queue was full (a release: the slot ends at its TTL).",
		}, []string{"op"}),
		up: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "pdproxy", Name: "shared_state_up",
			Help: "1 while the shared state's Redis answers, 0 while this replica backs off after a failure.",
		}),
		slots: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "pdproxy", Name: "shared_state_slots",
			Help: "Concurrency slots this replica holds for its requests in flight, refreshed in Redis until released.",
		}),
		checkSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "pdproxy", Name: "shared_state_check_duration_seconds",
			Help:    "Round trip of a request's check in Redis, for the checks Redis answered.",
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1},
		}),
	}
	for _, op := range []string{opCheck, opRelease, opBind, opRefresh, opPlacements, opPlace, opSent} {
		m.errors.WithLabelValues(op)
	}
	for _, op := range []string{opRelease, opBind, opPlace, opSent} {
		m.dropped.WithLabelValues(op)
	}
	reg.MustRegister(m.errors, m.dropped, m.up, m.slots, m.checkSeconds)
	return m
}
