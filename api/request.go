package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/pdproxy/pdproxy/engine"
)

// maxTokensLimit rejects absurd max_tokens values before they reach a GPU: a count must be
// below it. No model served today has a context anywhere near it.
const maxTokensLimit = 1 << 24

// Request is a completion or chat request, parsed once: its raw top-level fields (passed on
// untouched) and the few values the proxy itself needs.
type Request struct {
	// Route is the path the request came on, and goes to the engines on.
	Route string
	// API is the API the body is for: how a prefill bounds it, and how its answer ends.
	API engine.API
	// State names a member of a Responses API request that needs State on one engine
	// (previous_response_id, background, store), empty if none.
	State  string
	Fields *engine.Fields
	Model  string
	Stream bool
	// Prefix is the start of the prompt, for Prefix-affinity routing.
	Prefix string
	// Text is the whole prompt as it repeats across a session's turns, for cache-aware
	// routing: a completion's prompt, or a chat's messages array as the client sent it.
	Text string
	// Key is what the engines Key the prompt's KV blocks by beyond its tokens, as far as
	// the proxy knows it (cachekey.go); RouteText is text as cache-aware policies match it,
	// tagged with the Key (keyRequest).
	Key       cacheKey
	RouteText string
	// TurnEnds are where in Text the last few messages of a conversation end (a chat's
	// messages, a Messages request's rendered conversation), oldest first: the text an
	// earlier request of the conversation sent ends at one of them. Nil for other requests.
	TurnEnds []int
	// Messages is a chat's Messages array as the client sent it, or a Messages request's
	// conversation rendered as chat Messages, to tokenize.
	Messages json.RawMessage
	// Anthropic is what a Messages request needs to go to an engine as a chat completion;
	// nil for the other APIs.
	Anthropic *anthropicRequest
	// Tokens is a completion prompt the client sent as token ids; nil else.
	Tokens []uint32
	// DecodeOnly, when set, is why the request must not be prefilled on another engine (the
	// pdproxy_decode_only_total reason): P/D cannot serve it safely, so a decoder computes the
	// prompt itself.
	DecodeOnly string
	// Prompts counts a completion's Prompts (a prompt array holds several).
	Prompts int
}

// The reasons a request goes decode-only: what vLLM's P/D cannot serve safely.
const (
	// DecodeOnlyN: n > 1 or best_of > 1. The prefiller makes a child request per sample and
	// returns params for one: the others' holds are invisible to the proxy (vLLM #38900).
	DecodeOnlyN = "n"
	// DecodeOnlyPromptArray: several prompts in one completion; only the first prompt's
	// params come back (vLLM #54707), and decoders assert on shared block ids.
	DecodeOnlyPromptArray = "prompt_array"
	// DecodeOnlyPromptLogprobs: prompt_logprobs, or echo with logprobs, crash a decoder that
	// is handed KV params (vLLM #50792).
	DecodeOnlyPromptLogprobs = "prompt_logprobs"
	// DecodeOnlyCached: the chosen decoder already holds all but fewer than
	// pd_uncached_token_threshold of the prompt's tokens (conditional disaggregation).
	DecodeOnlyCached = "cached"
)

// ParseCompletions and ParseChat parse the bodies of their routes.
func ParseCompletions(body []byte) (*Request, *Error) { return parseRequest(body, false) }
func ParseChat(body []byte) (*Request, *Error)        { return parseRequest(body, true) }

// parseRequest validates a body as an OpenAI completions (chat false) or chat completions
// request. Errors name the field.
func parseRequest(body []byte, chat bool) (*Request, *Error) {
	req, e := parseGeneration(body)
	if e != nil {
		return nil, e
	}
	if chat {
		req.API = engine.APIChat
	}
	fields := req.Fields
	if e := checkStreamOptions(fields); e != nil {
		return nil, e
	}
	counts := make(map[string]int64, len(countFields))
	for _, c := range countFields {
		v, present, e := CountField(fields, c.name, c.min)
		if e != nil {
			return nil, e
		}
		if present {
			counts[c.name] = v
		}
	}
	for _, name := range numberFields {
		if e := numberField(fields, name); e != nil {
			return nil, e
		}
	}
	for _, name := range intFields {
		if _, _, e := CountField(fields, name, math.MinInt64); e != nil {
			return nil, e
		}
	}
	for _, name := range boolFields {
		var v bool
		if e := boolField(fields, name, &v); e != nil {
			return nil, e
		}
	}
	var echo, logprobs bool
	boolField(fields, "echo", &echo) // checked above
	if e := stopField(fields); e != nil {
		return nil, e
	}
	if chat {
		// A chat's logprobs is a boolean; a completion's a count.
		if e := boolField(fields, "logprobs", &logprobs); e != nil {
			return nil, e
		}
		if e := parseMessages(fields, req); e != nil {
			return nil, e
		}
	} else {
		var e *Error
		if _, logprobs, e = CountField(fields, "logprobs", 0); e != nil {
			return nil, e
		}
		if e := parsePrompt(fields, req); e != nil {
			return nil, e
		}
		req.Key.Media = completionMedia(fields)
	}
	_, promptLogprobs := counts["prompt_logprobs"]
	switch {
	case counts["n"] > 1 || counts["best_of"] > 1:
		req.DecodeOnly = DecodeOnlyN
	case req.Prompts > 1:
		req.DecodeOnly = DecodeOnlyPromptArray
	case promptLogprobs || echo && logprobs:
		req.DecodeOnly = DecodeOnlyPromptLogprobs
	}
	return req, nil
}

