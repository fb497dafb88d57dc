package pdflow

import (
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Metrics are the proxy's request metrics, registered once: the front counts its answers,
// connections and limits in them, the flow its retries, releases and migrations.
type Metrics struct {
	Requests       *prometheus.CounterVec
	Duration       *prometheus.HistogramVec
	TTFT           *prometheus.HistogramVec
	Propagation    *prometheus.HistogramVec
	TokensAfter    prometheus.Counter
	Retries        *prometheus.CounterVec
	Fallbacks      prometheus.Counter
	DecodeOnly     *prometheus.CounterVec
	ReleaseFailure *prometheus.CounterVec
	ConnsOpen      prometheus.Gauge
	ConnsRefused   prometheus.Counter
	// PrefillerRefused counts requests refused for their prefiller header (sidecar mode).
	PrefillerRefused *prometheus.CounterVec
	Panics           prometheus.Counter
	// LimitRejected and KeyRequests count per client identity (the proxy's limits).
	LimitRejected *prometheus.CounterVec
	KeyRequests   *prometheus.CounterVec
	// Migrations, migrationRefusals and tokensReplayed count streams that left a failed
	// decoder (migration.go).
	Migrations        *prometheus.CounterVec
	MigrationRefusals *prometheus.CounterVec
	TokensReplayed    prometheus.Counter
	// SessionPicks counts the picks of requests that named a session (the proxy's session affinity).
	SessionPicks *prometheus.CounterVec
}

// latencyBuckets span a sub-millisecond proxy hop to a multi-minute generation.
var latencyBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}

// NewMetrics makes the metrics, registered with reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "requests_total",
			Help: "Requests answered, by route pattern, HTTP status (499: the client left) and the model the client named (an alias, a served model, or other).",
		}, []string{"route", "code", "model"}),
		Duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "pdproxy", Name: "request_duration_seconds",
			Help: "Time from a request's arrival to its last byte.", Buckets: latencyBuckets,
		}, []string{"route", "model"}),
		TTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "pdproxy", Name: "time_to_first_token_seconds",
			Help: "Time from a request's arrival to the first byte of its answer sent to the client.", Buckets: latencyBuckets,
		}, []string{"route", "model"}),
		Propagation: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "pdproxy", Name: "abort_propagation_seconds",
			Help:    "From the client's disconnect being seen to the backend call cancelled or the KV release sent, by stage.",
			Buckets: []float64{.00001, .00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"stage"}),
		TokensAfter: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "tokens_after_disconnect_total",
			Help: "Stream chunks a decoder produced after the client had left (read but not delivered).",
		}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "retries_total",
			Help: "Backend calls retried on another backend, by role and reason.",
		}, []string{"role", "reason"}),
		Fallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "fallbacks_total",
			Help: "Requests sent straight to a decoder because no prefiller could serve them.",
		}),
		DecodeOnly: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "decode_only_total",
			Help: "Requests sent to a decoder without a prefill because P/D cannot serve them safely, or, in the llm-d sidecar slot, because they named no prefiller, by reason (n, prompt_array, prompt_logprobs, no_prefiller_header), or because the decoder already held all but a few of the prompt's tokens (cached: conditional disaggregation).",
		}, []string{"reason"}),
		ReleaseFailure: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "kv_release_failures_total",
			Help: "KV releases that could not be done as configured and were left to the engine's timer, by attempted mode.",
		}, []string{"mode"}),
		ConnsOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "pdproxy", Name: "connections_open",
			Help: "Client connections the proxy's listener holds now.",
		}),
		ConnsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "connections_refused_total",
			Help: "Client connections closed as soon as they were accepted, because the listener held max_connections already.",
		}),
		PrefillerRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "prefiller_header_refused_total",
			Help: "Requests refused in the llm-d sidecar slot for the prefiller their header named, by reason: not_allowed (outside prefiller_allow, 403), malformed (not a host:port, 400).",
		}, []string{"reason"}),
		Panics: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "panics_total",
			Help: "Panics recovered while serving a request; the request was still finished (its KV released, its client answered).",
		}),
		LimitRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "limit_rejected_total",
			Help: "Requests refused with 429 by their client's limits before any engine was asked, by key (key- or ip- and 8 hex digits of its SHA-256; the first 64, or every configured key, then other), tenant (the tenant header's first 64 values, then other; empty without one) and reason: concurrency, rate, capacity (too many identities with requests in flight).",
		}, []string{"key", "tenant", "reason"}),
		KeyRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "key_requests_total",
			Help: "Requests let in by their client's limits, counted when they end, by key and tenant (as in pdproxy_limit_rejected_total) and priority class (none: no class, or refused before its class was known).",
		}, []string{"key", "tenant", "class"}),
		Migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "migrations_total",
			Help: "Streams whose decoder failed after their first byte, with migration_limit set, by why (decoder_failed, idle_timeout, error_event, drained: its decoder went away, removed or taken down by its checks) and outcome: migrated (they went on on another decoder), not_migratable (they could not go on exactly: pdproxy_migrations_refused_total says why), limit_reached.",
		}, []string{"reason", "outcome"}),
		MigrationRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "migrations_refused_total",
			Help: "Streams that could not go on exactly when their decoder failed, and failed as without migration, by reason: n, prompt_array, guided_decoding, logprobs, tools, penalties, stop, engine, too_long, no_token_ids, finished, no_tokens_left.",
		}, []string{"reason"}),
		TokensReplayed: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "migration_tokens_replayed_total",
			Help: "Generated tokens sent again, as prompt, to the engines a stream went on on.",
		}),
		SessionPicks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "session_affinity_total",
			Help: "Engines picked for requests that named a session (session_affinity), by role and outcome: kept (the engine the session was bound to), placed (no binding: where the session's key places it), yielded_unhealthy and yielded_load (the bound engine could not take it: down, ejected, gone, or over its bound).",
		}, []string{"role", "outcome"}),
	}
	for _, reason := range []string{moveDecoderFailed, moveIdleTimeout, moveErrorEvent, moveDrained} {
		for _, outcome := range []string{movedOn, moveRefused, moveExceeded} {
			m.Migrations.WithLabelValues(reason, outcome)
		}
	}
	if reg != nil {
		reg.MustRegister(m.Requests, m.Duration, m.TTFT, m.Propagation, m.TokensAfter, m.Retries, m.Fallbacks, m.DecodeOnly, m.ReleaseFailure,
			m.ConnsOpen, m.ConnsRefused, m.PrefillerRefused, m.Panics, m.LimitRejected, m.KeyRequests,
			m.Migrations, m.MigrationRefusals, m.TokensReplayed, m.SessionPicks)
	}
	return m
}

