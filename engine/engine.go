package engine

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"time"
)

// Engine is what every kind of inference engine has in P/D mode: a name, how long its
// prefillers hold KV on their own, and what a decoder's refusal means for the KV it was sent.
// What an engine can do beyond that is a capability it has or lacks, asked by type assertion
// (as net/http asks an http.ResponseWriter for http.Flusher): Sequential (a prefill, then a
// decode carrying the prefiller's params), Paired (both legs at once, paired by a bootstrap
// room) and Aborter (an explicit abort that also frees a KV hold). The proxy asks these
// questions of a backend's engine and never of a kind's name.
type Engine interface {
	// Kind is the engine's name in config ("vllm", "sim").
	Kind() string
	// KVHoldTimeout is how long a prefiller of this kind keeps a prefilled request's KV for a
	// decoder before freeing it on its own (its lease, or its timer); zero when it never does.
	KVHoldTimeout() time.Duration
	// RejectionFreesKV reports whether a decoder that refused a decode carrying params with
	// this status has told the prefiller to free them, so that nobody else may send them.
	RejectionFreesKV(status int) bool
}

// Sequential is an engine that serves a request as a prefill, then a decode that carries the
// prefiller's kv_transfer_params (vLLM's NixlConnector).
type Sequential interface {
	Engine
	// PrefillBody is the client's body rewritten for the prefiller.
	PrefillBody(f *Fields, api API) ([]byte, error)
	// DecodeBody is the client's body for the decoder, with the prefiller's params (nil: the
	// decoder computes the prompt itself).
	DecodeBody(f *Fields, params json.RawMessage) ([]byte, error)
	// DrainBody is a one-token decode whose only purpose is to make a decoder pull held KV.
	DrainBody(f *Fields, api API, params json.RawMessage) ([]byte, error)
	// ParsePrefill reads a prefiller's answer: the params it holds KV under, nil when it
	// holds nothing.
	ParsePrefill(body []byte) (json.RawMessage, error)
}

// MessagesByChat is an engine whose Anthropic Messages handler (POST /v1/messages) cannot
// take part in P/D (it drops the fields that pair the legs): a Messages request goes to it as
// the chat completion it stands for, and its answer is translated back.
type MessagesByChat interface {
	Engine
	MessagesByChat() bool
}

// TokensIn is an engine that serves vLLM's token-in route, POST /inference/v1/generate, under
// P/D as it serves a completion: kv_transfer_params at the top of the body and of the answer,
// the output bounded by the body's sampling_params. vLLM has it, with either connector; SGLang
// has no such route (its own /generate takes another body).
type TokensIn interface {
	Engine
	TokensIn() bool
}

// Aborter is an engine with an explicit abort call, which also frees a KV hold.
type Aborter interface {
	Engine
	// Abort asks the engine to abort request id, or free the KV it holds for it. An unknown
	// id is a no-op on the engine.
	Abort(ctx context.Context, client *http.Client, baseURL, id string) error
}

// Engine kinds, as named in config.
const (
	KindVLLM = "vllm"
	// KindVLLMLegacy is vLLM from before the KV lease (2025): a prefiller holds KV for
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s, with no heartbeats, and a decoder that refuses a
	// request in its serving layer tells nobody (before vLLM #41269).
	KindVLLMLegacy = "vllm-legacy"
	KindSim        = "sim"
)

// vllm is vLLM with its NixlConnector. It has no explicit abort outside its dev mode: closing
// the connection is its only abort, and its holds end on a decoder's notify or its timer.
type vllm struct {
	kind string
	hold time.Duration
}

// vllmLease is how long a vLLM prefiller holds a prefilled request's KV for a decoder:
// kv_lease_duration's default (vLLM PR #41383), which the decoder's heartbeats extend while it
// has the request. vllmLegacyHold is VLLM_NIXL_ABORT_REQUEST_TIMEOUT, from before the lease.
const (
	vllmLease      = 30 * time.Second
	vllmLegacyHold = 480 * time.Second
)

var (
	// VLLM is the vLLM NixlConnector engine.
	VLLM Sequential = vllm{kind: KindVLLM, hold: vllmLease}
	// VLLMLegacy is vLLM from before the KV lease.
	VLLMLegacy Sequential = legacy{vllm{kind: KindVLLMLegacy, hold: vllmLegacyHold}}
	// Sim is the simulated engine: today's vLLM, plus an explicit abort
	// (POST /abort_request) that also frees a hold.
	Sim Sequential = sim{vllm{kind: KindSim, hold: vllmLease}}
)

func (e vllm) Kind() string                 { return e.kind }
func (e vllm) KVHoldTimeout() time.Duration { return e.hold }
func (vllm) PrefillBody(f *Fields, api API) ([]byte, error) {
	return PrefillBody(f, api)
}
func (vllm) DecodeBody(f *Fields, params json.RawMessage) ([]byte, error) {
	return DecodeBody(f, params)
}
func (vllm) DrainBody(f *Fields, api API, params json.RawMessage) ([]byte, error) {
	return DrainBody(f, api, params)
}
func (vllm) ParsePrefill(body []byte) (json.RawMessage, error) { return ParsePrefillResponse(body) }
func (vllm) TokensIn() bool                                    { return true }

// RejectionFreesKV: a vLLM decoder whose serving layer refuses a request that carries params
// tells the prefiller to free them (vLLM #41269); so does one that aborts it before it was
// scheduled (#19223). Refusals before the handler (body validation) do not, but the proxy
// sends only bodies it validated, and a decoder acknowledges a decode only from its handler.
func (vllm) RejectionFreesKV(int) bool { return true }

// LoadMetrics names the series on vLLM's /metrics that the router reads (enginemetrics.LoadReporter):
// its load gauges, and its count of finished requests; the simulator reports the same.
func (vllm) LoadMetrics() (waiting, running, kvUsage, requests string) {
	return "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"
}

// CacheMetrics names the series on vLLM's /metrics that count the prompt tokens it looked up
// in its prefix cache and found there, and its KV pool's size (enginemetrics.CacheReporter);
// the simulator reports the same.
func (vllm) CacheMetrics() (prompt, cached, capacity string) {
	return "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info"
}

// legacy is vLLM before the lease and before #41269: a decoder that refuses a request tells
// the prefiller nothing.
type legacy struct{ vllm }

func (legacy) RejectionFreesKV(int) bool { return false }

// sim is the simulated engine: vLLM, plus SGLang's explicit abort.
type sim struct{ vllm }

func (sim) Abort(ctx context.Context, client *http.Client, baseURL, id string) error {
	return abortRequest(ctx, client, baseURL, id)
}

// Lookup returns the engine of kind; "" is vLLM, the default.
func Lookup(kind string) (Engine, bool) {
	switch kind {
	case "", KindVLLM:
		return VLLM, true
	case KindVLLMLegacy:
		return VLLMLegacy, true
	case KindSim:
		return Sim, true
	case KindSGLang:
		return SGLang, true
	case KindMooncake:
		return Mooncake, true
	}
	return nil, false
}

// Kinds lists the engine kinds Lookup knows, for error messages.
func Kinds() []string { return slices.Clone(kinds) }

var kinds = []string{KindVLLM, KindVLLMLegacy, KindSim, KindSGLang, KindMooncake}

// Interface guards.
var (
	_ Sequential = vllm{}
	_ Sequential = legacy{}
	_ Sequential = sim{}
	_ Aborter    = sim{}
	_ TokensIn   = vllm{}
)
