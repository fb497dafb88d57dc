package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sync/errgroup"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
	"github.com/pdproxy/pdproxy/sim"
)

// Main is one running pdproxy: its simulated engines (if any), router, table and HTTP front.
type Main struct {
	cfg      Config
	logger   *zap.Logger
	Registry *prometheus.Registry

	sims   []*simProcess
	Router *router.Router
	Table  *lifecycle.Table
	Server *proxy.Server

	ln   net.Listener
	http *http.Server
	// adminLn and admin serve the profiler when Config.AdminListen is set; nil otherwise.
	adminLn net.Listener
	admin   *http.Server
	cancel  context.CancelFunc
	group   *errgroup.Group

	// reloadMu makes reloads one at a time.
	reloadMu sync.Mutex
	// holdTimeout is the proxy's forwarding deadline for KV params in force: kv_hold_timeout,
	// or its default derived from the prefillers at start. A reload does not change it.
	holdTimeout time.Duration
	// tracer exports the requests' traces; nil when tracing is off.
	tracer *sdktrace.TracerProvider
	// store is the shared state; nil without shared_state. Its goroutine runs in group; it
	// is closed once group is done.
	store *sharedstate.Store
}

// discoverBootstrapPorts asks the paired prefillers (SGLang) for their bootstrap ports. One
// that does not answer is logged and asked again by its first request.
func (m *Main) discoverBootstrapPorts(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := m.Server.DiscoverBootstrapPorts(ctx); err != nil {
		m.logger.Warn("bootstrap port discovery failed; asked again on first use", zap.Error(err))
	}
}

// holdMargin is the share of a prefiller's own hold the proxy may forward its params for.
const holdMarginNum, holdMarginDen = 2, 3

// defaultHoldTimeout is the forwarding deadline without a prefiller to derive it from: 2/3 of
// vLLM's lease.
const defaultHoldTimeout = 20 * time.Second

// maxHoldTimeout is the longest forwarding deadline a prefiller holding KV for hold allows.
func maxHoldTimeout(hold time.Duration) time.Duration {
	return hold * holdMarginNum / holdMarginDen
}

// simProcess is one in-process simulated engine with its own HTTP server.
type simProcess struct {
	cfg    SimConfig
	engine *sim.Engine
	ln     net.Listener
	srv    *http.Server
}

// URL is where the engine serves.
func (p *simProcess) URL() string { return "http://" + p.ln.Addr().String() }

// NewLogger builds the process logger for a format (json or console) and level.
func NewLogger(format, level string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("log_level: %w", err)
	}
	var zc zap.Config
	if format == "json" {
		zc = zap.NewProductionConfig()
	} else {
		zc = zap.NewDevelopmentConfig()
		zc.EncoderConfig.EncodeLevel = zapcore.CapitalColorLevelEncoder
		zc.DisableStacktrace = true
	}
	zc.Level = zap.NewAtomicLevelAt(lvl)
	zc.DisableCaller = true
	return zc.Build()
}

// New prepares a Main from a config; nothing listens until Start.
func New(cfg Config, logger *zap.Logger) (*Main, error) {
	cfg.setDefaults()
	m := &Main{cfg: cfg, logger: logger, Registry: prometheus.NewRegistry()}
	m.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m, nil
}

