package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// Anthropic's Messages API as vLLM serves it: POST /v1/messages and
// POST /v1/messages/count_tokens. vLLM's handler is its chat handler with
// the request converted on the way in and the answer on the way out, so
// the sim's is too: a Messages body becomes the chat it stands for, runs on
// the completions path (prefill/decode, faults, aborts, drains included),
// and is written as Messages events and answers.
//
// The conversion is vLLM's: the top-level system (a string, or its text
// blocks) and the text of every message of role system are joined into one
// system message first, a text block starting with x-anthropic-billing-header
// left out; then each other message in order, its text blocks its content
// (images and thinking carry no text in the sim's template), its tool_use
// blocks tool calls (an assistant turn of tool calls alone has empty
// content), and each tool_result of a user turn a message of role tool before
// it, its text blocks joined by line ends. Roles ctx and msg are user's, as
// vLLM maps them. The result goes through the chat template, so a Messages
// request and the chat completion of its conversation are the same prompt
// tokens: the same prefix cache blocks, KV events and greedy answer.
//
// The body takes model (required), messages, system, max_tokens (required,
// at least 1), stop_sequences, stream, temperature (0 is greedy, as chat),
// top_p, top_k, tools, tool_choice, metadata and vLLM's kv_transfer_params,
// which make a prefill or a decode exactly as on chat, under the nixl and
// mooncake protocols. The sim's own chat extras come as they do on chat:
// ignore_eos, min_tokens, seed, priority. Every other member is ignored, as
// vLLM's request model ignores what it does not declare. stop_sequences are
// accepted and, as chat's stop, never match: the sim's words are its own.
//
// A whole answer is {"id","type":"message","role":"assistant","content":
// [{"type":"text","text"}],"model","stop_reason","usage":{"input_tokens",
// "output_tokens"}} plus, from a prefill that holds KV, the top-level
// kv_transfer_params chat answers with (absent, not null, when it holds
// nothing: vLLM drops null members of this answer). The id is the chat's,
// "chatcmpl-<request id>"; stop_reason is end_turn for a stop, max_tokens
// for a length cap, absent for an abort; content is empty when the answer
// has no text. A stream is SSE frames "event: <type>\ndata: <json>\n\n":
// message_start (its message without type and role, with input_tokens, as
// vLLM writes it), content_block_start (index 0, a text block) before the
// first text, one content_block_delta (text_delta) per token with text,
// content_block_stop, message_delta (delta.stop_reason, usage input_tokens
// and output_tokens), message_stop; no ping (vLLM sends none) and no
// [DONE]. A streamed prefill's kv_transfer_params are dropped, as vLLM's
// converter drops them.
//
// Errors are in Anthropic's shape, {"type":"error","error":{"type",
// "message"}}, the type the one chat's error would carry; one after the
// stream began is an "event: error" frame of that shape, the stream's last.
// count_tokens takes model, messages, system, tools and tool_choice and
// answers {"input_tokens":n,"context_management":{"original_input_tokens":n}}.
//
// Under the sglang protocol the routes are SGLang's: its handler builds the
// chat request from the Messages members alone, so rid and the bootstrap
// fields never reach the engine and a request is served aggregated, on a
// prefiller or a decoder. Its answers differ as SGLang's do: the id is
// "msg_<request id>", message_start's message has its type and role, the
// usage adds cache_read_input_tokens, an aborted answer's stop_reason is
// end_turn, and count_tokens answers context_management null.

// billingHeader starts a system text block that some agents send with a
// hash of each request: vLLM leaves it out of the prompt.
const billingHeader = "x-anthropic-billing-header"

// wireMessages mirrors the Messages API fields the sim reads.
type wireMessages struct {
	Model            *string            `json:"model"`
	Messages         []anthropicMessage `json:"messages"`
	System           json.RawMessage    `json:"system"`
	MaxTokens        *int               `json:"max_tokens"`
	StopSequences    []string           `json:"stop_sequences"`
	Stream           *bool              `json:"stream"`
	Temperature      *float64           `json:"temperature"`
	TopP             *float64           `json:"top_p"`
	TopK             *int               `json:"top_k"`
	Tools            []anthropicTool    `json:"tools"`
	ToolChoice       *anthropicChoice   `json:"tool_choice"`
	Metadata         map[string]any     `json:"metadata"`
	KVTransferParams *kvTransferParams  `json:"kv_transfer_params"`
	// The sim's extras, as chat takes them.
	IgnoreEOS *bool  `json:"ignore_eos"`
	MinTokens *int   `json:"min_tokens"`
	Seed      *int64 `json:"seed"`
	Priority  *int   `json:"priority"`
}

type anthropicMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// anthropicBlock is a content block, the members of every kind in one.
type anthropicBlock struct {
	Type      string          `json:"type"`
	Text      *string         `json:"text"`
	Source    map[string]any  `json:"source"`
	Input     map[string]any  `json:"input"`
	Content   json.RawMessage `json:"content"`
	Thinking  *string         `json:"thinking"`
	ID        *string         `json:"id"`
	ToolUseID *string         `json:"tool_use_id"`
	Name      *string         `json:"name"`
}

type anthropicTool struct {
	Name        *string        `json:"name"`
	InputSchema map[string]any `json:"input_schema"`
}

type anthropicChoice struct {
	Type string  `json:"type"`
	Name *string `json:"name"`
}

// blockTypes are the content blocks vLLM's request model takes.
var blockTypes = map[string]bool{"text": true, "image": true, "tool_use": true, "tool_result": true,
	"tool_reference": true, "thinking": true, "redacted_thinking": true}

// decodeMessages checks a Messages body's shape, as vLLM's request model
// does before its handler, and renders its conversation through the chat
// template; count (count_tokens) needs no max_tokens.
func decodeMessages(tk tokenizer, body []byte, count bool) (*wireMessages, []uint32, error) {
	var w wireMessages
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&w); err != nil {
		return nil, nil, badRequest("invalid_json", "request body is not a valid JSON object: %v", err)
	}
	if dec.More() {
		return nil, nil, badRequest("invalid_json", "request body has trailing data after the JSON object")
	}
	switch {
	case w.Model == nil || *w.Model == "":
		return nil, nil, badRequest("missing_model", "model is required")
	case w.Messages == nil:
		return nil, nil, badRequest("missing_messages", "messages is required")
	case !count && w.MaxTokens == nil:
		return nil, nil, badRequest("missing_max_tokens", "max_tokens is required")
	case !count && *w.MaxTokens <= 0:
		return nil, nil, badRequest("invalid_max_tokens", "max_tokens must be positive")
	}
	for i, t := range w.Tools {
		if t.Name == nil || t.InputSchema == nil {
			return nil, nil, badRequest("invalid_tools", "tools[%d]: name and input_schema are required", i)
		}
	}
	if c := w.ToolChoice; c != nil {
		switch {
		case c.Type != "auto" && c.Type != "any" && c.Type != "tool" && c.Type != "none":
			return nil, nil, badRequest("invalid_tool_choice", "tool_choice.type %q: must be auto, any, tool or none", c.Type)
		case c.Type == "tool" && (c.Name == nil || *c.Name == ""):
			return nil, nil, badRequest("invalid_tool_choice", "tool_choice.name is required when type is 'tool'")
		}
	}
	chat, err := messagesChat(w.System, w.Messages)
	if err != nil {
		return nil, nil, err
	}
	tokens, err := chatPrompt(tk, chat, true)
	if err != nil {
		return nil, nil, err
	}
	return &w, tokens, nil
}

// decodeMessagesBody is decodeBody for POST /v1/messages: the chat body a
// Messages body stands for.
func decodeMessagesBody(tk tokenizer, body []byte) (*wireBody, error) {
	w, tokens, err := decodeMessages(tk, body, false)
	if err != nil {
		return nil, err
	}
	b := &wireBody{anthropic: true, tokens: [][]uint32{tokens}, prompts: []int{len(tokens)}}
	r := &b.wireRequest
	r.Model, r.MaxTokens, r.Stream, r.Temperature, r.KVTransferParams = w.Model, w.MaxTokens, w.Stream, w.Temperature, w.KVTransferParams
	r.IgnoreEOS, r.MinTokens, r.Seed, r.Priority = w.IgnoreEOS, w.MinTokens, w.Seed, w.Priority
	return b, nil
}

