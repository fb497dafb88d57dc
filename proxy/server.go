// Package proxy is pdproxy's HTTP front: the OpenAI- and Anthropic-compatible routes (their
// bodies and errors are package api's), client keys and connections, limits, sessions,
// tenants and priority classes, model aliases and the live view. It admits and parses each
// request and hands it to the prefill/decode flow (package pdflow). Beyond the requests it
// keeps the clients' limits and sessions and a cache of the models the engines serve.
package proxy

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
)

// Router is what the proxy needs of the router (pdflow.Router).
type Router = pdflow.Router

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

// WithSharedState makes the per_key limits and the sessions' bindings hold across replicas
// through st. Without either configured it changes nothing.
func WithSharedState(st SharedState) Option {
	return func(s *Server) { s.shared = st }
}

// CheckBackends checks a reload's backends against the sidecar mode, when it is on: the
// rules of SidecarEngine, and the decoder's engine kind unchanged (the prefillers' kind is set
// at start).
func (s *Server) CheckBackends(bs []router.BackendStatus) error {
	if s.sidecar == nil {
		return nil
	}
	eng, err := SidecarEngine(s.cfg, bs)
	if err != nil {
		return err
	}
	if eng.Kind() != s.sidecar.engine.Kind() {
		return fmt.Errorf("prefiller_header: the decode backend's engine changes from %s to %s, which takes a restart: the prefillers the header names are taken for it", s.sidecar.engine.Kind(), eng.Kind())
	}
	return nil
}