// Start starts the simulated engines, then the router, the table and the proxy's listener.
// The goroutines it starts stop on Shutdown.
func (m *Main) Start(ctx context.Context) error {
	if err := m.cfg.check(); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	m.cancel = cancel
	g, gctx := errgroup.WithContext(runCtx)
	m.group = g
	fail := func(err error) error {
		m.stopSims()
		cancel()
		g.Wait()
		m.closeStore()
		return err
	}

	rcfg := m.cfg.Router
	rcfg.Backends = append([]routerconfig.BackendConfig(nil), rcfg.Backends...)
	for i, sc := range m.cfg.Sims {
		p, err := m.startSim(gctx, g, i, sc)
		if err != nil {
			return fail(err)
		}
		rcfg.Backends = append(rcfg.Backends, simBackend(i, p))
	}
	if err := m.build(ctx, rcfg); err != nil {
		return fail(err)
	}
	m.discoverBootstrapPorts(ctx)
	g.Go(func() error { return m.Router.Run(gctx) })
	if m.store != nil {
		g.Go(func() error { return m.store.Run(gctx) })
	}

	if err := m.startAdmin(g); err != nil {
		return fail(err)
	}
	tlsConf, err := listenerTLS(m.cfg)
	if err != nil {
		m.stopAdmin()
		return fail(err)
	}
	ln, err := net.Listen("tcp", m.cfg.Listen)
	if err != nil {
		m.stopAdmin()
		return fail(fmt.Errorf("listen on %s: %w", m.cfg.Listen, err))
	}
	m.ln = ln
	ln = m.Server.Listener(ln, tlsConf != nil)
	// HTTP/2 without TLS (h2c, prior knowledge) next to HTTP/1.1: gRPC-style and HTTP/2-only
	// clients reach the proxy on the same port, many streams over one connection. HTTP/2 over
	// TLS is on too, for when the listener serves TLS.
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(true)
	protocols.SetUnencryptedHTTP2(true)
	m.http = &http.Server{
		Handler: m.Server.Handler(),
		// A client that trickles its headers must not hold a connection open for long.
		ReadHeaderTimeout: m.cfg.ReadHeaderTimeout,
		MaxHeaderBytes:    64 << 10,
		IdleTimeout:       120 * time.Second,
		ErrorLog:          zap.NewStdLog(m.logger.Named("http")),
		Protocols:         &protocols,
		TLSConfig:         tlsConf,
	}
	g.Go(func() error {
		var err error
		if tlsConf != nil {
			err = m.http.ServeTLS(ln, "", "") // the certificate is in TLSConfig already
		} else {
			err = m.http.Serve(ln)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("serve: %w", err)
		}
		return nil
	})
	m.logger.Info("proxy listening", zap.String("addr", ln.Addr().String()), zap.Bool("tls", tlsConf != nil),
		zap.Int("prefill_backends", countRole(rcfg.Backends, routerconfig.RolePrefill)),
		zap.Int("decode_backends", countRole(rcfg.Backends, routerconfig.RoleDecode)))
	return nil
}

// startAdmin starts the admin listener when one is configured; stopAdmin closes it.
func (m *Main) startAdmin(g *errgroup.Group) error {
	if m.cfg.AdminListen == "" {
		return nil
	}
	ln, err := net.Listen("tcp", m.cfg.AdminListen)
	if err != nil {
		return fmt.Errorf("admin: listen on %s: %w", m.cfg.AdminListen, err)
	}
	m.adminLn = ln
	m.admin = &http.Server{
		Handler:           adminHandler(),
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          zap.NewStdLog(m.logger.Named("admin")),
	}
	g.Go(func() error {
		if err := m.admin.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("admin serve: %w", err)
		}
		return nil
	})
	m.logger.Info("admin listening", zap.String("addr", ln.Addr().String()))
	return nil
}

// stopAdmin closes the admin listener and its connections at once: a profile being taken
// has nothing to drain.
func (m *Main) stopAdmin() {
	if m.admin != nil {
		m.admin.Close()
	}
}

func countRole(bs []routerconfig.BackendConfig, role routerconfig.Role) int {
	n := 0
	for _, b := range bs {
		if b.Role == role {
			n++
		}
	}
	return n
}

