// Package proxy is pdproxy's HTTP front: the OpenAI- and Anthropic-compatible routes (their
// bodies and errors are package api's), client keys and connections, limits, sessions,
// tenants and priority classes, model aliases and the live view. It admits and parses each
// request and hands it to the prefill/decode flow (package pdflow). Beyond the requests it
// keeps the clients' limits and sessions and a cache of the models the engines serve.
package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"golang.org/x/sync/singleflight"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
)

// Router is what the proxy needs of the router (pdflow.Router).
type Router = pdflow.Router

// Abort modes, release modes and pull modes: the values the config accepts (pdflow's).
const (
	AbortPrefillCancel         = pdflow.AbortPrefillCancel
	AbortPrefillFinishThenFree = pdflow.AbortPrefillFinishThenFree
	ReleaseDrain               = pdflow.ReleaseDrain
	ReleaseAbort               = pdflow.ReleaseAbort
	ReleaseWait                = pdflow.ReleaseWait
	PullAbortImmediate         = pdflow.PullAbortImmediate
	PullAbortAfterFirstToken   = pdflow.PullAbortAfterFirstToken
	ReserveBeforePrefill       = pdflow.ReserveBeforePrefill
	ReserveAfterPrefill        = pdflow.ReserveAfterPrefill
	PrefillUnavailableDecode   = pdflow.PrefillUnavailableDecode
	PrefillUnavailableFail     = pdflow.PrefillUnavailableFail
	// defaultModelsCacheFreshness is how long GET /v1/models answers from its cache.
	defaultModelsCacheFreshness = 5 * time.Second
)

// The defaults of the proxy's keys, each stated here once: a zero value in Config means the
// default the key's comment names.
const (
	DefaultMaxBodyBytes       = 10 << 20
	DefaultReadBodyTimeout    = 30 * time.Second
	DefaultMaxConnections     = 10000
	DefaultPhaseTimeout       = pdflow.DefaultPhaseTimeout
	DefaultClientWriteTimeout = 60 * time.Second
	DefaultPrefillRetries     = 1
	DefaultDecodeRetries      = 1
	DefaultMigrationMaxTokens = 65536
)

