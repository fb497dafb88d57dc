package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
)

// The OpenAI Responses API (POST /v1/responses), as vLLM serves it: one input (a string, or
// a list of items), instructions, max_output_tokens, and a stream of typed events
// ("event: response.output_text.delta") that ends with response.completed rather than
// [DONE]. It is served by the P/D flow of chat: the prefill bounded by max_output_tokens 1
// and storing nothing (engine), the decode carrying the prefiller's params, every abort,
// hold and release rule the same.

// parseResponses validates a Responses API body.
func parseResponses(body []byte) (*genRequest, *apiError) {
	req, e := parseGeneration(body)
	if e != nil {
		return nil, e
	}
	req.api = engine.APIResponses
	f := req.fields
	raw, ok := f.Field("input")
	if !ok || isNull(raw) {
		return nil, badRequest("input", "input is required")
	}
	var instructions string
	if e := stringField(f, "instructions", false, &instructions); e != nil {
		return nil, e
	}
	var s string
	switch {
	case raw[0] == '"' && decodeString(raw, &s) == nil:
		req.prefix = s
	default:
		var items []json.RawMessage
		if json.Unmarshal(raw, &items) != nil || len(items) == 0 {
			return nil, badRequest("input", "input must be a string or a non-empty array of input items")
		}
		for i, it := range items {
			if it[0] != '{' {
				return nil, badRequest(fmt.Sprintf("input[%d]", i), fmt.Sprintf("input[%d] must be an object", i))
			}
		}
		req.prefix = string(items[0])
	}
	if instructions != "" {
		req.prefix = instructions
	}
	// What repeats across a conversation's turns, for cache-aware routing: the instructions,
	// then the input as it grows.
	req.text = instructions + string(raw)
	req.key.media = messagesHaveMedia(raw)
	req.prompts = 1
	if _, _, e := countField(f, "max_output_tokens", 1); e != nil {
		return nil, e
	}
	if _, _, e := countField(f, "top_logprobs", 0); e != nil {
		return nil, e
	}
	for _, name := range []string{"temperature", "top_p", "repetition_penalty"} {
		if e := numberField(f, name); e != nil {
			return nil, e
		}
	}
	if _, _, e := countField(f, "top_k", -1); e != nil {
		return nil, e
	}
	var prev string
	if e := stringField(f, "previous_response_id", false, &prev); e != nil {
		return nil, e
	}
	if raw, ok := f.Field("previous_response_id"); ok && !isNull(raw) && prev == "" {
		// An engine would look the empty id up and answer 404, on whichever engine it is.
		return nil, badRequest("previous_response_id", "previous_response_id is empty: name an earlier response, or leave it out")
	}
	var background, store bool
	if e := boolField(f, "background", &background); e != nil {
		return nil, e
	}
	if e := boolField(f, "store", &store); e != nil {
		return nil, e
	}
	// vLLM's stateless multi-turn: previous_response carries the earlier response whole,
	// which both engines can read, so previous_response_id needs nothing stored. It keeps
	// nothing after the answer: a run in the background, or a response stored for later,
	// still needs an engine that keeps it.
	raw, whole := f.Field("previous_response")
	whole = whole && !isNull(raw)
	switch {
	case prev != "" && !whole:
		req.state = "previous_response_id"
	case background:
		req.state = "background"
	case store:
		req.state = "store"
	}
	return req, nil
}

// refuseState refuses, under P/D, a Responses request that needs state on one engine: an
// earlier response the engine stored (previous_response_id), a run it keeps after answering
// (background), or a response it is to store for later (store: true). Disaggregated serving
// puts a request on two engines and the next one on two others, so that state would be on an
// engine the next request may never reach. Without prefillers, the request goes to one
// engine and passes.
func (x *exchange) refuseState() *apiError {
	if x.req.state == "" || (x.s.sidecar == nil && !x.s.router.Has(router.RolePrefill)) {
		return nil
	}
	how := map[string]string{
		"previous_response_id": "send the conversation so far in input, or the earlier response whole in previous_response",
		"background":           "send it in the foreground (stream it to keep the connection busy)",
		"store":                "send store: false (or leave it out) and keep the response on the client",
	}[x.req.state]
	return newError(errUnsupportedParam, fmt.Sprintf("%s needs state kept on one engine, which disaggregated prefill/decode serving cannot promise; %s", x.req.state, how)).with(x.req.state, nil, 0)
}

// streamEnds are the event names that end a stream of api, whose streams have no [DONE]; nil
// for an API whose streams end with it.
func streamEnds(api engine.API) [][]byte {
	switch api {
	case engine.APIResponses:
		return responsesEnds
	case engine.APIMessages:
		return messagesEnds
	}
	return nil
}

// responsesEnds are the event names that end a Responses stream: it has no [DONE].
var responsesEnds = [][]byte{[]byte("response.completed"), []byte("response.incomplete"), []byte("response.failed")}

// sawEnd reports whether data, read after tail (the relay's last bytes of the stream before
// it), holds the event that ends a Responses stream: an SSE field line "event:" naming it,
// which starts a line and ends there. The same words inside a data line (generated text,
// JSON-escaped, so never on a line of their own) are no end. A line split across the two
// reads is looked for where they meet, so that no read is copied whole; the line and the
// line ends around it fit in tailSize.
func sawEnd(tail, data []byte, ends [][]byte) bool {
	edge := append(tail[:len(tail):len(tail)], data[:min(len(data), tailSize)]...)
	// The edge begins the stream when the tail is shorter than the relay keeps; data's own
	// first line is looked at in the edge, where the byte before it is.
	return endLine(data, false, ends) || endLine(edge, len(tail) < tailSize, ends)
}

// endLine reports whether p holds a line "event: <end>" (the space is optional in SSE) with
// its line end; atStart says whether p begins a line.
func endLine(p []byte, atStart bool, ends [][]byte) bool {
	for off := 0; ; {
		i := bytes.Index(p[off:], []byte("event:"))
		if i < 0 {
			return false
		}
		i += off
		off = i + 1
		if i == 0 && !atStart || i > 0 && p[i-1] != '\n' && p[i-1] != '\r' {
			continue
		}
		v := p[i+len("event:"):]
		if len(v) > 0 && v[0] == ' ' {
			v = v[1:]
		}
		for _, end := range ends {
			if len(v) > len(end) && bytes.HasPrefix(v, end) && (v[len(end)] == '\n' || v[len(end)] == '\r') {
				return true
			}
		}
	}
}

// responsesErrorEvent is the event that ends a Responses stream that failed: the API's error
// event ({"type":"error","code","message","param"}), with the OpenAI error object too, which
// the SDKs read as the stream's failure.
func responsesErrorEvent(e *apiError) []byte {
	var inner struct {
		Error json.RawMessage `json:"error"`
	}
	json.Unmarshal(e.body(), &inner)
	ev, _ := json.Marshal(struct {
		Type    string          `json:"type"`
		Code    string          `json:"code"`
		Message string          `json:"message"`
		Param   *string         `json:"param"`
		Error   json.RawMessage `json:"error"`
	}{"error", e.wire().code, e.message, nil, inner.Error})
	out := append([]byte("event: error\ndata: "), ev...)
	return append(out, "\n\n"...)
}