// build makes the router, table and server, and checks that the proxy's hold deadline is
// no longer than any prefiller's own (race R4 otherwise).
func (m *Main) build(ctx context.Context, rcfg routerconfig.Config) error {
	rcfg.Engines = EngineCatalog{}
	rcfg.Queue.TTFTBound, rcfg.Queue.ReservedSlots = m.cfg.Proxy.FlowControl.SaturationTTFT, m.cfg.Proxy.FlowControl.Slots()
	rcfg.SharedPlacements = m.cfg.SharedState.Enabled()
	if err := checkConditional(m.cfg.Proxy, rcfg); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	rcfg.EngineTokenizer = engine.Tokenizer{}
	local, err := LoadTokenizers(m.cfg.Proxy, rcfg)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	rcfg.LocalTokenizers = local
	rt, err := router.New(rcfg, m.logger.Named("router"), m.Registry)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	// The proxy tokenizes a model's requests itself only once an engine agrees with it on
	// the samples; one that disagrees refuses the start. A model no engine answers for yet
	// is checked by the router's Run at its first engine, its requests tokenized by the
	// engines until then.
	if err := rt.CheckTokenizers(ctx); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	m.holdTimeout = m.cfg.KVHoldTimeout
	min := rt.MinKVHoldTimeout(routerconfig.RolePrefill)
	// In llm-d's sidecar slot the prefillers come from a header, taken for the local
	// decoder's engine: their hold is that engine's.
	sidecarEngine, err := proxy.SidecarEngine(m.cfg.Proxy, rt.Backends())
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if sidecarEngine != nil {
		min = sidecarEngine.KVHoldTimeout()
	}
	if min > 0 {
		limit := maxHoldTimeout(min)
		if m.holdTimeout == 0 {
			m.holdTimeout = limit
		} else if m.holdTimeout > limit {
			return fmt.Errorf("config: kv_hold_timeout %s is more than 2/3 of a prefill backend's own kv hold (its lease) %s: a decoder could read blocks the prefiller already freed; at most %s",
				m.holdTimeout, min, limit)
		}
	}
	if m.holdTimeout == 0 {
		m.holdTimeout = defaultHoldTimeout
	}
	m.Router = rt
	m.Table = lifecycle.New(lifecycle.Config{KVHoldTimeout: m.holdTimeout}, m.logger.Named("lifecycle"), m.Registry)
	// The exporters and the SDK read the OTEL_* variables themselves, so this does too.
	tp, err := newTracerProvider(ctx, m.cfg.Tracing, os.Getenv)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	var opts []proxy.Option
	if tp != nil {
		m.tracer = tp
		opts = append(opts, proxy.WithTracerProvider(tp))
	}
	if m.cfg.SharedState.Enabled() {
		st, err := sharedstate.New(m.cfg.SharedState, m.logger.Named("sharedstate"), m.Registry)
		if err != nil {
			return fmt.Errorf("config: %w", err)
		}
		m.store = st
		opts = append(opts, proxy.WithSharedState(st))
		rt.ShareFlows(st) // the tenants' shares are global (flow control; nothing to share without it)
	}
	srv, err := proxy.New(m.cfg.Proxy, rt, m.Table, m.logger.Named("proxy"), m.Registry, m.Registry, opts...)
	if err != nil {
		if tp != nil {
			tp.Shutdown(context.WithoutCancel(ctx))
		}
		return fmt.Errorf("config: %w", err)
	}
	m.Server = srv
	return nil
}

