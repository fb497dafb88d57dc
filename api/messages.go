package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/pdproxy/pdproxy/engine"
)

// Anthropic's Messages API (POST /v1/messages), as vLLM and SGLang serve it: a system prompt
// beside the messages, content as blocks (text, images, tool calls and their results,
// thinking), max_tokens required, and a stream of typed events (message_start,
// content_block_*, message_delta, message_stop) with no [DONE].
//
// vLLM's handler takes kv_transfer_params beside the Anthropic members and answers with them,
// so on vLLM (NIXL or Mooncake) the route is served natively through the P/D flow of chat:
// the prefill bounded by max_tokens 1, the decode carrying the prefiller's params. SGLang's
// handler knows no bootstrap fields: on SGLang a Messages request goes to the engines as the
// chat completion it stands for (toChat), and the answer comes back translated (anthropic.go).
// Either way the conversation is read the way the engines render it, as chat messages: what
// cache-aware routing matches and what /tokenize is asked.

// MessagesRoute and CountTokensRoute are the Messages API's routes.
const (
	MessagesRoute    = "/v1/messages"
	CountTokensRoute = "/v1/messages/count_tokens"
)

// billingHeader starts a system block that some coding agents add to every request with a
// hash of its own: it would make every request's prompt differ from its first tokens on, so
// neither the engines' prefix caches nor routing could reuse a thing. It is left out of the
// rendered conversation, as vLLM's handler leaves it out.
const billingHeader = "x-anthropic-billing-header"

// anthropicMessage is one message of a Messages request.
type anthropicMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// anthropicBlock is a content block, every kind's members in one struct.
type anthropicBlock struct {
	Type      string          `json:"type"`
	Text      *string         `json:"text"`
	Source    *imageSource    `json:"source"`
	ID        string          `json:"id"`
	Name      string          `json:"name"`
	Input     json.RawMessage `json:"input"`
	ToolUseID string          `json:"tool_use_id"`
	Content   json.RawMessage `json:"content"`
	Thinking  *string         `json:"thinking"`
}

type imageSource struct {
	Type      string `json:"type"`
	MediaType string `json:"media_type"`
	Data      string `json:"data"`
	URL       string `json:"url"`
}

// anthropicTool is a tool the model may call.
type anthropicTool struct {
	Name        string          `json:"name"`
	Description *string         `json:"description"`
	InputSchema json.RawMessage `json:"input_schema"`
}

// blockTypes are the content blocks the engines take.
var blockTypes = map[string]bool{"text": true, "image": true, "tool_use": true, "tool_result": true, "thinking": true,
	"redacted_thinking": true, "tool_reference": true, "document": true}

// ParseMessages validates a Messages API body, and renders its conversation as chat
// messages. Errors name the field.
func ParseMessages(body []byte) (*Request, *Error) {
	req, e := parseGeneration(body)
	if e != nil {
		return nil, e
	}
	req.API = engine.APIMessages
	req.Prompts = 1
	f := req.Fields
	if _, ok, e := CountField(f, "max_tokens", 1); e != nil {
		return nil, e
	} else if !ok {
		return nil, BadRequest("max_tokens", "max_tokens is required")
	}
	for _, name := range []string{"temperature", "top_p"} {
		if e := numberField(f, name); e != nil {
			return nil, e
		}
	}
	if _, _, e := CountField(f, "top_k", 0); e != nil {
		return nil, e
	}
	stops, e := stopSequences(f)
	if e != nil {
		return nil, e
	}
	system, e := systemText(f)
	if e != nil {
		return nil, e
	}
	msgs, e := anthropicMessages(f)
	if e != nil {
		return nil, e
	}
	tools, e := anthropicTools(f)
	if e != nil {
		return nil, e
	}
	if e := toolChoice(f); e != nil {
		return nil, e
	}
	if e := thinking(f); e != nil {
		return nil, e
	}
	chat, e := chatMessages(system, msgs)
	if e != nil {
		return nil, e
	}
	rendered, err := json.Marshal(chat)
	if err != nil {
		return nil, NewError(KindInternal, "the conversation could not be rendered").With("", err, 0)
	}
	// The conversation as the engines render it grows at its end turn after turn, as a
	// chat's messages array does: what a cache-aware policy matches, and what the engine's
	// /tokenize renders.
	req.Text, req.Messages = string(rendered), rendered
	req.TurnEnds = messageEnds(req.Text, maxTurnEnds)
	req.Key.Media = messagesHaveMedia(rendered)
	req.Prefix = system
	if req.Prefix == "" && len(chat) > 0 {
		req.Prefix = chat[0].text()
	}
	req.Anthropic = &anthropicRequest{Tools: tools, Stops: stops}
	return req, nil
}