// checkStreamOptions checks stream_options: an object whose include_usage is a boolean.
func checkStreamOptions(fields *engine.Fields) *Error {
	raw, ok := fields.Field("stream_options")
	if !ok || isNull(raw) {
		return nil
	}
	var so rawObject
	if err := json.Unmarshal(raw, &so); err != nil {
		return BadRequest("stream_options", "stream_options must be an object")
	}
	var includeUsage bool // checked, not used: the decoder reads it
	if e := boolField(so, "include_usage", &includeUsage); e != nil {
		e.Param = "stream_options.include_usage"
		return e
	}
	return nil
}

// parseGeneration reads what every generation body has: a JSON object with a model, and
// whether it streams.
func parseGeneration(body []byte) (*Request, *Error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, BadRequest("", "request body is empty; expected a JSON object")
	}
	if !utf8.Valid(body) {
		return nil, BadRequest("", "request body is not valid UTF-8")
	}
	fields, err := engine.ParseFields(body)
	if errors.Is(err, engine.ErrNullBody) {
		return nil, BadRequest("", "request body must be a JSON object, not null")
	}
	if err != nil {
		return nil, BadRequest("", "request body is not a valid JSON object: "+JSONProblem(err))
	}
	req := &Request{Fields: fields}
	if e := StringField(fields, "model", true, &req.Model); e != nil {
		return nil, e
	}
	if req.Model == "" {
		return nil, BadRequest("model", "model must not be empty")
	}
	if e := boolField(fields, "stream", &req.Stream); e != nil {
		return nil, e
	}
	if e := readCacheSalt(fields, req); e != nil {
		return nil, e
	}
	return req, nil
}

// countFields are the integer fields the proxy checks, with their smallest value: a
// max_tokens of 0 is refused here, before a prefiller rewritten to one token holds KV for a
// decode the decoder would refuse.
var countFields = []struct {
	name string
	min  int64
}{
	{"max_tokens", 1}, {"max_completion_tokens", 1}, {"min_tokens", 0}, {"n", 1}, {"best_of", 1},
	{"top_logprobs", 0}, {"prompt_logprobs", 0},
}