func (m *Main) startSim(ctx context.Context, g *errgroup.Group, i int, sc SimConfig) (*simProcess, error) {
	// Unset fields keep the simulator's own defaults, as `proxy sim` flags do.
	cfg := sim.DefaultConfig()
	cfg.Role = sc.Role
	setIf(&cfg.Model, sc.Model)
	setIf(&cfg.KVBlocks, sc.KVBlocks)
	setIf(&cfg.BlockSize, sc.BlockSize)
	setIf(&cfg.PrefillTime, sc.PrefillTime)
	setIf(&cfg.PrefillPerToken, sc.PrefillPerToken)
	setIf(&cfg.ITL, sc.ITL)
	setIf(&cfg.MaxRunning, sc.MaxRunning)
	setIf(&cfg.MaxNumBatchedTokens, sc.MaxNumBatchedTokens)
	setIf(&cfg.KVHoldTimeout, sc.KVHoldTimeout)
	setIf(&cfg.KVTransferTime, sc.KVTransferTime)
	setIf(&cfg.Seed, sc.Seed)
	setIf(&cfg.Tokenizer, sc.Tokenizer)
	setIf(&cfg.Stall, sc.Stall)
	setIf(&cfg.FailStatus, sc.FailStatus)
	setIf(&cfg.CloseAfter, sc.CloseAfter)
	setIf(&cfg.SlowWrite, sc.SlowWrite)
	setIf(&cfg.TransferFail, sc.TransferFail)
	setIf(&cfg.Protocol, sc.Protocol)
	setIf(&cfg.BootstrapTimeout, sc.BootstrapTimeout)
	setIf(&cfg.WaitingTimeout, sc.WaitingTimeout)
	setIf(&cfg.DisconnectDelay, sc.DisconnectDelay)
	setIf(&cfg.AdminAPIKey, sc.AdminAPIKey)
	setIf(&cfg.SchedulingPolicy, sc.SchedulingPolicy)
	setIf(&cfg.LoRAModules, sc.LoRAModules)
	setIf(&cfg.EmbeddingDim, sc.EmbeddingDim)
	addr := sc.Listen
	if addr == "" {
		addr = DefaultSimListen
	}
	// Several sims share a host: each bootstrap server takes a free port, on the host the
	// engine listens on, which /server_info reports.
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("config: sims[%d].listen: %w", i, err)
	}
	if host == "" {
		host = "0.0.0.0" // every interface, as the engine's listener
	}
	cfg.BootstrapPort, cfg.BootstrapHost = 0, host
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("sims[%d]: listen on %s: %w", i, addr, err)
	}
	// After the listener: New binds an sglang prefiller's bootstrap port, which only Run
	// closes.
	logger := m.logger.Named(fmt.Sprintf("sim-%s-%d", sc.Role, i))
	eng, err := sim.New(cfg, logger)
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("config: sims[%d]: %w", i, err)
	}
	p := &simProcess{cfg: sc, engine: eng, ln: ln, srv: &http.Server{Handler: eng.Handler(), ReadHeaderTimeout: 10 * time.Second}}
	m.sims = append(m.sims, p)
	g.Go(func() error { return eng.Run(ctx) })
	g.Go(func() error {
		if err := p.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("sim serve: %w", err)
		}
		return nil
	})
	logger.Info("simulated engine listening", zap.String("role", sc.Role), zap.String("url", p.URL()))
	return p, nil
}

// setIf sets *dst to v unless v is the zero value (the field was not configured). A
// negative duration in the config means zero for the simulator.
func setIf[T comparable](dst *T, v T) {
	var zero T
	if v == zero {
		return
	}
	if d, ok := any(v).(time.Duration); ok && d < 0 {
		*dst = zero
		return
	}
	*dst = v
}

// simBackend is the router's entry for the i-th in-process engine: the same at startup and
// on every reload, so a reload keeps it with its state.
func simBackend(i int, p *simProcess) routerconfig.BackendConfig {
	return routerconfig.BackendConfig{
		Name: fmt.Sprintf("sim-%s-%d", p.cfg.Role, i), URL: p.URL(), Role: routerconfig.Role(p.cfg.Role),
		Engine: engineKind(p.cfg), MaxInflight: p.cfg.MaxInflight, KVHoldTimeout: p.cfg.KVHoldTimeout,
		AdminAPIKey: p.cfg.AdminAPIKey,
	}
}

func engineKind(sc SimConfig) string {
	switch {
	case sc.Engine != "":
		return sc.Engine
	case sc.Protocol == sim.ProtocolSGLang:
		return engine.KindSGLang
	}
	return engine.KindSim
}

