package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
)

// AnthropicShape gives the Messages routes' answers Anthropic's error shape. A path sent
// escaped reaches no route (chi routes on it as sent), so the path as it came decides.
func AnthropicShape(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p := r.URL.Path; r.URL.RawPath == "" && (p == MessagesRoute || p == CountTokensRoute) {
			w = &anthropicWriter{w}
		}
		next.ServeHTTP(w, r)
	})
}

// anthropicType is Anthropic's error type for an answer's status.
func anthropicType(status int) string {
	switch status {
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusServiceUnavailable, 529:
		return "overloaded_error"
	case http.StatusGatewayTimeout:
		return "timeout_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

type anthropicError struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}

// anthropicBody is e in Anthropic's shape. A backend's own error answer is kept when it is in
// that shape already (vLLM's and SGLang's Messages handlers answer so); an OpenAI-shaped one
// (a chat completion's, when the route was served as one) is given Anthropic's shape with its
// message.
func (e *Error) anthropicBody() []byte {
	var b anthropicError
	b.Type = "error"
	b.Error.Type = anthropicType(e.Status)
	b.Error.Message = e.Message
	if e.raw != nil {
		var in struct {
			Type  string          `json:"type"`
			Error json.RawMessage `json:"error"`
		}
		if json.Unmarshal(e.raw, &in) == nil && in.Type == "error" && len(in.Error) > 0 && in.Error[0] == '{' {
			return e.raw
		}
		var oai struct {
			Message string `json:"message"`
			Error   struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		json.Unmarshal(e.raw, &oai)
		b.Error.Message = cmpOr(oai.Error.Message, oai.Message, "the engine refused the request")
	}
	out, _ := json.Marshal(b)
	return out
}

func cmpOr(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// AnthropicErrorEvent is the event that ends a Messages stream that failed.
func AnthropicErrorEvent(e *Error) []byte {
	out := append([]byte("event: error\ndata: "), e.anthropicBody()...)
	return append(out, "\n\n"...)
}

// Bounds on what a translated answer holds at once: one event of the engine's chat stream,
// and a whole chat answer, which is read to its end before its translation goes out.
const (
	maxTranslatedEvent  = 1 << 20
	maxTranslatedAnswer = 32 << 20
)

var (
	errTranslatedTooLarge = errors.New("the engine's chat answer is too large to translate")
	errTranslatedBad      = errors.New("the engine's chat answer could not be read as one")
)

// ChatToMessages translates an engine's chat completion answer, streamed or whole, into the
// Messages answer it stands for, as it arrives: each chat chunk becomes the Messages events
// it means (text and reasoning into text and thinking blocks, tool calls into tool_use blocks
// whose input streams as JSON), the end ([DONE]) the message_delta with the stop reason and
// the usage, then message_stop. A whole answer is read to its end first. A chunk that is an
// error, or that cannot be read, stops the translation: err says why.
type ChatToMessages struct {
	Stream bool
	// Stops are the request's stop_sequences: a stop the engine matched is named in the
	// answer's stop_sequence.
	Stops []string
	buf   []byte // a partial line of the stream, or the whole answer so far
	Err   error

	started    bool
	block      string // the open content block's type; "" when none is open
	next       int    // the next block's index
	finish     string
	stopSeq    string
	usage      chatUsage
	stopIssued bool
}

type chatUsage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

type chatAnswerChoice struct {
	Delta        chatAnswerDelta `json:"delta"`
	Message      chatAnswerDelta `json:"message"`
	FinishReason *string         `json:"finish_reason"`
	MatchedStop  json.RawMessage `json:"matched_stop"`
	StopReason   json.RawMessage `json:"stop_reason"`
}

type chatAnswerDelta struct {
	Content          *string `json:"content"`
	ReasoningContent *string `json:"reasoning_content"`
	Reasoning        *string `json:"reasoning"`
	ToolCalls        []struct {
		Index    int    `json:"index"`
		ID       string `json:"id"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

func (d chatAnswerDelta) reasoning() string {
	if d.ReasoningContent != nil {
		return *d.ReasoningContent
	}
	if d.Reasoning != nil {
		return *d.Reasoning
	}
	return ""
}

type chatAnswerBody struct {
	ID      string             `json:"id"`
	Model   string             `json:"model"`
	Choices []chatAnswerChoice `json:"choices"`
	Usage   *chatUsage         `json:"usage"`
	Error   json.RawMessage    `json:"error"`
	Object  string             `json:"object"`
	Message string             `json:"message"`
}

// rewrite is what of p goes to the client now.
func (t *ChatToMessages) rewrite(p []byte) []byte {
	if t.Err != nil {
		return nil
	}
	if !t.Stream {
		if len(t.buf)+len(p) > maxTranslatedAnswer {
			t.Err = errTranslatedTooLarge
			return nil
		}
		t.buf = append(t.buf, p...)
		return nil
	}
	var out []byte
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			if len(t.buf)+len(p) > maxTranslatedEvent {
				t.Err = errTranslatedTooLarge
				return out
			}
			t.buf = append(t.buf, p...)
			break
		}
		line := p[:i]
		if len(t.buf) > 0 {
			line = append(t.buf, line...)
			t.buf = t.buf[:0]
		}
		p = p[i+1:]
		out = t.line(bytes.TrimSuffix(line, []byte("\r")), out)
		if t.Err != nil {
			return out
		}
	}
	return out
}

// flush is what goes to the client at the end of the engine's answer: a whole answer's
// translation.
func (t *ChatToMessages) flush() []byte {
	if t.Stream || t.Err != nil {
		return nil
	}
	var a chatAnswerBody
	if json.Unmarshal(t.buf, &a) != nil || len(a.Choices) == 0 {
		t.Err = errTranslatedBad
		return nil
	}
	c := a.Choices[0]
	var content []map[string]any
	if r := c.Message.reasoning(); r != "" {
		content = append(content, map[string]any{"type": "thinking", "thinking": r, "signature": ""})
	}
	if c.Message.Content != nil && *c.Message.Content != "" {
		content = append(content, map[string]any{"type": "text", "text": *c.Message.Content})
	}
	for _, tc := range c.Message.ToolCalls {
		input := json.RawMessage(tc.Function.Arguments)
		if !json.Valid(input) || len(input) == 0 || input[0] != '{' {
			input = json.RawMessage("{}")
		}
		content = append(content, map[string]any{"type": "tool_use", "id": tc.ID, "name": tc.Function.Name, "input": input})
	}
	if content == nil {
		content = []map[string]any{}
	}
	t.note(c)
	if a.Usage != nil {
		t.usage = *a.Usage
	}
	reason, seq := t.stopReason()
	out, err := json.Marshal(map[string]any{
		"id": messageID(a.ID), "type": "message", "role": "assistant", "model": a.Model, "content": content,
		"stop_reason": reason, "stop_sequence": seq, "usage": t.usageOut(),
	})
	if err != nil {
		t.Err = err
		return nil
	}
	return out
}

// line translates one line of the engine's chat stream.
func (t *ChatToMessages) line(l []byte, out []byte) []byte {
	data, ok := bytes.CutPrefix(l, []byte("data:"))
	if !ok {
		return out // event names, comments, the blank lines between events
	}
	data = bytes.TrimSpace(data)
	if bytes.Equal(data, []byte("[DONE]")) {
		return t.end(out)
	}
	var ch chatAnswerBody
	if json.Unmarshal(data, &ch) != nil {
		t.Err = errTranslatedBad
		return out
	}
	if len(ch.Error) > 0 && !isNull(ch.Error) || ch.Object == "error" {
		t.Err = errors.New("the engine's stream failed: " + cmpOr(errorMessage(ch.Error), ch.Message, "an error event"))
		return out
	}
	if !t.started {
		t.started = true
		out = event(out, "message_start", map[string]any{"type": "message_start", "message": map[string]any{
			"id": messageID(ch.ID), "type": "message", "role": "assistant", "model": ch.Model, "content": []any{},
			"stop_reason": nil, "stop_sequence": nil, "usage": map[string]int{"input_tokens": 0, "output_tokens": 0},
		}})
		out = event(out, "ping", map[string]string{"type": "ping"})
	}
	if ch.Usage != nil {
		t.usage = *ch.Usage
	}
	for _, c := range ch.Choices {
		d := c.Delta
		if r := d.reasoning(); r != "" {
			out = t.open(out, "thinking", map[string]any{"type": "thinking", "thinking": "", "signature": ""})
			out = t.delta(out, map[string]any{"type": "thinking_delta", "thinking": r})
		}
		if d.Content != nil && *d.Content != "" {
			out = t.open(out, "text", map[string]any{"type": "text", "text": ""})
			out = t.delta(out, map[string]any{"type": "text_delta", "text": *d.Content})
		}
		for _, tc := range d.ToolCalls {
			if tc.ID != "" {
				t.close(&out)
				out = t.open(out, "tool_use", map[string]any{"type": "tool_use", "id": tc.ID, "name": tc.Function.Name, "input": map[string]any{}})
			}
			if tc.Function.Arguments != "" && t.block == "tool_use" {
				out = t.delta(out, map[string]any{"type": "input_json_delta", "partial_json": tc.Function.Arguments})
			}
		}
		t.note(c)
	}
	return out
}

// note keeps a choice's finish reason and matched stop.
func (t *ChatToMessages) note(c chatAnswerChoice) {
	if c.FinishReason != nil && *c.FinishReason != "" {
		t.finish = *c.FinishReason
	}
	for _, raw := range []json.RawMessage{c.MatchedStop, c.StopReason} {
		var s string
		if len(raw) > 0 && raw[0] == '"' && json.Unmarshal(raw, &s) == nil && s != "" {
			t.stopSeq = s
		}
	}
}

func (t *ChatToMessages) stopReason() (reason string, seq any) {
	switch t.finish {
	case "length":
		return "max_tokens", nil
	case "tool_calls":
		return "tool_use", nil
	}
	if t.stopSeq != "" {
		for _, s := range t.Stops {
			if s == t.stopSeq {
				return "stop_sequence", s
			}
		}
	}
	return "end_turn", nil
}

func (t *ChatToMessages) usageOut() map[string]int {
	u := map[string]int{"input_tokens": t.usage.PromptTokens, "output_tokens": t.usage.CompletionTokens}
	if d := t.usage.PromptTokensDetails; d != nil {
		u["cache_read_input_tokens"] = d.CachedTokens
	}
	return u
}

// open starts a content block of typ, closing another one open.
func (t *ChatToMessages) open(out []byte, typ string, block map[string]any) []byte {
	if t.block == typ {
		return out
	}
	t.close(&out)
	t.block = typ
	return event(out, "content_block_start", map[string]any{"type": "content_block_start", "index": t.next, "content_block": block})
}

func (t *ChatToMessages) close(out *[]byte) {
	if t.block == "" {
		return
	}
	*out = event(*out, "content_block_stop", map[string]any{"type": "content_block_stop", "index": t.next})
	t.block = ""
	t.next++
}

func (t *ChatToMessages) delta(out []byte, d map[string]any) []byte {
	return event(out, "content_block_delta", map[string]any{"type": "content_block_delta", "index": t.next, "delta": d})
}

// end is the stream's end: the open block closed, the stop reason and usage, message_stop.
func (t *ChatToMessages) end(out []byte) []byte {
	if t.stopIssued {
		return out
	}
	if !t.started {
		t.Err = errTranslatedBad // a stream with no chunk before its end
		return out
	}
	t.stopIssued = true
	t.close(&out)
	reason, seq := t.stopReason()
	out = event(out, "message_delta", map[string]any{"type": "message_delta",
		"delta": map[string]any{"stop_reason": reason, "stop_sequence": seq}, "usage": t.usageOut()})
	return event(out, "message_stop", map[string]string{"type": "message_stop"})
}

func event(out []byte, name string, v any) []byte {
	b, _ := json.Marshal(v)
	out = append(out, "event: "...)
	out = append(out, name...)
	out = append(out, "\ndata: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}

// messageID is a Messages answer's id for a chat answer's.
func messageID(id string) string {
	id = strings.TrimPrefix(id, "chatcmpl-")
	if id == "" {
		id = NewID()
	}
	return "msg_" + id
}

func errorMessage(raw json.RawMessage) string {
	var e struct {
		Message string `json:"message"`
	}
	if json.Unmarshal(raw, &e) == nil {
		return e.Message
	}
	var s string
	json.Unmarshal(raw, &s)
	return s
}

// Pass is the Messages translation as a stage: the chat answer's events become the Messages
// answer's, the last of them at the answer's end; an answer it cannot translate fails.
func (t *ChatToMessages) Pass(data []byte, end error) ([]byte, error) {
	data = t.rewrite(data)
	if end == io.EOF {
		data = append(data, t.flush()...)
	}
	if t.Err != nil && (end == nil || end == io.EOF) {
		end = t.Err
	}
	return data, end
}