// Config tunes the HTTP front and the P/D flow. Zero values mean the defaults in brackets:
// named constants (DefaultMaxBodyBytes...), or a value where the default is no constant's.
type Config struct {
	// MaxBodyBytes bounds a request body; larger gets 413, at once when the request
	// announces its length. [DefaultMaxBodyBytes]
	MaxBodyBytes int64 `yaml:"max_body_bytes"`
	// ReadBodyTimeout bounds how long a client may take to send its request body, counted
	// from the end of its headers: a body that stalls is answered 408 in the OpenAI shape
	// and its connection (on HTTP/2, its stream) closed, so that it cannot hold a goroutine
	// and a connection for as long as it likes. [DefaultReadBodyTimeout]
	ReadBodyTimeout time.Duration `yaml:"read_body_timeout"`
	// MaxConnections bounds the client connections the proxy's listener holds at once: one
	// more is closed as soon as it is accepted (a reset), and counted in
	// pdproxy_connections_refused_total. [DefaultMaxConnections]; negative means no bound.
	MaxConnections int `yaml:"max_connections"`
	// AbortDuringPrefill: cancel (close the prefill connection at once) or finish_then_release
	// (let the prefill finish, then release its KV: for engines with no explicit abort). [cancel]
	AbortDuringPrefill string `yaml:"abort_during_prefill"`
	// KVRelease is how held KV is released when the client leaves before the decode was sent:
	// drain (a one-token decode that pulls it), abort (the engine's explicit abort where it
	// has one, else drain) or wait (leave it to the engine's timer). [drain]
	KVRelease string `yaml:"kv_release"`
	// AbortDuringKVPull: immediate, or after_first_token (defer a decode's cancel until its
	// first byte, for engines that crash on an abort during the KV pull, race R3). [immediate]
	AbortDuringKVPull string `yaml:"abort_during_kv_pull"`
	// DecoderReservation: before_prefill (a decoder slot is taken before the prefill starts, so
	// KV is never held while waiting for one) or after_prefill (the prefiller never waits
	// for a decoder, but a prefilled request may wait in kv_held). [before_prefill]
	DecoderReservation string `yaml:"decoder_reservation"`
	// PDUncachedTokenThreshold turns on conditional disaggregation: a request whose reserved
	// decoder already holds all but fewer than this many of its prompt's tokens (as the
	// decoder's KV events tell; precise_cache_aware's index) is served decode-only, counted in
	// pdproxy_decode_only_total{reason="cached"}. It needs decoder_reservation before_prefill
	// (refused otherwise) and a decoder whose KV events the proxy reads (cmd/proxy refuses a
	// config that reads none). [0: always disaggregate]
	PDUncachedTokenThreshold int `yaml:"pd_uncached_token_threshold"`
	// MigrationLimit is how many times a stream whose decoder fails after its first byte may
	// go on on another decoder, token-exact (migration.go, docs/engines.md). [0: never]
	MigrationLimit int `yaml:"migration_limit"`
	// MigrationMaxTokens bounds the token ids a stream keeps to go on elsewhere, its prompt's
	// and its answer's: a longer one is not migrated. [DefaultMigrationMaxTokens]
	MigrationMaxTokens int `yaml:"migration_max_tokens"`
	// PrefillTimeout bounds the prefill call. [DefaultPhaseTimeout]
	PrefillTimeout time.Duration `yaml:"prefill_timeout"`
	// DecodeFirstByteTimeout bounds the wait for a decode's first byte. [DefaultPhaseTimeout]
	DecodeFirstByteTimeout time.Duration `yaml:"decode_first_byte_timeout"`
	// DecodeIdleTimeout bounds the silence between two chunks of a decode. [DefaultPhaseTimeout]
	DecodeIdleTimeout time.Duration `yaml:"decode_idle_timeout"`
	// DrainTimeout bounds a drain-only decode (it runs after the client left, on its own
	// deadline). A drain cut while its decoder may be pulling the blocks is an abort during
	// the transfer, which engines handle worst (race R3), so by default it lasts as long as
	// the prefiller may hold them. [the prefiller's kv_hold_timeout: its lease]
	DrainTimeout time.Duration `yaml:"drain_timeout"`
	// ClientWriteTimeout bounds one write to the client: a client that stops reading its
	// stream is given up on after it, and everything it held is released. [DefaultClientWriteTimeout]
	ClientWriteTimeout time.Duration `yaml:"client_write_timeout"`
	// PrefillRetries is how many other prefillers a prefill that provably never started is
	// tried on. [DefaultPrefillRetries]; negative means none.
	PrefillRetries int `yaml:"prefill_retries"`
	// DecodeRetries is how many other decoders a decode whose connection could not be made
	// is tried on (only then did the decoder provably never start it). [DefaultDecodeRetries];
	// negative: none.
	DecodeRetries int `yaml:"decode_retries"`
	// DecodeOnlyFallback sends a request straight to a decoder when its prefill failed on
	// every prefiller it was tried on (or none could take it: busy, queue full). [true]
	DecodeOnlyFallback *bool `yaml:"decode_only_fallback"`
	// PrefillUnavailable is what a request does when the pool has no usable prefiller at all
	// (every one down, ejected or removed, or none serves its model): decode_only sends it
	// straight to a decoder, which computes the prompt itself; fail answers 503. Decoders of
	// paired engines (SGLang, Mooncake) cannot serve alone: their requests fail either way.
	// [decode_only when decode_only_fallback is on, else fail]
	PrefillUnavailable string `yaml:"prefill_unavailable"`
	// APIKeysFile is a file of client API keys, one a line; blank lines and # comments are
	// skipped. When it or APIKeysEnv is set, every route but AuthOpenPaths answers 401
	// unless the request carries "Authorization: Bearer <key>" with one of the keys, and
	// the client's Authorization is not passed on to backends. A file with no key is an
	// error. Empty means no file.
	APIKeysFile string `yaml:"api_keys_file"`
	// APIKeysEnv names an environment variable holding comma-separated client API keys,
	// added to those of APIKeysFile. An unset or empty variable is an error. Empty means
	// none.
	APIKeysEnv string `yaml:"api_keys_env"`
	// AuthOpenPaths are the exact paths served without a key when keys are configured.
	// [/health, /ready, /metrics]; an explicit empty list opens none.
	AuthOpenPaths []string `yaml:"auth_open_paths"`
	// PrefillerHeader turns on llm-d's sidecar slot: each request's prefiller is the
	// host:port this header names (llm-d's scheduler sends x-prefiller-host-port), if
	// PrefillerAllow covers it (else 403), and the decode goes to the config's one decode
	// backend; a request without it is decoded there alone. The header is never forwarded.
	// Empty, the default, means the mode is off and the header is ignored.
	PrefillerHeader string `yaml:"prefiller_header"`
	// PrefillerAllow lists the prefillers the header may name, required with PrefillerHeader:
	// CIDRs (any port), IP:port, or host:port patterns where a * matches within one DNS
	// label ("vllm-prefill-*.ns.svc:8000") and a port of * any port.
	PrefillerAllow []string `yaml:"prefiller_allow"`
	// ModelAliases map a model name clients use to the served model it stands for
	// ("chat: llama-3-70b"), or to several split by weight ("canary: [{model: v1, weight:
	// 90}, {model: v2, weight: 10}]"). The body's model is rewritten before it is sent and
	// the client's name put back in the answer; /v1/models lists every alias. An alias
	// shadows a served model of the same name, and may not name another alias. Empty means
	// none.
	ModelAliases map[string]Alias `yaml:"model_aliases"`
	// Limits are each client's limits (limits.go): concurrency and rate per API key, and
	// per tenant behind one. [none]
	Limits LimitsConfig `yaml:"limits"`
	// Priority maps requests to priority classes that order the wait queue when every
	// engine is full (priority.go). [none: first come, first served]
	Priority PriorityConfig `yaml:"priority"`
	// SessionAffinity sends a session's requests to one decoder and one prefiller, on every
	// replica (session.go). [off]
	SessionAffinity SessionAffinityConfig `yaml:"session_affinity"`
	// FlowControl shares the engines among tenants by weight while requests wait for them
	// (flowcontrol.go). [off]
	FlowControl FlowControlConfig `yaml:"flow_control"`
}