// CloseIdleConnections empties the keep-alive pools toward the engines, and the engines' own
// pools toward each other. They refill on demand; tests call it before counting goroutines.
func (m *Main) CloseIdleConnections() {
	m.Router.CloseIdleConnections()
	m.Server.CloseIdleConnections()
	for _, p := range m.sims {
		p.engine.CloseIdleConnections()
	}
}

// Addr is the proxy's listening address (useful with port 0).
func (m *Main) Addr() string { return m.ln.Addr().String() }

// URL is the proxy's base URL.
func (m *Main) URL() string {
	// Not m.http.TLSConfig: the server fills it in itself, for HTTP/2, even without TLS.
	if m.cfg.TLSCertFile != "" {
		return "https://" + m.Addr()
	}
	return "http://" + m.Addr()
}

// AdminAddr is the admin listener's address, or "" when there is none.
func (m *Main) AdminAddr() string {
	if m.adminLn == nil {
		return ""
	}
	return m.adminLn.Addr().String()
}

// SimURLs lists the in-process simulated engines' URLs by role.
func (m *Main) SimURLs(role string) []string {
	var out []string
	for _, p := range m.sims {
		if p.cfg.Role == role {
			out = append(out, p.URL())
		}
	}
	return out
}

// StopSim closes the in-process engine serving at url at once, as if its machine went
// away: its listener and its connections close, so requests in flight on it break and new
// ones are refused. It is a hook for tests of failover; Shutdown stops the rest as usual.
func (m *Main) StopSim(url string) error {
	for _, p := range m.sims {
		if p.URL() == url {
			return p.srv.Close()
		}
	}
	return fmt.Errorf("no simulated engine serves at %s", url)
}

// Shutdown stops gracefully: /ready fails, no new connection is accepted, streams in flight
// may finish until the drain deadline (ShutdownTimeout, or ctx if sooner), then the rest are
// aborted through the lifecycle table so their KV is released; last the engines stop.
func (m *Main) Shutdown(ctx context.Context) error {
	if m.http == nil {
		return nil
	}
	m.Server.SetDraining()
	drainCtx, cancel := context.WithTimeout(ctx, m.cfg.ShutdownTimeout)
	err := m.http.Shutdown(drainCtx)
	cancel()
	if err != nil {
		n := m.Table.AbortAll()
		m.logger.Warn("drain deadline passed: aborting requests in flight", zap.Int("requests", n))
		// Aborted handlers return within moments; a short second wait lets them write their
		// logs and release what they hold before connections are cut.
		hard, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		if err := m.http.Shutdown(hard); err != nil {
			m.http.Close()
		}
		cancel()
	}
	// KV releases run in the background after a client leaves; they need the engines up.
	bgCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	if err := m.Server.Wait(bgCtx); err != nil {
		m.logger.Warn("kv releases still running at shutdown", zap.Error(err))
	}
	cancel()
	// A connection dialled under load and then left unused (the transport's dial race) is
	// new, not idle, to an engine's server, whose Shutdown would wait for it until its own
	// deadline: the clients let go of theirs first.
	m.Router.CloseIdleConnections()
	m.Server.CloseIdleConnections()
	for _, p := range m.sims {
		p.engine.CloseIdleConnections()
	}
	m.stopSims()
	m.stopAdmin()
	if m.tracer != nil {
		// The last requests' spans go out before the process ends.
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		if err := m.tracer.Shutdown(tctx); err != nil {
			m.logger.Warn("traces not all exported at shutdown", zap.Error(err))
		}
		cancel()
	}
	m.cancel()
	err = m.group.Wait()
	// After the group: the store's goroutine has sent the last releases.
	m.closeStore()
	return err
}

// closeStore closes the shared state's connections, if there is one.
func (m *Main) closeStore() {
	if m.store != nil {
		m.store.Close()
	}
}

func (m *Main) stopSims() {
	for _, p := range m.sims {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if err := p.srv.Shutdown(ctx); err != nil {
			p.srv.Close()
		}
		cancel()
	}
}