// MigrationTotals are the counts of pdproxy_migrations_total,
// pdproxy_migrations_refused_total and pdproxy_migration_tokens_replayed_total, read from the
// counters /metrics serves.
type MigrationTotals struct {
	// ByReason counts streams by why they left their decoder (decoder_failed, idle_timeout,
	// error_event, drained), then by outcome (migrated, not_migratable, limit_reached); every
	// reason and outcome is present, zero included.
	ByReason map[string]map[string]int64 `json:"by_reason"`
	// Refused counts the not_migratable ones by why they could not go on exactly (n,
	// logprobs, engine, ...): the reasons counted so far.
	Refused map[string]int64 `json:"refused"`
	// TokensReplayed is the number of generated tokens sent again, as prompt, to the
	// decoders streams went on on.
	TokensReplayed int64 `json:"tokens_replayed"`
}

// migrationTotals reads the migration counters.
func (m *Metrics) MigrationTotals() MigrationTotals {
	t := MigrationTotals{ByReason: map[string]map[string]int64{}, Refused: map[string]int64{}}
	counted(m.Migrations, func(labels map[string]string, n int64) {
		by := t.ByReason[labels["reason"]]
		if by == nil {
			by = map[string]int64{}
			t.ByReason[labels["reason"]] = by
		}
		by[labels["outcome"]] = n
	})
	counted(m.MigrationRefusals, func(labels map[string]string, n int64) { t.Refused[labels["reason"]] = n })
	counted(m.TokensReplayed, func(_ map[string]string, n int64) { t.TokensReplayed = n })
	return t
}

// counted calls f with the labels and value of each of c's counters.
func counted(c prometheus.Collector, f func(labels map[string]string, n int64)) {
	ch := make(chan prometheus.Metric)
	// Collect sends its series one by one and returns once it has sent them all.
	go func() {
		defer close(ch)
		c.Collect(ch)
	}()
	for pm := range ch {
		var d dto.Metric
		if pm.Write(&d) != nil || d.Counter == nil {
			continue
		}
		labels := make(map[string]string, len(d.Label))
		for _, l := range d.Label {
			labels[l.GetName()] = l.GetValue()
		}
		f(labels, int64(d.Counter.GetValue()))
	}
}