// Validate checks cfg as New would: every key of the proxy's section, its defaults filled in
// on a copy.
func (c Config) Validate() error {
	_, err := c.check()
	return err
}

// WithDefaults is cfg with its defaults filled in, as New runs with it; the error is
// Validate's.
func (c Config) WithDefaults() (Config, error) {
	_, err := c.check()
	return c, err
}

// check fills in c's defaults and checks every key of the proxy's section, in one place: its
// own keys, then each subsection's (limits, priority, session_affinity, flow_control), the
// sidecar slot's and the model aliases. It answers the sidecar slot's allowlist. The checks
// against other sections (CheckEngines, CheckFlowControl's queue) need the router's config,
// and are made where both are known.
func (c *Config) check() (allowlist, error) {
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.ReadBodyTimeout <= 0 {
		c.ReadBodyTimeout = DefaultReadBodyTimeout
	}
	if c.MaxConnections == 0 {
		c.MaxConnections = DefaultMaxConnections
	}
	if c.AbortDuringPrefill == "" {
		c.AbortDuringPrefill = AbortPrefillCancel
	}
	if c.KVRelease == "" {
		c.KVRelease = ReleaseDrain
	}
	if c.AbortDuringKVPull == "" {
		c.AbortDuringKVPull = PullAbortImmediate
	}
	for _, d := range []*time.Duration{&c.PrefillTimeout, &c.DecodeFirstByteTimeout, &c.DecodeIdleTimeout} {
		if *d <= 0 {
			*d = DefaultPhaseTimeout
		}
	}
	if c.ClientWriteTimeout <= 0 {
		c.ClientWriteTimeout = DefaultClientWriteTimeout
	}
	if c.PrefillRetries == 0 {
		c.PrefillRetries = DefaultPrefillRetries
	}
	if c.PrefillRetries < 0 {
		c.PrefillRetries = 0
	}
	if c.DecodeRetries == 0 {
		c.DecodeRetries = DefaultDecodeRetries
	}
	if c.DecodeRetries < 0 {
		c.DecodeRetries = 0
	}
	if c.DecodeOnlyFallback == nil {
		on := true
		c.DecodeOnlyFallback = &on
	}
	if c.DecoderReservation == "" {
		c.DecoderReservation = ReserveBeforePrefill
	}
	switch c.PrefillUnavailable {
	case "":
		c.PrefillUnavailable = PrefillUnavailableFail
		if *c.DecodeOnlyFallback {
			c.PrefillUnavailable = PrefillUnavailableDecode
		}
	case PrefillUnavailableDecode, PrefillUnavailableFail:
	default:
		return allowlist{}, fmt.Errorf("prefill_unavailable: %q is not one of decode_only, fail", c.PrefillUnavailable)
	}
	if c.MigrationLimit < 0 {
		return allowlist{}, fmt.Errorf("migration_limit: %d is negative", c.MigrationLimit)
	}
	if c.MigrationMaxTokens < 0 {
		return allowlist{}, fmt.Errorf("migration_max_tokens: %d is negative", c.MigrationMaxTokens)
	}
	if c.MigrationMaxTokens == 0 {
		c.MigrationMaxTokens = DefaultMigrationMaxTokens
	}
	if err := c.Limits.setDefaults(); err != nil {
		return allowlist{}, err
	}
	if err := c.Priority.setDefaults(); err != nil {
		return allowlist{}, err
	}
	if err := c.SessionAffinity.setDefaults(); err != nil {
		return allowlist{}, err
	}
	if err := CheckFlowControl(c, nil); err != nil {
		return allowlist{}, err
	}
	switch c.DecoderReservation {
	case ReserveBeforePrefill, ReserveAfterPrefill:
	default:
		return allowlist{}, fmt.Errorf("decoder_reservation: %q is not one of before_prefill, after_prefill", c.DecoderReservation)
	}
	if c.PDUncachedTokenThreshold > 0 && c.DecoderReservation == ReserveAfterPrefill {
		// Whose cache would be weighed is known only once a decoder is reserved.
		return allowlist{}, fmt.Errorf("pd_uncached_token_threshold: needs decoder_reservation before_prefill, so that the decoder is known before its prefill is skipped")
	}
	switch c.AbortDuringPrefill {
	case AbortPrefillCancel, AbortPrefillFinishThenFree:
	default:
		return allowlist{}, fmt.Errorf("abort_during_prefill: %q is not one of cancel, finish_then_release", c.AbortDuringPrefill)
	}
	switch c.KVRelease {
	case ReleaseDrain, ReleaseAbort, ReleaseWait:
	default:
		return allowlist{}, fmt.Errorf("kv_release: %q is not one of drain, abort, wait", c.KVRelease)
	}
	switch c.AbortDuringKVPull {
	case PullAbortImmediate, PullAbortAfterFirstToken:
	default:
		return allowlist{}, fmt.Errorf("abort_during_kv_pull: %q is not one of immediate, after_first_token", c.AbortDuringKVPull)
	}
	allow, err := c.validateSidecar()
	if err != nil {
		return allowlist{}, err
	}
	return allow, validateAliases(c.ModelAliases)
}