// numberFields, intFields and boolFields are sampling fields of the OpenAI API and vLLM's
// extensions whose type the proxy checks, so that a request no engine would take is refused
// before one holds KV for it.
var (
	numberFields = []string{"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty"}
	intFields    = []string{"top_k", "seed", "priority"}
	boolFields   = []string{"echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "add_generation_prompt"}
)

func parsePrompt(fields *engine.Fields, req *Request) *Error {
	raw, ok := fields.Field("prompt")
	if !ok || isNull(raw) {
		return BadRequest("prompt", "prompt is required")
	}
	var s string
	if raw[0] == '"' && decodeString(raw, &s) == nil {
		req.Prefix, req.Text, req.Prompts = s, s, 1
		return nil
	}
	// The other shapes OpenAI allows: an array of strings, of token ids (one prompt), or of
	// arrays of ids. A null anywhere is none of them.
	var many []json.RawMessage
	if json.Unmarshal(raw, &many) != nil || len(many) == 0 {
		return BadRequest("prompt", "prompt must be a string, or a non-empty array of strings or token ids")
	}
	tokens := 0
	for i, p := range many {
		var ps string
		switch {
		case p[0] == '"' && json.Unmarshal(p, &ps) == nil:
			if i == 0 {
				req.Prefix = ps
			}
			req.Prompts++
		case tokenID(p):
			tokens++
		case p[0] == '[' && tokenIDs(p):
			req.Prompts++
		default:
			return BadRequest("prompt", fmt.Sprintf("prompt[%d] must be a string, a token id or a non-empty array of token ids", i))
		}
	}
	if tokens > 0 {
		if req.Prompts > 0 {
			return BadRequest("prompt", "prompt must not mix token ids with strings or arrays")
		}
		req.Prompts = 1
		req.Tokens = make([]uint32, 0, len(many))
		for _, p := range many {
			v, _ := plainInt(p)
			if v > math.MaxUint32 {
				req.Tokens = nil // no vocabulary is that large: route on the text
				break
			}
			req.Tokens = append(req.Tokens, uint32(v))
		}
	}
	if req.Prefix == "" {
		req.Prefix = string(raw)
	}
	req.Text = req.Prefix
	return nil
}

// tokenID reports whether raw is a token id: a non-negative integer.
func tokenID(raw json.RawMessage) bool {
	v, ok := plainInt(raw)
	return ok && v >= 0
}

// tokenIDs reports whether raw is a non-empty array of token ids.
func tokenIDs(raw json.RawMessage) bool {
	var ids []json.RawMessage
	if json.Unmarshal(raw, &ids) != nil || len(ids) == 0 {
		return false
	}
	for _, id := range ids {
		if !tokenID(id) {
			return false
		}
	}
	return true
}

func parseMessages(fields *engine.Fields, req *Request) *Error {
	raw, ok := fields.Field("messages")
	if !ok || isNull(raw) {
		return BadRequest("messages", "messages is required")
	}
	var msgs []rawObject
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return BadRequest("messages", "messages must be an array of message objects")
	}
	if len(msgs) == 0 {
		return BadRequest("messages", "messages must not be empty")
	}
	// The array as it came grows at its end turn after turn, as the rendered conversation
	// does: what a cache-aware policy matches, and what the engine's /tokenize renders.
	req.Text, req.Messages = string(raw), raw
	req.TurnEnds = messageEnds(req.Text, maxTurnEnds)
	for i, m := range msgs {
		if m == nil {
			return BadRequest(fmt.Sprintf("messages[%d]", i), fmt.Sprintf("messages[%d] must be an object", i))
		}
		req.Key.Media = req.Key.Media || hasMedia(m["content"])
		var role string
		if e := StringField(m, "role", true, &role); e != nil {
			e.Param = fmt.Sprintf("messages[%d].role", i)
			e.Message = fmt.Sprintf("messages[%d].role is required and must be a string", i)
			return e
		}
		if i == 0 {
			// Routing by prefix wants what repeats across requests: the first message (often a
			// system prompt) is a good stand-in for the prompt's first tokens.
			var content string
			if decodeString(m["content"], &content) == nil {
				req.Prefix = content
			} else {
				req.Prefix = string(m["content"])
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

var _ object = (*engine.Fields)(nil)

// rawObject is an object inside the body, decoded into its raw members.
type rawObject map[string]json.RawMessage

func (o rawObject) Field(name string) (json.RawMessage, bool) {
	raw, ok := o[name]
	return raw, ok
}

func StringField(f object, name string, required bool, dst *string) *Error {
	raw, ok := f.Field(name)
	if !ok || isNull(raw) {
		if required {
			return BadRequest(name, name+" is required")
		}
		return nil
	}
	if decodeString(raw, dst) != nil {
		return BadRequest(name, name+" must be a string")
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

func boolField(f object, name string, dst *bool) *Error {
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
		return BadRequest(name, name+" must be a boolean")
	}
	return nil
}

// CountField checks an optional integer field, at least min and below maxTokensLimit, and
// returns it with whether it is there (not absent, not null).
func CountField(f object, name string, min int64) (int64, bool, *Error) {
	raw, ok := f.Field(name)
	if !ok || isNull(raw) {
		return 0, false, nil
	}
	v, e := checkCount(raw, name, min)
	return v, e == nil, e
}

func checkCount(raw json.RawMessage, name string, min int64) (int64, *Error) {
	v, ok := plainInt(raw)
	if !ok {
		// json.Number also takes a quoted number ("5"), which the OpenAI API refuses as a string.
		var n json.Number
		if raw[0] == '"' || json.Unmarshal(raw, &n) != nil {
			return 0, BadRequest(name, name+" must be an integer")
		}
		var err error
		if v, err = n.Int64(); err != nil {
			return 0, BadRequest(name, name+" must be an integer")
		}
	}
	if min == math.MinInt64 {
		return v, nil // a seed or top_k: any integer
	}
	if v < min {
		if min == 0 {
			return 0, BadRequest(name, name+" must not be negative")
		}
		return 0, BadRequest(name, fmt.Sprintf("%s must be at least %d", name, min))
	}
	if v >= maxTokensLimit {
		return 0, BadRequest(name, fmt.Sprintf("%s must be less than %d", name, maxTokensLimit))
	}
	return v, nil
}

// numberField checks an optional JSON number field (a quoted number is a string).
func numberField(f object, name string) *Error {
	raw, ok := f.Field(name)
	if !ok || isNull(raw) {
		return nil
	}
	var v float64
	if c := raw[0]; (c != '-' && (c < '0' || c > '9')) || json.Unmarshal(raw, &v) != nil {
		return BadRequest(name, name+" must be a number")
	}
	return nil
}

// stopField checks stop: a string or an array of strings.
func stopField(f object) *Error {
	raw, ok := f.Field("stop")
	if !ok || isNull(raw) {
		return nil
	}
	if raw[0] == '"' {
		return nil // valid JSON already, so a valid string
	}
	var many []json.RawMessage
	if json.Unmarshal(raw, &many) == nil {
		ok := true
		for _, s := range many {
			ok = ok && s[0] == '"'
		}
		if ok {
			return nil
		}
	}
	return BadRequest("stop", "stop must be a string or an array of strings")
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

// JSONProblem turns a decoder error into a short sentence without Go type names.
func JSONProblem(err error) string {
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

// readCacheSalt reads the body's cache_salt, a string when given.
func readCacheSalt(fields object, req *Request) *Error {
	return StringField(fields, "cache_salt", false, &req.Key.Salt)
}
