package proxy

// The llm-d sidecar slot (prefiller_header): llm-d runs its P/D proxy as a sidecar in each
// decode pod, in front of the local vLLM, and its scheduler names the prefiller for each
// request in a header (x-prefiller-host-port, "ip:port"). In this mode the proxy takes that
// place: the prefiller comes from the header, checked against prefiller_allow, and the
// decode goes to the one decoder of the config, the local engine. Without the mode the
// header is ignored and never forwarded (headers.go).

import (
	"fmt"
	"net/http"
	"strings"

	"go.uber.org/zap"
	"golang.org/x/net/http/httpguts"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
)

// sidecar is the mode's state; nil on a Server without it.
type sidecar struct {
	header string // canonical form of prefiller_header
	allow  allowlist
	// engine is what every prefiller a header names is taken for: the local decoder's engine
	// (llm-d pairs a decoder with prefillers of its own kind).
	engine engine.Engine
	// client carries the calls to every prefiller a header names. One transport for all of
	// them: it keeps a pool of idle connections per host:port, bounded per host and in all,
	// and closes one left idle, which is all a per-prefiller cache would hold; a header
	// cannot make the proxy keep anything per host beyond that.
	client *http.Client
}

// Bounds of the idle connections kept to the prefillers headers name.
const (
	sidecarIdlePerHost = 64
	sidecarIdleTotal   = 1024
)

// Reasons a prefiller header is refused, the label of pdproxy_prefiller_header_refused_total.
const (
	refusedNotAllowed = "not_allowed"
	refusedMalformed  = "malformed"
)

// validateSidecar checks prefiller_header and prefiller_allow, and returns the allowlist.
func (c *Config) validateSidecar() (allowlist, error) {
	if c.PrefillerHeader == "" {
		if len(c.PrefillerAllow) > 0 {
			return allowlist{}, fmt.Errorf("prefiller_allow: set without prefiller_header, so nothing reads it; set prefiller_header: x-prefiller-host-port for llm-d's sidecar slot, or remove it")
		}
		return allowlist{}, nil
	}
	if !httpguts.ValidHeaderFieldName(c.PrefillerHeader) {
		return allowlist{}, fmt.Errorf("prefiller_header: %q is not a header name", c.PrefillerHeader)
	}
	if len(c.PrefillerAllow) == 0 {
		return allowlist{}, fmt.Errorf("prefiller_allow: required with prefiller_header: without it any client could make the proxy call any host:port; list the prefillers' CIDRs or host:port patterns")
	}
	return parseAllowlist(c.PrefillerAllow)
}

// SidecarEngine checks that the backends suit the sidecar mode cfg turns on (prefiller_header):
// exactly one decode backend, the local engine, and no prefill backend (the header names the
// prefillers), with an engine that takes a prefill, then a decode. It returns the engine the
// prefillers are taken for, the decoder's; nil when the mode is off.
func SidecarEngine(cfg Config, bs []router.BackendStatus) (engine.Engine, error) {
	if cfg.PrefillerHeader == "" {
		return nil, nil
	}
	var decoders []router.BackendStatus
	var prefillers []string
	for _, b := range bs {
		switch b.Role {
		case router.RoleDecode:
			decoders = append(decoders, b)
		case router.RolePrefill:
			prefillers = append(prefillers, b.Name)
		}
	}
	if len(prefillers) > 0 {
		return nil, fmt.Errorf("prefiller_header: the prefillers come from the header, so the config may have no prefill backend (it has %s)", strings.Join(prefillers, ", "))
	}
	if len(decoders) != 1 {
		return nil, fmt.Errorf("prefiller_header: llm-d's sidecar slot takes exactly one decode backend, the engine beside it (the config has %d)", len(decoders))
	}
	eng, ok := engine.Lookup(decoders[0].Engine)
	if !ok {
		return nil, fmt.Errorf("prefiller_header: unknown engine %q of the decode backend", decoders[0].Engine)
	}
	if _, paired := eng.(engine.Paired); paired {
		return nil, fmt.Errorf("prefiller_header: the decode backend's engine %s sends a request to its prefiller and decoder at once; the sidecar slot runs a prefill, then a decode (vllm, vllm-legacy, sim)", eng.Kind())
	}
	return eng, nil
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

// namePrefiller reads the prefiller the request's header names, in the sidecar mode: x.named
// is its backend, nil when the request names none. A value that is no host:port is a 400, one
// the allowlist does not cover a 403; neither reaches an engine.
func (s *Server) namePrefiller(x *pdflow.Exchange) *api.Error {
	sc := s.sidecar
	values := x.R.Header.Values(sc.header)
	p, named, err := parsePrefillerHeader(values)
	if err != nil {
		s.refusePrefiller(x, refusedMalformed, values, err)
		return api.NewError(api.KindInvalidPrefiller, sc.header+" must name a prefiller as host:port: "+err.Error()).With(sc.header, err, 0)
	}
	if !named {
		return nil
	}
	if !sc.allow.allows(p) {
		s.refusePrefiller(x, refusedNotAllowed, values, nil)
		return api.NewError(api.KindPrefillerNotAllowed, "the prefiller "+sc.header+" names is not one this proxy may call (prefiller_allow)").With(sc.header, nil, 0)
	}
	b, err := router.NewDetached(router.BackendConfig{URL: "http://" + p.hostPort(), Role: router.RolePrefill}, sc.engine, sc.client)
	if err != nil {
		// parsePrefillerHeader let through only what makes a URL.
		return api.NewError(api.KindInternal, "could not address the prefiller").With("", err, 0)
	}
	x.Legs.Named = b
	return nil
}

func (s *Server) refusePrefiller(x *pdflow.Exchange, reason string, values []string, err error) {
	s.m.PrefillerRefused.WithLabelValues(reason).Inc()
	v := strings.Join(values, ", ")
	if len(v) > 256 {
		v = v[:256] + "..."
	}
	fields := []zap.Field{zap.String("request_id", x.ID), zap.String("reason", reason), zap.String("header", s.sidecar.header), zap.String("value", v)}
	if err != nil {
		fields = append(fields, zap.Error(err))
	}
	s.logger.Warn("prefiller header refused", fields...)
}