// Server serves the OpenAI-compatible API in front of the router's pools.
type Server struct {
	cfg     Config
	router  Router
	table   *lifecycle.Table
	logger  *zap.Logger
	m       *pdflow.Metrics
	gather  prometheus.Gatherer
	handler http.Handler

	draining atomic.Bool
	// flow serves the requests across the engines.
	flow *pdflow.Flow

	models modelCache
	// keys are the client API keys; nil means none are required.
	keys *keyring
	// sidecar is llm-d's sidecar slot (prefiller_header); nil when it is off.
	sidecar *sidecar
	// aliases pick each model alias's served model.
	aliases map[string]*aliasPicker
	// lim admits requests by their client's limits and counts them per key and class; nil
	// when neither limits nor priority classes are configured.
	lim *limiter
	// tenants finds each request's tenant (flow_control); nil when it is off.
	tenants *tenants
	// shared is the state across replicas (WithSharedState): the per_key limits and the
	// sessions' bindings; nil when each replica decides alone.
	shared SharedState
	// classes are the priority classes; nil when none are configured.
	classes *classes
}

// New builds a Server. reg receives the proxy's metrics; gather is served on /metrics (pass
// the same registry, as a prometheus.Gatherer).
func New(cfg Config, rt Router, table *lifecycle.Table, logger *zap.Logger, reg prometheus.Registerer, gather prometheus.Gatherer, opts ...Option) (*Server, error) {
	allow, err := cfg.check()
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, router: rt, table: table, logger: logger, m: pdflow.NewMetrics(reg), gather: gather}
	s.flow = pdflow.New(pdflow.Config{AbortDuringPrefill: cfg.AbortDuringPrefill, KVRelease: cfg.KVRelease,
		AbortDuringKVPull: cfg.AbortDuringKVPull, DecoderReservation: cfg.DecoderReservation,
		PDUncachedTokenThreshold: cfg.PDUncachedTokenThreshold, MigrationLimit: cfg.MigrationLimit,
		MigrationMaxTokens: cfg.MigrationMaxTokens, PrefillTimeout: cfg.PrefillTimeout,
		DecodeFirstByteTimeout: cfg.DecodeFirstByteTimeout, DecodeIdleTimeout: cfg.DecodeIdleTimeout,
		DrainTimeout: cfg.DrainTimeout, ClientWriteTimeout: cfg.ClientWriteTimeout, PrefillRetries: cfg.PrefillRetries,
		DecodeRetries: cfg.DecodeRetries, DecodeOnlyFallback: cfg.DecodeOnlyFallback, PrefillUnavailable: cfg.PrefillUnavailable},
		rt, table, logger, s.m, cfg.PrefillerHeader != "")
	for _, o := range opts {
		o(s)
	}
	s.models.fresh = defaultModelsCacheFreshness
	keys, err := loadKeyring(cfg)
	if err != nil {
		return nil, err
	}
	s.keys = keys
	if cfg.Limits.on() || len(cfg.Priority.Classes) > 0 {
		nkeys := 0
		if keys != nil {
			nkeys = len(keys.digests)
		}
		s.lim = newLimiter(cfg.Limits, nkeys)
		s.lim.shared = s.shared
		s.lim.sessionHeaders = cfg.SessionAffinity.Headers
	}
	s.classes = newClasses(cfg.Priority)
	if s.tenants, err = newTenants(cfg.FlowControl, keys); err != nil {
		return nil, err
	}
	s.aliases = make(map[string]*aliasPicker, len(cfg.ModelAliases))
	for name, a := range cfg.ModelAliases {
		s.aliases[name] = newAliasPicker(a)
	}
	if cfg.PrefillerHeader != "" {
		eng, err := SidecarEngine(cfg, rt.Backends())
		if err != nil {
			return nil, err
		}
		s.sidecar = &sidecar{header: http.CanonicalHeaderKey(cfg.PrefillerHeader), allow: allow, engine: eng,
			client: router.NewSharedClient(sidecarIdlePerHost, sidecarIdleTotal)}
	}
	s.handler = s.routes()
	return s, nil
}

