package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
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
	chat   bool
	fields *kvbackend.Fields
	model  string
	stream bool
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
	fields, err := kvbackend.ParseFields(body)
	if errors.Is(err, kvbackend.ErrNullBody) {
		return nil, badRequest("", "request body must be a JSON object, not null")
	}
	if err != nil {
		return nil, badRequest("", "request body is not a valid JSON object: "+jsonProblem(err))
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
	if raw, ok := fields.Field("stream_options"); ok && !isNull(raw) {
		var so rawObject
		if err := json.Unmarshal(raw, &so); err != nil {
			return nil, badRequest("stream_options", "stream_options must be an object")
		}
		var includeUsage bool // checked, not used: the decoder reads it
		if e := boolField(so, "include_usage", &includeUsage); e != nil {
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

func parsePrompt(fields *kvbackend.Fields, req *genRequest) *apiError {
	raw, ok := fields.Field("prompt")
	if !ok || isNull(raw) {
		return badRequest("prompt", "prompt is required")
	}
	var s string
	if decodeString(raw, &s) == nil {
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

func parseMessages(fields *kvbackend.Fields, req *genRequest) *apiError {
	raw, ok := fields.Field("messages")
	if !ok || isNull(raw) {
		return badRequest("messages", "messages is required")
	}
	var msgs []rawObject
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
			if decodeString(m["content"], &content) == nil {
				req.prefix = content
			} else {
				req.prefix = string(m["content"])
			}
		}
	}
	return nil
}

// object is a JSON object whose members are read one by one: the client's body, or an object
// inside it.
type object interface {
	Field(name string) (json.RawMessage, bool)
}

var _ object = (*kvbackend.Fields)(nil)

// rawObject is an object inside the body, decoded into its raw members.
type rawObject map[string]json.RawMessage

func (o rawObject) Field(name string) (json.RawMessage, bool) {
	raw, ok := o[name]
	return raw, ok
}

func stringField(f object, name string, required bool, dst *string) *apiError {
	raw, ok := f.Field(name)
	if !ok || isNull(raw) {
		if required {
			return badRequest(name, name+" is required")
		}
		return nil
	}
	if decodeString(raw, dst) != nil {
		return badRequest(name, name+" must be a string")
	}
	return nil
}

// decodeString decodes a JSON string; one without escapes (most) needs no decoder.
func decodeString(raw json.RawMessage, dst *string) error {
	if n := len(raw); n >= 2 && raw[0] == '"' && raw[n-1] == '"' {
		if s := raw[1 : n-1]; bytes.IndexByte(s, '\\') < 0 && utf8.Valid(s) {
			*dst = string(s)
			return nil
		}
	}
	return json.Unmarshal(raw, dst)
}

func boolField(f object, name string, dst *bool) *apiError {
	raw, ok := f.Field(name)
	if !ok || isNull(raw) {
		return nil
	}
	switch string(raw) {
	case "true":
		*dst = true
		return nil
	case "false":
		*dst = false
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return badRequest(name, name+" must be a boolean")
	}
	return nil
}

// countField checks an optional non-negative integer field.
func countField(f object, name string) *apiError {
	raw, ok := f.Field(name)
	if !ok || isNull(raw) {
		return nil
	}
	v, ok := plainInt(raw)
	if !ok {
		// json.Number also takes a quoted number ("5"), which the OpenAI API refuses as a string.
		var n json.Number
		if raw[0] == '"' || json.Unmarshal(raw, &n) != nil {
			return badRequest(name, name+" must be an integer")
		}
		var err error
		if v, err = n.Int64(); err != nil {
			return badRequest(name, name+" must be an integer")
		}
	}
	if v < 0 {
		return badRequest(name, name+" must not be negative")
	}
	if v > maxTokensLimit {
		return badRequest(name, fmt.Sprintf("%s must be at most %d", name, maxTokensLimit))
	}
	return nil
}

// plainInt reads a JSON number written as a plain integer short enough not to overflow, which
// is how clients write counts; anything else is left to json.Number.
func plainInt(raw []byte) (int64, bool) {
	b, neg := raw, false
	if len(b) > 0 && b[0] == '-' {
		b, neg = b[1:], true
	}
	if len(b) == 0 || len(b) > 18 {
		return 0, false
	}
	var v int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		v = v*10 + int64(c-'0')
	}
	if neg {
		v = -v
	}
	return v, true
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
