package proxy

// The llm-d sidecar slot (prefiller_header): llm-d runs its P/D proxy as a sidecar in each
// decode pod, in front of the local vLLM, and its scheduler names the prefiller for each
// request in a header (x-prefiller-host-port, "ip:port"). In this mode the proxy takes that
// place: the prefiller comes from the header, checked against prefiller_allow, and the
// decode goes to the one decoder of the config, the local engine. Without the mode the
// header is ignored and never forwarded (api.UpstreamHeader). Here are the mode's state and
// SidecarEngine; its keys are checked with the rest of Config's (validateSidecar, config.go),
// and a request's header is read in steps.go (namePrefiller).

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
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
		case routerconfig.RoleDecode:
			decoders = append(decoders, b)
		case routerconfig.RolePrefill:
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
