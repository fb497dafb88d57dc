// Package engine owns how pdproxy talks to an inference engine in disaggregated
// prefill/decode mode: how a client's request is rewritten for the prefiller and the decoder
// (vLLM's NixlConnector protocol, which the simulated engine speaks too), and the prefill,
// decode and abort calls over HTTP.
package engine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

var (
	rawFalse = []byte("false")
	rawOne   = []byte("1")
	rawNull  = []byte("null")
	// prefillParams asks the prefiller to keep the KV for a remote decoder.
	prefillParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

	// What a prefill leaves out of the client's body (and sets itself, for the last ones): the
	// stream options and minimum token counts would fight max_tokens 1.
	prefillDrop     = []string{"stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params", "stream", "max_tokens"}
	prefillDropChat = append(prefillDrop[:len(prefillDrop):len(prefillDrop)], "max_completion_tokens")
	// A drain also leaves out what multiplies the work.
	drainDrop     = []string{"stream_options", "min_tokens", "min_completion_tokens", "n", "best_of", "logprobs", "top_logprobs", "kv_transfer_params", "stream", "max_tokens"}
	drainDropChat = append(drainDrop[:len(drainDrop):len(drainDrop)], "max_completion_tokens")
	decodeDrop    = []string{"kv_transfer_params"}
	// A Responses API prefill or drain bounds its output with max_output_tokens, and must
	// leave no state on the prefiller: store false, no background run.
	prefillDropResponses = []string{"stream_options", "kv_transfer_params", "stream", "max_output_tokens", "store", "background"}
	drainDropResponses   = append(prefillDropResponses[:len(prefillDropResponses):len(prefillDropResponses)], "top_logprobs", "include")
	// A token-in generate request (APIGenerate) bounds its output inside sampling_params:
	// the prefill or drain rewrites that object, and leaves out the minimum count there
	// (and, for a drain, what multiplies the work).
	generateDrop        = []string{"stream_options", "kv_transfer_params", "stream", "sampling_params"}
	prefillDropSampling = []string{"min_tokens", "max_tokens"}
	drainDropSampling   = []string{"min_tokens", "max_tokens", "n", "best_of", "logprobs"}
)

// oneTokenDrops are what a one-token rewrite (a prefill, a drain) leaves out of each API's
// body.
type oneTokenDrops struct {
	completions, chat, responses []string
	// sampling is what it leaves out of a generate request's sampling_params.
	sampling []string
}

var (
	prefillDrops = oneTokenDrops{completions: prefillDrop, chat: prefillDropChat, responses: prefillDropResponses, sampling: prefillDropSampling}
	drainDrops   = oneTokenDrops{completions: drainDrop, chat: drainDropChat, responses: drainDropResponses, sampling: drainDropSampling}
)

// API is the API a client's body is for, which says how a prefill or a drain bounds it to
// one token: each names its output bound its own way.
type API uint8

const (
	// APICompletions is POST /v1/completions: max_tokens.
	APICompletions API = iota
	// APIChat is POST /v1/chat/completions: max_tokens and max_completion_tokens.
	APIChat
	// APIResponses is POST /v1/responses: max_output_tokens, and store.
	APIResponses
	// APIMessages is Anthropic's POST /v1/messages: max_tokens alone (the API has no other
	// bound, and no stream options).
	APIMessages
	// APIGenerate is vLLM's token-in route, POST /inference/v1/generate: token_ids for a
	// prompt, max_tokens and min_tokens inside sampling_params, kv_transfer_params, stream and
	// stream_options at the top (vllm/entrypoints/serve/disagg/protocol.py, GenerateRequest).
	APIGenerate
)

// oneToken is the rewrite that bounds a prefill or a drain to one token, not streamed, on the
// API f is for, keeping the client's other members (less what drops names for the API).
func oneToken(f *Fields, api API, drops oneTokenDrops, params []byte) ([]byte, error) {
	switch api {
	case APIResponses:
		return f.rewrite(drops.responses, set{"kv_transfer_params", params}, set{"stream", rawFalse},
			set{"max_output_tokens", rawOne}, set{"store", rawFalse}), nil
	case APIChat:
		return f.rewrite(drops.chat, set{"kv_transfer_params", params}, set{"stream", rawFalse},
			set{"max_tokens", rawOne}, set{"max_completion_tokens", rawOne}), nil
	case APIGenerate:
		sampling, err := oneTokenSampling(f, drops.sampling)
		if err != nil {
			return nil, err
		}
		return f.rewrite(generateDrop, set{"kv_transfer_params", params}, set{"stream", rawFalse},
			set{"sampling_params", sampling}), nil
	}
	return f.rewrite(drops.completions, set{"kv_transfer_params", params}, set{"stream", rawFalse}, set{"max_tokens", rawOne}), nil
}