// anthropicRequest is what a Messages request needs to go to an engine as a chat completion.
type anthropicRequest struct {
	Tools []anthropicTool
	Stops []string
}

func stopSequences(f object) ([]string, *Error) {
	raw, ok := f.Field("stop_sequences")
	if !ok || isNull(raw) {
		return nil, nil
	}
	var stops []string
	if raw[0] != '[' || json.Unmarshal(raw, &stops) != nil {
		return nil, BadRequest("stop_sequences", "stop_sequences must be an array of strings")
	}
	return stops, nil
}

// systemText is the system prompt: a string, or text blocks, joined.
func systemText(f object) (string, *Error) {
	raw, ok := f.Field("system")
	if !ok || isNull(raw) {
		return "", nil
	}
	var s string
	if raw[0] == '"' {
		if decodeString(raw, &s) != nil {
			return "", BadRequest("system", "system must be a string or an array of text blocks")
		}
		return s, nil
	}
	var blocks []anthropicBlock
	if json.Unmarshal(raw, &blocks) != nil {
		return "", BadRequest("system", "system must be a string or an array of text blocks")
	}
	var b strings.Builder
	for i, bl := range blocks {
		if bl.Type != "text" || bl.Text == nil {
			return "", BadRequest(fmt.Sprintf("system[%d]", i), fmt.Sprintf("system[%d] must be a text block with its text", i))
		}
		if strings.HasPrefix(*bl.Text, billingHeader) {
			continue
		}
		b.WriteString(*bl.Text)
	}
	return b.String(), nil
}

func anthropicMessages(f object) ([]anthropicMessage, *Error) {
	raw, ok := f.Field("messages")
	if !ok || isNull(raw) {
		return nil, BadRequest("messages", "messages is required")
	}
	var msgs []anthropicMessage
	if raw[0] != '[' || json.Unmarshal(raw, &msgs) != nil {
		return nil, BadRequest("messages", "messages must be an array of message objects, each with a role and a content")
	}
	if len(msgs) == 0 {
		return nil, BadRequest("messages", "messages must not be empty")
	}
	for i, m := range msgs {
		at := fmt.Sprintf("messages[%d]", i)
		switch m.Role {
		case "user", "assistant", "system":
		case "":
			return nil, BadRequest(at+".role", at+".role is required: user or assistant")
		default:
			return nil, BadRequest(at+".role", fmt.Sprintf("%s.role %q is not user or assistant", at, m.Role))
		}
		if len(m.Content) == 0 || isNull(m.Content) {
			return nil, BadRequest(at+".content", at+".content is required")
		}
		if m.Content[0] == '"' {
			continue
		}
		var blocks []anthropicBlock
		if m.Content[0] != '[' || json.Unmarshal(m.Content, &blocks) != nil {
			return nil, BadRequest(at+".content", at+".content must be a string or an array of content blocks")
		}
		for j, b := range blocks {
			bat := fmt.Sprintf("%s.content[%d]", at, j)
			if !blockTypes[b.Type] {
				return nil, BadRequest(bat+".type", fmt.Sprintf("%s.type %q is not a content block type (text, image, tool_use, tool_result, thinking)", bat, b.Type))
			}
			switch {
			case b.Type == "text" && b.Text == nil:
				return nil, BadRequest(bat+".text", bat+".text is required")
			case b.Type == "tool_use" && (b.ID == "" || b.Name == ""):
				return nil, BadRequest(bat, bat+" is a tool_use block without its id and name")
			case b.Type == "tool_use" && len(b.Input) > 0 && b.Input[0] != '{' && !isNull(b.Input):
				return nil, BadRequest(bat+".input", bat+".input must be an object")
			case b.Type == "tool_result" && b.ToolUseID == "":
				return nil, BadRequest(bat+".tool_use_id", bat+".tool_use_id is required")
			case b.Type == "image" && b.Source == nil:
				return nil, BadRequest(bat+".source", bat+".source is required")
			}
		}
	}
	return msgs, nil
}