// Handler is the proxy's HTTP handler.
func (s *Server) Handler() http.Handler { return s.handler }

// CloseIdleConnections drops the idle keep-alive connections to the prefillers that requests'
// headers named (the sidecar mode). They refill on demand; this is for shutdown, and for
// tests that count goroutines.
func (s *Server) CloseIdleConnections() {
	if s.sidecar != nil {
		s.sidecar.client.CloseIdleConnections()
	}
}

// SetDraining makes /ready fail (shutdown has begun) while requests in flight go on.
func (s *Server) SetDraining() { s.draining.Store(true) }

// Wait blocks until the work that outlives requests (KV releases, finishing prefills) is done
// or ctx ends.
func (s *Server) Wait(ctx context.Context) error { return s.flow.Wait(ctx) }

func (s *Server) routes() http.Handler {
	r := chi.NewRouter()
	r.NotFound(func(w http.ResponseWriter, _ *http.Request) {
		api.WriteError(w, api.NewError(api.KindNoRoute, "no such route"))
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, req *http.Request) {
		// A 405 must say which methods the route takes (RFC 9110, section 15.5.6); chi sets
		// Allow only in its own 405 handler. Every route here is a GET or a POST.
		var allow []string
		for _, m := range []string{http.MethodGet, http.MethodPost} {
			if r.Match(chi.NewRouteContext(), m, req.URL.Path) {
				allow = append(allow, m)
			}
		}
		w.Header().Set("Allow", strings.Join(allow, ", "))
		api.WriteError(w, api.NewError(api.KindMethodNotAllowed, "method not allowed on this route"))
	})
	// The model routes: each client's limits apply to them, not to probes, metrics and
	// inspection.
	r.Group(func(r chi.Router) {
		r.Use(s.limit)
		r.Post("/v1/completions", s.generate("/v1/completions", api.ParseCompletions))
		r.Post("/v1/chat/completions", s.generate("/v1/chat/completions", api.ParseChat))
		r.Post("/v1/responses", s.generate("/v1/responses", api.ParseResponses))
		r.Post(api.MessagesRoute, s.generate(api.MessagesRoute, api.ParseMessages))
		r.Post(api.GenerateRoute, s.generate(api.GenerateRoute, api.ParseGenerate))
		// The non-generation routes: one engine each, no P/D (passthrough.go).
		for _, p := range passthroughRoutes {
			r.Post(p.path, s.passthrough(p))
		}
	})
	r.Get("/v1/models", s.handleModels)
	r.Get("/health", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	r.Get("/ready", s.handleReady)
	r.Get("/debug/requests", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, http.StatusOK, s.table.Snapshot()) })
	r.Get("/debug/backends", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, http.StatusOK, s.router.Backends()) })
	r.Get("/debug/ui", s.handleLiveView)
	r.Get("/debug/ui/state", s.handleLiveState)
	if s.gather != nil {
		r.Method(http.MethodGet, "/metrics", promhttp.HandlerFor(s.gather, promhttp.HandlerOpts{}))
	}
	var h http.Handler = r
	if s.keys != nil {
		h = s.requireKey(r, r)
	}
	return api.AnthropicShape(s.bodyDeadline(h))
}

