// Package kvbackend owns how pdproxy talks to an inference engine in disaggregated
// prefill/decode mode: how a client's request is rewritten for the prefiller and the decoder
// (vLLM's NixlConnector protocol, which the simulated engine speaks too), and the prefill,
// decode and abort calls over HTTP.
package kvbackend

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// Engine kinds, as named in config.
const (
	KindVLLM = "vllm"
	KindSim  = "sim"
)

// HasAbort reports whether an engine kind has an explicit abort call that also frees a KV hold
// (SGLang-shaped POST /abort_request). vLLM has none outside its dev mode: closing the
// connection is its only abort, and its holds are freed by a decoder's notify or its timer.
func HasAbort(kind string) bool { return kind == KindSim || kind == "sglang" }

// Fields is a request body parsed once into its top-level fields, each kept as raw JSON, so
// fields the proxy does not know pass through untouched.
type Fields map[string]json.RawMessage

var (
	rawTrue  = json.RawMessage("true")
	rawFalse = json.RawMessage("false")
	rawOne   = json.RawMessage("1")
	// prefillParams asks the prefiller to keep the KV for a remote decoder.
	prefillParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)
)

// PrefillBody rewrites a client's body for the prefiller: the KV is to be kept for a remote
// decode, one token, no stream, and no minimum token counts (they would fight max_tokens 1).
func PrefillBody(f Fields, chat bool) ([]byte, error) {
	out := make(Fields, len(f)+2)
	for k, v := range f {
		switch k {
		case "stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params":
			continue
		}
		out[k] = v
	}
	out["kv_transfer_params"] = prefillParams
	out["stream"] = rawFalse
	out["max_tokens"] = rawOne
	if chat {
		out["max_completion_tokens"] = rawOne
	}
	return marshal(out)
}

// DecodeBody is the client's body as it came, plus the prefiller's kv_transfer_params passed
// on unchanged (they are opaque: their fields change between vLLM versions). With params nil
// the decoder recomputes the prompt itself.
func DecodeBody(f Fields, params json.RawMessage) ([]byte, error) {
	out := make(Fields, len(f)+1)
	for k, v := range f {
		if k == "kv_transfer_params" {
			continue
		}
		out[k] = v
	}
	if params != nil {
		out["kv_transfer_params"] = params
	}
	return marshal(out)
}

// DrainBody is a decode whose only purpose is to make a decoder pull a held KV so that the
// prefiller frees it: the params, one token, no stream; its output is discarded.
func DrainBody(f Fields, chat bool, params json.RawMessage) ([]byte, error) {
	out := make(Fields, len(f)+2)
	for k, v := range f {
		switch k {
		case "stream_options", "min_tokens", "min_completion_tokens", "n", "best_of", "logprobs", "top_logprobs":
			continue
		}
		out[k] = v
	}
	out["kv_transfer_params"] = params
	out["stream"] = rawFalse
	out["max_tokens"] = rawOne
	if chat {
		out["max_completion_tokens"] = rawOne
	}
	return marshal(out)
}

func marshal(f Fields) ([]byte, error) {
	var buf bytes.Buffer
	buf.Grow(256)
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(map[string]json.RawMessage(f)); err != nil {
		return nil, fmt.Errorf("encode request body: %w", err)
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}

// ErrBadKVParams means a prefiller answered with kv_transfer_params that are neither null nor
// a JSON object.
var ErrBadKVParams = errors.New("prefiller returned kv_transfer_params that are not an object")

// ParsePrefillResponse extracts the top-level kv_transfer_params from a prefiller's
// non-streaming answer. It returns nil when they are null or absent: the prefiller holds
// nothing for this request.
func ParsePrefillResponse(body []byte) (json.RawMessage, error) {
	var resp struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(body, &resp); err != nil {
		return nil, fmt.Errorf("prefiller answered with a body that is not JSON: %w", err)
	}
	kv := bytes.TrimSpace(resp.KV)
	if len(kv) == 0 || bytes.Equal(kv, []byte("null")) {
		return nil, nil
	}
	if kv[0] != '{' {
		return nil, ErrBadKVParams
	}
	return kv, nil
}