// oneTokenSampling is a generate request's sampling_params bounded to one token: the client's
// members less drop, then max_tokens 1; {"max_tokens":1} when it has none.
func oneTokenSampling(f *Fields, drop []string) ([]byte, error) {
	raw, ok := f.Field("sampling_params")
	if !ok || bytes.Equal(raw, rawNull) {
		return []byte(`{"max_tokens":1}`), nil
	}
	sp, err := ParseFields(raw)
	if err != nil {
		return nil, fmt.Errorf("sampling_params is not a JSON object: %w", err)
	}
	return sp.rewrite(drop, set{"max_tokens", rawOne}), nil
}

// PrefillBody rewrites a client's body for the prefiller: the KV is to be kept for a remote
// decode, one token, no stream, and no minimum token counts (they would fight max_tokens 1).
// Every other member is the client's, byte for byte. A Responses API body is bounded by
// max_output_tokens instead, and stores nothing on the prefiller; a generate body (APIGenerate)
// by its sampling_params' max_tokens, its min_tokens left out there.
func PrefillBody(f *Fields, api API) ([]byte, error) {
	return oneToken(f, api, prefillDrops, prefillParams)
}

// DecodeBody is the client's body as it came, plus the prefiller's kv_transfer_params passed
// on unchanged (they are opaque: their fields change between vLLM versions); a
// kv_transfer_params of the client's own never passes. With params nil the decoder recomputes
// the prompt itself, and the body usually is the client's, shared, not copied: the caller must
// not modify it. params that are not valid JSON are an error.
func DecodeBody(f *Fields, params json.RawMessage) ([]byte, error) {
	if params != nil && !json.Valid(params) {
		return nil, ErrBadKVParams
	}
	if f.dup || f.has("kv_transfer_params") {
		if params == nil {
			return f.rewrite(decodeDrop), nil
		}
		return f.rewrite(decodeDrop, set{"kv_transfer_params", params}), nil
	}
	if params == nil {
		return f.raw, nil
	}
	// The client's bytes up to its closing brace, then the params.
	end := bytes.LastIndexByte(f.raw, '}')
	out := make([]byte, 0, end+len(params)+len(`,"kv_transfer_params":}`))
	out = append(out, f.raw[:end]...)
	if len(f.members) > 0 {
		out = append(out, ',')
	}
	out = append(out, `"kv_transfer_params":`...)
	out = append(out, params...)
	return append(out, '}'), nil
}

// DrainBody is a decode whose only purpose is to make a decoder pull a held KV so that the
// prefiller frees it: the params, one token, no stream; its output is discarded.
func DrainBody(f *Fields, api API, params json.RawMessage) ([]byte, error) {
	if params == nil {
		params = rawNull
	} else if !json.Valid(params) {
		return nil, ErrBadKVParams
	}
	return oneToken(f, api, drainDrops, params)
}

// ErrBadKVParams means a prefiller answered with kv_transfer_params that are neither null nor
// a JSON object.
var ErrBadKVParams = errors.New("prefiller returned kv_transfer_params that are not an object")

// ParsePrefillResponse extracts the top-level kv_transfer_params from a prefiller's
// non-streaming answer. It returns nil when they are null or absent: the prefiller holds
// nothing for this request; likewise when their remote_block_ids name no block (vLLM holds
// nothing then, and a decoder handed empty ids may fail an assertion). The member is matched
// by its exact name, as the engine's own JSON reader does: "KV_Transfer_Params" is another
// field. The params are a copy: body may be reused afterwards.
func ParsePrefillResponse(body []byte) (json.RawMessage, error) {
	f, err := ParseFields(body)
	if err != nil {
		return nil, fmt.Errorf("prefiller answered with a body that is not a JSON object: %w", err)
	}
	kv, _ := f.Field("kv_transfer_params")
	if len(kv) == 0 || bytes.Equal(kv, rawNull) {
		return nil, nil
	}
	if kv[0] != '{' {
		return nil, ErrBadKVParams
	}
	if noBlocks(kv) {
		return nil, nil
	}
	return bytes.Clone(kv), nil
}

// noBlocks reports whether params carry a remote_block_ids that names no block: [] or a list
// of empty lists, one per KV cache group. Params without the field are taken as they are.
// A list that names no block is brackets, commas and spaces alone (the params are valid
// JSON): reading it byte by byte spares decoding a long prompt's thousands of ids.
func noBlocks(params json.RawMessage) bool {
	f, err := ParseFields(params)
	if err != nil {
		return false
	}
	ids, ok := f.Field("remote_block_ids")
	if !ok || len(ids) == 0 || ids[0] != '[' {
		return false
	}
	for _, c := range ids {
		switch c {
		case '[', ']', ',', ' ', '\t', '\r', '\n':
		default:
			return false
		}
	}
	return true
}
