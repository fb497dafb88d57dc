package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/kvbackend"
)

// maxTokensLimit rejects absurd max_tokens values before they reach a GPU; no model served
// today has a context anywhere near it.
const maxTokensLimit = 1 << 24

// genRequest is a completion or chat request, parsed once: its raw top-level fields (passed on
// untouched) and the few values the proxy itself needs.
type genRequest struct {
	chat         bool
	fields       kvbackend.Fields
	model        string
	stream       bool
	includeUsage bool
	// prefix is the start of the prompt, for prefix-affinity routing.
	prefix string
}

// parseRequest validates a body as an OpenAI completions (chat false) or chat completions
// request. Errors name the field.
func parseRequest(body []byte, chat bool) (*genRequest, *apiError) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, badRequest("", "request body is empty; expected a JSON object")
	}
	if !utf8.Valid(body) {
		return nil, badRequest("", "request body is not valid UTF-8")
	}
	var fields kvbackend.Fields
	if err := json.Unmarshal(body, &fields); err != nil {
		return nil, badRequest("", "request body is not a valid JSON object: "+jsonProblem(err))
	}
	if fields == nil {
		return nil, badRequest("", "request body must be a JSON object, not null")
	}
	req := &genRequest{chat: chat, fields: fields}

	if e := stringField(fields, "model", true, &req.model); e != nil {
		return nil, e
	}
	if req.model == "" {
		return nil, badRequest("model", "model must not be empty")
	}
	if e := boolField(fields, "stream", &req.stream); e != nil {
		return nil, e
	}
	if raw, ok := fields["stream_options"]; ok && !isNull(raw) {
		var so map[string]json.RawMessage
		if err := json.Unmarshal(raw, &so); err != nil {
			return nil, badRequest("stream_options", "stream_options must be an object")
		}
		if e := boolField(so, "include_usage", &req.includeUsage); e != nil {
			e.param = "stream_options.include_usage"
			return nil, e
		}
	}
	for _, name := range []string{"max_tokens", "max_completion_tokens", "min_tokens", "n"} {
		if e := countField(fields, name); e != nil {
			return nil, e
		}
	}
	if chat {
		e := parseMessages(fields, req)
		if e != nil {
			return nil, e
		}
	} else if e := parsePrompt(fields, req); e != nil {
		return nil, e
	}
	return req, nil
}

func parsePrompt(fields kvbackend.Fields, req *genRequest) *apiError {
	raw, ok := fields["prompt"]
	if !ok || isNull(raw) {
		return badRequest("prompt", "prompt is required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		req.prefix = s
		return nil
	}
	// The other shapes OpenAI allows: an array of strings, of token ids, or of arrays of ids.
	var many []json.RawMessage
	if json.Unmarshal(raw, &many) != nil || len(many) == 0 {
		return badRequest("prompt", "prompt must be a string, or a non-empty array of strings or token ids")
	}
	for i, p := range many {
		var ps string
		var n json.Number
		var ids []json.Number
		switch {
		case json.Unmarshal(p, &ps) == nil:
			if i == 0 {
				req.prefix = ps
			}
		case json.Unmarshal(p, &n) == nil, json.Unmarshal(p, &ids) == nil:
		default:
			return badRequest("prompt", fmt.Sprintf("prompt[%d] must be a string, a token id or an array of token ids", i))
		}
	}
	if req.prefix == "" {
		req.prefix = string(raw)
	}
	return nil
}

func parseMessages(fields kvbackend.Fields, req *genRequest) *apiError {
	raw, ok := fields["messages"]
	if !ok || isNull(raw) {
		return badRequest("messages", "messages is required")
	}
	var msgs []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return badRequest("messages", "messages must be an array of message objects")
	}
	if len(msgs) == 0 {
		return badRequest("messages", "messages must not be empty")
	}
	for i, m := range msgs {
		if m == nil {
			return badRequest(fmt.Sprintf("messages[%d]", i), fmt.Sprintf("messages[%d] must be an object", i))
		}
		var role string
		if e := stringField(m, "role", true, &role); e != nil {
			e.param = fmt.Sprintf("messages[%d].role", i)
			e.message = fmt.Sprintf("messages[%d].role is required and must be a string", i)
			return e
		}
		if i == 0 {
			// Routing by prefix wants what repeats across requests: the first message (often a
			// system prompt) is a good stand-in for the prompt's first tokens.
			var content string
			if json.Unmarshal(m["content"], &content) == nil {
				req.prefix = content
			} else {
				req.prefix = string(m["content"])
			}
		}
	}
	return nil
}

func stringField(f map[string]json.RawMessage, name string, required bool, dst *string) *apiError {
	raw, ok := f[name]
	if !ok || isNull(raw) {
		if required {
			return badRequest(name, name+" is required")
		}
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return badRequest(name, name+" must be a string")
	}
	return nil
}

func boolField(f map[string]json.RawMessage, name string, dst *bool) *apiError {
	raw, ok := f[name]
	if !ok || isNull(raw) {
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return badRequest(name, name+" must be a boolean")
	}
	return nil
}

// countField checks an optional non-negative integer field.
func countField(f map[string]json.RawMessage, name string) *apiError {
	raw, ok := f[name]
	if !ok || isNull(raw) {
		return nil
	}
	// json.Number also takes a quoted number ("5"), which the OpenAI API refuses as a string.
	var n json.Number
	if raw[0] == '"' || json.Unmarshal(raw, &n) != nil {
		return badRequest(name, name+" must be an integer")
	}
	v, err := n.Int64()
	if err != nil {
		return badRequest(name, name+" must be an integer")
	}
	if v < 0 {
		return badRequest(name, name+" must not be negative")
	}
	if v > maxTokensLimit {
		return badRequest(name, fmt.Sprintf("%s must be at most %d", name, maxTokensLimit))
	}
	return nil
}

func isNull(raw json.RawMessage) bool {
	return bytes.Equal(bytes.TrimSpace(raw), []byte("null"))
}

// jsonProblem turns a decoder error into a short sentence without Go type names.
func jsonProblem(err error) string {
	// A truncated body is a *json.SyntaxError too: tell it apart first.
	if err.Error() == "unexpected end of JSON input" {
		return "the JSON is truncated"
	}
	switch e := err.(type) {
	case *json.SyntaxError:
		return fmt.Sprintf("syntax error at byte %d", e.Offset)
	case *json.UnmarshalTypeError:
		return "expected a JSON object"
	}
	return err.Error()
}
