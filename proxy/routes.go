package proxy

// New builds a Server from its config, and routes lays out its HTTP routes: the model routes
// behind each client's limits, the rest beside them, all behind the client's key and the
// body's deadline (middleware.go). /ready is answered here.

import (
	"net/http"
	"strings"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
)

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
	if s.shared != nil {
		s.flow.SharePlacements(s.shared)
	}
	s.models.fresh = defaultModelsCacheFreshness
	keys, err := loadKeyring(cfg.APIKeysFile, cfg.APIKeysEnv, cfg.AuthOpenPaths)
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
