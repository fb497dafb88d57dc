package proxy

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	requests       *prometheus.CounterVec
	duration       *prometheus.HistogramVec
	ttft           *prometheus.HistogramVec
	propagation    *prometheus.HistogramVec
	tokensAfter    prometheus.Counter
	retries        *prometheus.CounterVec
	fallbacks      prometheus.Counter
	decodeOnly     *prometheus.CounterVec
	releaseFailure *prometheus.CounterVec
	connsOpen      prometheus.Gauge
	connsRefused   prometheus.Counter
	// prefillerRefused counts requests refused for their prefiller header (sidecar mode).
	prefillerRefused *prometheus.CounterVec
	panics           prometheus.Counter
	// limitRejected and keyRequests count per client identity (limits.go).
	limitRejected *prometheus.CounterVec
	keyRequests   *prometheus.CounterVec
	// migrations, migrationRefusals and tokensReplayed count streams that left a failed
	// decoder (migration.go).
	migrations        *prometheus.CounterVec
	migrationRefusals *prometheus.CounterVec
	tokensReplayed    prometheus.Counter
	// sessionPicks counts the picks of requests that named a session (session.go).
	sessionPicks *prometheus.CounterVec
}

// latencyBuckets span a sub-millisecond proxy hop to a multi-minute generation.
var latencyBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "requests_total",
			Help: "Requests answered, by route pattern, HTTP status (499: the client left) and the model the client named (an alias, a served model, or other).",
		}, []string{"route", "code", "model"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "pdproxy", Name: "request_duration_seconds",
			Help: "Time from a request's arrival to its last byte.", Buckets: latencyBuckets,
		}, []string{"route", "model"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "pdproxy", Name: "time_to_first_token_seconds",
			Help: "Time from a request's arrival to the first byte of its answer sent to the client.", Buckets: latencyBuckets,
		}, []string{"route", "model"}),
		propagation: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "pdproxy", Name: "abort_propagation_seconds",
			Help:    "From the client's disconnect being seen to the backend call cancelled or the KV release sent, by stage.",
			Buckets: []float64{.00001, .00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"stage"}),
		tokensAfter: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "tokens_after_disconnect_total",
			Help: "Stream chunks a decoder produced after the client had left (read but not delivered).",
		}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "retries_total",
			Help: "Backend calls retried on another backend, by role and reason.",
		}, []string{"role", "reason"}),
		fallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "fallbacks_total",
			Help: "Requests sent straight to a decoder because no prefiller could serve them.",
		}),
		decodeOnly: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "decode_only_total",
			Help: "Requests sent to a decoder without a prefill because P/D cannot serve them safely, or, in the llm-d sidecar slot, because they named no prefiller, by reason (n, prompt_array, prompt_logprobs, no_prefiller_header), or because the decoder already held all but a few of the prompt's tokens (cached: conditional disaggregation).",
		}, []string{"reason"}),
		releaseFailure: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "kv_release_failures_total",
			Help: "KV releases that could not be done as configured and were left to the engine's timer, by attempted mode.",
		}, []string{"mode"}),
		connsOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "pdproxy", Name: "connections_open",
			Help: "Client connections the proxy's listener holds now.",
		}),
		connsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "connections_refused_total",
			Help: "Client connections closed as soon as they were accepted, because the listener held max_connections already.",
		}),
		prefillerRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "prefiller_header_refused_total",
			Help: "Requests refused in the llm-d sidecar slot for the prefiller their header named, by reason: not_allowed (outside prefiller_allow, 403), malformed (not a host:port, 400).",
		}, []string{"reason"}),
		panics: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "panics_total",
			Help: "Panics recovered while serving a request; the request was still finished (its KV released, its client answered).",
		}),
		limitRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "limit_rejected_total",
			Help: "Requests refused with 429 by their client's limits before any engine was asked, by key (key- or ip- and 8 hex digits of its SHA-256; the first 64, or every configured key, then other), tenant (the tenant header's first 64 values, then other; empty without one) and reason: concurrency, rate, capacity (too many identities with requests in flight).",
		}, []string{"key", "tenant", "reason"}),
		keyRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "key_requests_total",
			Help: "Requests let in by their client's limits, counted when they end, by key and tenant (as in pdproxy_limit_rejected_total) and priority class (none: no class, or refused before its class was known).",
		}, []string{"key", "tenant", "class"}),
		migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "migrations_total",
			Help: "Streams whose decoder failed after their first byte, with migration_limit set, by why (decoder_failed, idle_timeout, error_event, drained: its decoder went away, removed or taken down by its checks) and outcome: migrated (they went on on another decoder), not_migratable (they could not go on exactly: pdproxy_migrations_refused_total says why), limit_reached.",
		}, []string{"reason", "outcome"}),
		migrationRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "migrations_refused_total",
			Help: "Streams that could not go on exactly when their decoder failed, and failed as without migration, by reason: n, prompt_array, guided_decoding, logprobs, tools, penalties, stop, engine, too_long, no_token_ids, finished, no_tokens_left.",
		}, []string{"reason"}),
		tokensReplayed: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "migration_tokens_replayed_total",
			Help: "Generated tokens sent again, as prompt, to the engines a stream went on on.",
		}),
		sessionPicks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "pdproxy", Name: "session_affinity_total",
			Help: "Engines picked for requests that named a session (session_affinity), by role and outcome: kept (the engine the session was bound to), placed (no binding: where the session's key places it), yielded_unhealthy and yielded_load (the bound engine could not take it: down, ejected, gone, or over its bound).",
		}, []string{"role", "outcome"}),
	}
	for _, reason := range []string{moveDecoderFailed, moveIdleTimeout, moveErrorEvent, moveDrained} {
		for _, outcome := range []string{movedOn, moveRefused, moveExceeded} {
			m.migrations.WithLabelValues(reason, outcome)
		}
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.duration, m.ttft, m.propagation, m.tokensAfter, m.retries, m.fallbacks, m.decodeOnly, m.releaseFailure,
			m.connsOpen, m.connsRefused, m.prefillerRefused, m.panics, m.limitRejected, m.keyRequests,
			m.migrations, m.migrationRefusals, m.tokensReplayed, m.sessionPicks)
	}
	return m
}
