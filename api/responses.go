package api

import (
	"encoding/json"
	"fmt"

	"github.com/pdproxy/pdproxy/engine"
)

// The OpenAI Responses API (POST /v1/responses), as vLLM serves it: one input (a string, or
// a list of items), instructions, max_output_tokens, and a stream of typed events
// ("event: response.output_text.delta") that ends with response.completed rather than
// [DONE]. It is served by the P/D flow of chat: the prefill bounded by max_output_tokens 1
// and storing nothing (engine), the decode carrying the prefiller's params, every abort,
// hold and release rule the same.

// ParseResponses validates a Responses API body.
func ParseResponses(body []byte) (*Request, *Error) {
	req, e := parseGeneration(body)
	if e != nil {
		return nil, e
	}
	req.API = engine.APIResponses
	f := req.Fields
	raw, ok := f.Field("input")
	if !ok || isNull(raw) {
		return nil, BadRequest("input", "input is required")
	}
	var instructions string
	if e := StringField(f, "instructions", false, &instructions); e != nil {
		return nil, e
	}
	var s string
	switch {
	case raw[0] == '"' && decodeString(raw, &s) == nil:
		req.Prefix = s
	default:
		var items []json.RawMessage
		if json.Unmarshal(raw, &items) != nil || len(items) == 0 {
			return nil, BadRequest("input", "input must be a string or a non-empty array of input items")
		}
		for i, it := range items {
			if it[0] != '{' {
				return nil, BadRequest(fmt.Sprintf("input[%d]", i), fmt.Sprintf("input[%d] must be an object", i))
			}
		}
		req.Prefix = string(items[0])
	}
	if instructions != "" {
		req.Prefix = instructions
	}
	// What repeats across a conversation's turns, for cache-aware routing: the instructions,
	// then the input as it grows.
	req.Text = instructions + string(raw)
	req.Key.Media = messagesHaveMedia(raw)
	req.Prompts = 1
	if _, _, e := CountField(f, "max_output_tokens", 1); e != nil {
		return nil, e
	}
	if _, _, e := CountField(f, "top_logprobs", 0); e != nil {
		return nil, e
	}
	for _, name := range []string{"temperature", "top_p", "repetition_penalty"} {
		if e := numberField(f, name); e != nil {
			return nil, e
		}
	}
	if _, _, e := CountField(f, "top_k", -1); e != nil {
		return nil, e
	}
	var prev string
	if e := StringField(f, "previous_response_id", false, &prev); e != nil {
		return nil, e
	}
	if raw, ok := f.Field("previous_response_id"); ok && !isNull(raw) && prev == "" {
		// An engine would look the empty id up and answer 404, on whichever engine it is.
		return nil, BadRequest("previous_response_id", "previous_response_id is empty: name an earlier response, or leave it out")
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
		req.State = "previous_response_id"
	case background:
		req.State = "background"
	case store:
		req.State = "store"
	}
	return req, nil
}

// ResponsesErrorEvent is the event that ends a Responses stream that failed: the API's error
// event ({"type":"error","code","message","param"}), with the OpenAI error object too, which
// the SDKs read as the stream's failure.
func ResponsesErrorEvent(e *Error) []byte {
	var inner struct {
		Error json.RawMessage `json:"error"`
	}
	json.Unmarshal(e.Body(), &inner)
	ev, _ := json.Marshal(struct {
		Type    string          `json:"type"`
		Code    string          `json:"code"`
		Message string          `json:"message"`
		Param   *string         `json:"param"`
		Error   json.RawMessage `json:"error"`
	}{"error", e.wire().code, e.Message, nil, inner.Error})
	out := append([]byte("event: error\ndata: "), ev...)
	return append(out, "\n\n"...)
}