// bodyDeadline puts read_body_timeout on the body of every request that has one, whatever
// its route: net/http reads what a handler left of a body before it answers (to keep the
// connection), and that read must not wait on a stalled client either. The deadline ends
// with the body (see readBody). On HTTP/2 it is the stream's: its body read fails, the
// connection's other streams go on.
func (s *Server) bodyDeadline(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != 0 {
			// Not supported only by writers that are not net/http's (tests' recorders).
			_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(s.cfg.ReadBodyTimeout))
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) handleReady(w http.ResponseWriter, _ *http.Request) {
	switch {
	case s.draining.Load():
		api.WriteError(w, api.NewError(api.KindShutdown, "the proxy is shutting down"))
	case !s.router.Ready():
		api.WriteError(w, api.NewError(api.KindNoBackend, "no healthy decode backend"))
	default:
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		status, body = http.StatusInternalServerError, []byte(`{"error":{"message":"internal error","type":"internal_error","param":null,"code":"internal"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(body)
}

// modelCache keeps the merged model list of the decoders for a few seconds, and makes
// concurrent /v1/models calls share one round of backend calls.
type modelCache struct {
	fresh time.Duration
	group singleflight.Group
	mu    sync.Mutex
	at    time.Time
	body  []byte
}

var errNoModels = errors.New("no backend answered /v1/models")

// DiscoverBootstrapPorts asks every paired prefiller what its bootstrap server says, at start
// and on reload (Flow.DiscoverBootstrapPorts).
func (s *Server) DiscoverBootstrapPorts(ctx context.Context) error {
	return s.flow.DiscoverBootstrapPorts(ctx)
}

// Option is an optional part of a Server, given to New.
type Option func(*Server)

// WithTracerProvider traces every request: a server span that continues the client's
// traceparent and tracestate, with child spans for each engine call (the prefill, the decode,
// SGLang's two legs), a drain, an engine abort and a KV release; every engine call carries the
// trace on, so that an engine started with OpenTelemetry joins it. Without it nothing is
// traced, and tracing costs a nil check per step.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(s *Server) {
		if tp != nil {
			s.flow.Trace(tp)
		}
	}
}