// messagesChat is the chat a Messages conversation stands for, as vLLM's
// handler converts it.
func messagesChat(system json.RawMessage, msgs []anthropicMessage) ([]wireMessage, error) {
	var sys strings.Builder
	if system = bytes.TrimSpace(system); len(system) > 0 && !bytes.Equal(system, []byte("null")) { // optional
		if err := systemText(&sys, system, "system"); err != nil {
			return nil, err
		}
	}
	for i := range msgs {
		m := &msgs[i]
		switch m.Role {
		case "user", "assistant", "system":
		case "ctx", "msg":
			m.Role = "user" // what Claude Code's newer roles mean, as vLLM maps them
		default:
			return nil, badRequest("invalid_messages", "messages[%d].role %q: must be user, assistant or system", i, m.Role)
		}
		if m.Role == "system" {
			if err := systemText(&sys, m.Content, "messages["+strconv.Itoa(i)+"].content"); err != nil {
				return nil, err
			}
		}
	}
	var out []wireMessage
	if sys.Len() > 0 {
		out = append(out, textMessage("system", sys.String()))
	}
	for i, m := range msgs {
		if m.Role == "system" {
			continue
		}
		at := "messages[" + strconv.Itoa(i) + "].content"
		if s, ok, err := stringContent(m.Content, at); err != nil {
			return nil, err
		} else if ok {
			out = append(out, textMessage(m.Role, s))
			continue
		}
		blocks, err := contentBlocks(m.Content, at)
		if err != nil {
			return nil, err
		}
		var (
			text             strings.Builder
			parts            int
			calls, reasoning bool
		)
		for _, b := range blocks {
			switch b.Type {
			case "text":
				if b.Text != nil && *b.Text != "" {
					text.WriteString(*b.Text)
					parts++
				}
			case "image":
				if b.Source != nil {
					parts++ // an image part: no text in the sim's template
				}
			case "thinking":
				reasoning = reasoning || b.Thinking != nil
			case "tool_use":
				calls = true
			case "tool_result":
				result, err := resultText(b.Content)
				if err != nil {
					return nil, badRequest("invalid_messages", "%s: tool_result content: %v", at, err)
				}
				if m.Role == "user" {
					out = append(out, textMessage("tool", result))
					continue
				}
				text.WriteString("Tool result: " + result)
				parts++
			}
		}
		switch {
		case parts > 0:
			out = append(out, textMessage(m.Role, text.String()))
		case m.Role == "user" && !calls && !reasoning:
			// Nothing vLLM would send: a user turn of tool results alone is its
			// tool messages.
		default:
			out = append(out, wireMessage{Role: m.Role}) // tool calls or reasoning, no content
		}
	}
	return out, nil
}

// systemText adds a system prompt's text to sys: a string, or its text
// blocks, the billing header's left out.
func systemText(sys *strings.Builder, raw json.RawMessage, at string) error {
	if s, ok, err := stringContent(raw, at); err != nil || ok {
		sys.WriteString(s)
		return err
	}
	blocks, err := contentBlocks(raw, at)
	if err != nil {
		return err
	}
	for _, b := range blocks {
		if b.Type == "text" && b.Text != nil && !strings.HasPrefix(*b.Text, billingHeader) {
			sys.WriteString(*b.Text)
		}
	}
	return nil
}

// stringContent reads a content that is a string (ok), or reports that it
// is something else; an absent or null content is an error.
func stringContent(raw json.RawMessage, at string) (string, bool, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", false, badRequest("invalid_messages", "%s is required", at)
	}
	if raw[0] != '"' {
		return "", false, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", false, badRequest("invalid_messages", "%s: %v", at, err)
	}
	return s, true, nil
}

// contentBlocks reads a content that is a list of blocks of known types.
func contentBlocks(raw json.RawMessage, at string) ([]anthropicBlock, error) {
	var blocks []anthropicBlock
	if err := json.Unmarshal(raw, &blocks); err != nil {
		return nil, badRequest("invalid_messages", "%s: must be a string or a list of content blocks", at)
	}
	for j, b := range blocks {
		if !blockTypes[b.Type] {
			return nil, badRequest("invalid_messages", "%s[%d].type %q is not a content block type", at, j, b.Type)
		}
	}
	return blocks, nil
}

// resultText is a tool_result's content as text: a string, or its text
// items joined by line ends.
func resultText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var items []map[string]any
	if err := json.Unmarshal(raw, &items); err != nil {
		return "", errors.New("must be a string or a list of objects")
	}
	var texts []string
	for _, it := range items {
		if it["type"] == "text" {
			t, _ := it["text"].(string)
			texts = append(texts, t)
		}
	}
	return strings.Join(texts, "\n"), nil
}

// handleCountTokens is POST /v1/messages/count_tokens: the prompt tokens a
// Messages request of that conversation would have.
func (e *Engine) handleCountTokens(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		writeError(w, bodyReadError(err))
		return
	}
	m, tokens, err := decodeMessages(e.tok, body, true)
	if err == nil {
		_, err = e.resolveModel(*m.Model)
	}
	if err != nil {
		writeError(w, err)
		return
	}
	type management struct {
		OriginalInputTokens int `json:"original_input_tokens"`
	}
	answer := struct {
		InputTokens       int         `json:"input_tokens"`
		ContextManagement *management `json:"context_management"`
	}{InputTokens: len(tokens)}
	if !e.sglang() {
		answer.ContextManagement = &management{len(tokens)}
	}
	writeJSON(w, http.StatusOK, answer)
}