func anthropicTools(f object) ([]anthropicTool, *Error) {
	raw, ok := f.Field("tools")
	if !ok || isNull(raw) {
		return nil, nil
	}
	var tools []anthropicTool
	if raw[0] != '[' || json.Unmarshal(raw, &tools) != nil {
		return nil, BadRequest("tools", "tools must be an array of tool objects")
	}
	for i, t := range tools {
		if t.Name == "" {
			return nil, BadRequest(fmt.Sprintf("tools[%d].name", i), fmt.Sprintf("tools[%d].name is required", i))
		}
		if len(t.InputSchema) > 0 && t.InputSchema[0] != '{' && !isNull(t.InputSchema) {
			return nil, BadRequest(fmt.Sprintf("tools[%d].input_schema", i), fmt.Sprintf("tools[%d].input_schema must be an object", i))
		}
	}
	return tools, nil
}

func toolChoice(f object) *Error {
	raw, ok := f.Field("tool_choice")
	if !ok || isNull(raw) {
		return nil
	}
	var tc struct {
		Type string `json:"type"`
		Name string `json:"name"`
	}
	if raw[0] != '{' || json.Unmarshal(raw, &tc) != nil {
		return BadRequest("tool_choice", "tool_choice must be an object")
	}
	switch tc.Type {
	case "auto", "any", "none":
	case "tool":
		if tc.Name == "" {
			return BadRequest("tool_choice.name", "tool_choice.name is required when its type is tool")
		}
	default:
		return BadRequest("tool_choice.type", "tool_choice.type must be auto, any, tool or none")
	}
	return nil
}

func thinking(f object) *Error {
	raw, ok := f.Field("thinking")
	if !ok || isNull(raw) {
		return nil
	}
	var th struct {
		Type string `json:"type"`
	}
	if raw[0] != '{' || json.Unmarshal(raw, &th) != nil || th.Type != "enabled" && th.Type != "disabled" && th.Type != "adaptive" {
		return BadRequest("thinking", "thinking must be an object whose type is enabled or disabled")
	}
	return nil
}