// Answer shapes.
type messagesAnswer struct {
	ID         string          `json:"id"`
	Type       string          `json:"type"`
	Role       string          `json:"role"`
	Content    []messagesBlock `json:"content"`
	Model      string          `json:"model"`
	StopReason *string         `json:"stop_reason,omitempty"`
	Usage      messagesUsage   `json:"usage"`
	// KVTransferParams is a prefill's, omitted when it holds nothing.
	KVTransferParams *prefillKVParams `json:"kv_transfer_params,omitempty"`
}

type messagesBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type messagesUsage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
	// CacheReadInputTokens is SGLang's: the prompt tokens its cache held.
	CacheReadInputTokens *int `json:"cache_read_input_tokens,omitempty"`
}

func (p *responder) msgUsage(complete int) messagesUsage {
	u := p.usage(complete)
	mu := messagesUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens}
	if p.e.sglang() {
		cached := p.cached
		mu.CacheReadInputTokens = &cached
	}
	return mu
}

// stopReason is a finish reason as a Messages stop_reason: nil for one that
// has none (an abort), which SGLang calls end_turn.
func (p *responder) stopReason(finish string) *string {
	var r string
	switch finish {
	case "stop":
		r = "end_turn"
	case "length":
		r = "max_tokens"
	default:
		if !p.e.sglang() {
			return nil
		}
		r = "end_turn"
	}
	return &r
}

// msgWhole writes a non-streaming Messages answer.
func (p *responder) msgWhole(aborted bool) {
	finish := p.last.finish
	if aborted {
		finish = "abort"
	}
	a := &messagesAnswer{ID: p.id, Type: "message", Role: "assistant", Content: []messagesBlock{}, Model: p.model,
		StopReason: p.stopReason(finish), Usage: p.msgUsage(p.last.complete)}
	if t := p.text.String(); t != "" {
		a.Content = append(a.Content, messagesBlock{"text", t})
	}
	if !aborted && !p.e.sglang() {
		a.KVTransferParams = p.kvParams(p.last)
	}
	p.writeBody(a, p.req)
}

// msgEvent writes one Messages SSE frame.
func (p *responder) msgEvent(typ string, fields map[string]any) error {
	fields["type"] = typ
	return p.namedEvent(typ, fields)
}

// msgBegin sends message_start, once the stream's headers are out.
func (p *responder) msgBegin() error {
	msg := map[string]any{"id": p.id, "content": []messagesBlock{}, "model": p.model}
	u := p.msgUsage(0)
	if p.e.sglang() {
		msg["type"], msg["role"] = "message", "assistant"
	} else {
		// vLLM writes the fields it set: its message has no type and role,
		// and null stop fields.
		msg["stop_reason"], msg["stop_sequence"] = nil, nil
	}
	msg["usage"] = u
	return p.msgEvent("message_start", map[string]any{"message": msg})
}

// msgEmit streams one token.
func (p *responder) msgEmit(o output) error {
	if !p.started {
		if err := p.begin(1); err != nil {
			return err
		}
	}
	if p.f.dieAfter == 0 {
		p.sentToken() // dies before the first token
	}
	if o.text != "" {
		if !p.blockOpen {
			p.blockOpen = true
			if err := p.msgEvent("content_block_start", map[string]any{"index": 0, "content_block": messagesBlock{"text", ""}}); err != nil {
				return err
			}
		}
		if err := p.msgEvent("content_block_delta", map[string]any{"index": 0, "delta": map[string]string{"type": "text_delta", "text": o.text}}); err != nil {
			return err
		}
	}
	p.sentToken()
	if o.finish == "" {
		return nil
	}
	return p.msgFinish(o.finish, o.complete)
}

// msgFinish ends a stream: the open block's stop, message_delta, message_stop.
func (p *responder) msgFinish(finish string, complete int) error {
	if p.blockOpen {
		p.blockOpen = false
		if err := p.msgEvent("content_block_stop", map[string]any{"index": 0}); err != nil {
			return err
		}
	}
	if err := p.msgEvent("message_delta", map[string]any{"delta": map[string]*string{"stop_reason": p.stopReason(finish)},
		"usage": p.msgUsage(complete)}); err != nil {
		return err
	}
	return p.msgEvent("message_stop", map[string]any{})
}

// msgError ends a stream that already began with an error event.
func (p *responder) msgError(ae *apiError) {
	b, err := json.Marshal(anthropicError(ae))
	if err != nil {
		return
	}
	frame := append([]byte("event: error\ndata: "), b...)
	_ = p.write(append(frame, "\n\n"...))
}