// chatMessage is one message of the chat rendering of a Messages request. Its members are
// written in a fixed order, so that one conversation always renders to the same bytes.
type chatMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content,omitempty"`
	Reasoning  string          `json:"reasoning_content,omitempty"`
	ToolCalls  []chatToolCall  `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
}

// text is the message's content when it is a string.
func (m chatMessage) text() string {
	var s string
	if decodeString(m.Content, &s) != nil {
		return string(m.Content)
	}
	return s
}

type chatToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// chatPart is a content part of a chat message: text, or an image by URL.
type chatPart struct {
	Type     string `json:"type"`
	Text     string `json:"text,omitempty"`
	ImageURL *struct {
		URL string `json:"url"`
	} `json:"image_url,omitempty"`
}

// chatMessages renders a Messages request's conversation as chat messages: the system prompt
// (the top-level one, then any message with the system role) as one system message; then each
// message in order, its text and images as content, its thinking as reasoning, its tool_use
// blocks as tool calls, and each tool_result as a message of role tool after it.
func chatMessages(system string, msgs []anthropicMessage) ([]chatMessage, *Error) {
	var out []chatMessage
	sys := system
	for _, m := range msgs {
		if m.Role != "system" {
			continue
		}
		t, e := plainText(m.Content)
		if e != nil {
			return nil, e
		}
		sys += t
	}
	if sys != "" {
		out = append(out, chatMessage{Role: "system", Content: jsonString(sys)})
	}
	for _, m := range msgs {
		if m.Role == "system" {
			continue
		}
		if m.Content[0] == '"' {
			out = append(out, chatMessage{Role: m.Role, Content: m.Content})
			continue
		}
		var blocks []anthropicBlock
		json.Unmarshal(m.Content, &blocks) // checked by anthropicMessages
		msg := chatMessage{Role: m.Role}
		var parts []chatPart
		var results []chatMessage
		for _, b := range blocks {
			switch b.Type {
			case "text":
				parts = append(parts, chatPart{Type: "text", Text: *b.Text})
			case "image":
				p := chatPart{Type: "image_url", ImageURL: &struct {
					URL string `json:"url"`
				}{imageURL(b.Source)}}
				parts = append(parts, p)
			case "thinking":
				if b.Thinking != nil {
					msg.Reasoning += *b.Thinking
				}
			case "tool_use":
				var tc chatToolCall
				tc.ID, tc.Type, tc.Function.Name = b.ID, "function", b.Name
				tc.Function.Arguments = "{}"
				if len(b.Input) > 0 && !isNull(b.Input) {
					var compact bytes.Buffer
					if json.Compact(&compact, b.Input) == nil {
						tc.Function.Arguments = compact.String()
					}
				}
				msg.ToolCalls = append(msg.ToolCalls, tc)
			case "tool_result":
				t, e := plainText(b.Content)
				if e != nil {
					return nil, e
				}
				if m.Role != "user" {
					parts = append(parts, chatPart{Type: "text", Text: "Tool result: " + t})
					continue
				}
				results = append(results, chatMessage{Role: "tool", ToolCallID: b.ToolUseID, Content: jsonString(t)})
			}
		}
		out = append(out, results...)
		switch {
		case len(parts) == 1 && parts[0].Type == "text":
			msg.Content = jsonString(parts[0].Text)
		case len(parts) > 0:
			msg.Content, _ = json.Marshal(parts)
		case len(msg.ToolCalls) == 0 && msg.Reasoning == "":
			continue // a user turn of tool results alone is its tool messages
		}
		out = append(out, msg)
	}
	if len(out) == 0 {
		return nil, BadRequest("messages", "messages hold no content to answer")
	}
	return out, nil
}

// plainText is a string content, or the text of its text blocks, joined by line ends.
func plainText(raw json.RawMessage) (string, *Error) {
	if len(raw) == 0 || isNull(raw) {
		return "", nil
	}
	var s string
	if raw[0] == '"' {
		decodeString(raw, &s)
		return s, nil
	}
	var blocks []anthropicBlock
	if json.Unmarshal(raw, &blocks) != nil {
		return "", BadRequest("content", "a tool result's content must be a string or an array of content blocks")
	}
	var texts []string
	for _, b := range blocks {
		if b.Type == "text" && b.Text != nil {
			texts = append(texts, *b.Text)
		}
	}
	return strings.Join(texts, "\n"), nil
}

func imageURL(s *imageSource) string {
	if s.Type == "url" {
		return s.URL
	}
	mt := s.MediaType
	if mt == "" {
		mt = "image/jpeg"
	}
	return "data:" + mt + ";base64," + s.Data
}

func jsonString(s string) json.RawMessage {
	b, _ := json.Marshal(s)
	return b
}

// anthropicOnly are the Messages API's own members, which a chat completion spells another
// way or has not.
var anthropicOnly = []string{"system", "messages", "stop_sequences", "tools", "tool_choice", "thinking", "metadata",
	"stream", "max_tokens", "output_config", "kv_transfer_params", "container", "mcp_servers", "service_tier", "cache_control",
	"speed", "diagnostics", "inference_geo", "context_management"}

// ToChat is the chat completion a Messages request stands for, for an engine whose Messages
// handler cannot take part in P/D: the conversation as chatMessages renders it, max_tokens,
// stop_sequences as stop, the tools as functions and tool_choice as chat's, thinking as the
// chat template's enable_thinking, metadata.user_id as user; a stream asks for its usage.
// Every other member (sampling, and the engines' own extensions) passes as it came.
func (req *Request) ToChat() (*engine.Fields, error) {
	f := req.Fields
	set := []engine.Member{{Key: "messages", Val: req.Messages}}
	maxTokens, _ := f.Field("max_tokens")
	set = append(set, engine.Member{Key: "max_tokens", Val: maxTokens})
	if raw, ok := f.Field("stop_sequences"); ok && !isNull(raw) {
		set = append(set, engine.Member{Key: "stop", Val: raw})
	}
	if len(req.Anthropic.Tools) > 0 {
		type function struct {
			Name        string          `json:"name"`
			Description *string         `json:"description,omitempty"`
			Parameters  json.RawMessage `json:"parameters,omitempty"`
		}
		type tool struct {
			Type     string   `json:"type"`
			Function function `json:"function"`
		}
		tools := make([]tool, len(req.Anthropic.Tools))
		for i, t := range req.Anthropic.Tools {
			tools[i] = tool{"function", function{t.Name, t.Description, t.InputSchema}}
		}
		raw, err := json.Marshal(tools)
		if err != nil {
			return nil, err
		}
		set = append(set, engine.Member{Key: "tools", Val: raw})
	}
	if raw, ok := f.Field("tool_choice"); ok && !isNull(raw) {
		var tc struct {
			Type string `json:"type"`
			Name string `json:"name"`
		}
		json.Unmarshal(raw, &tc) // checked by toolChoice
		var v []byte
		switch tc.Type {
		case "auto":
			v = []byte(`"auto"`)
		case "any":
			v = []byte(`"required"`)
		case "none":
			v = []byte(`"none"`)
		case "tool":
			v, _ = json.Marshal(map[string]any{"type": "function", "function": map[string]string{"name": tc.Name}})
		}
		set = append(set, engine.Member{Key: "tool_choice", Val: v})
	}
	if raw, ok := f.Field("thinking"); ok && !isNull(raw) {
		var th struct {
			Type string `json:"type"`
		}
		json.Unmarshal(raw, &th)
		on := []byte("false")
		if th.Type != "disabled" {
			on = []byte("true")
		}
		if _, has := f.Field("chat_template_kwargs"); !has {
			set = append(set, engine.Member{Key: "chat_template_kwargs", Val: append(append([]byte(`{"enable_thinking":`), on...), '}')})
		}
	}
	if raw, ok := f.Field("metadata"); ok && !isNull(raw) {
		var md struct {
			UserID string `json:"user_id"`
		}
		if json.Unmarshal(raw, &md) == nil && md.UserID != "" {
			if _, has := f.Field("user"); !has {
				set = append(set, engine.Member{Key: "user", Val: jsonString(md.UserID)})
			}
		}
	}
	if req.Stream {
		set = append(set, engine.Member{Key: "stream", Val: []byte("true")},
			engine.Member{Key: "stream_options", Val: []byte(`{"include_usage":true}`)})
	}
	return engine.ParseFields(f.Edit(append(anthropicOnly[:len(anthropicOnly):len(anthropicOnly)], "stream_options"), set...))
}
