package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
)

// The OpenAI Responses API as vLLM serves it: POST /v1/responses and
// GET /v1/responses/{id}. A body's input (a string, or message items with
// a role and a string or a list of input_text parts) is rendered through
// the chat template after its instructions (a system message) and, with
// previous_response_id, the input and output of that stored response: the
// prompt then hits the prefix cache and the KV events as a chat's does. It
// runs on the completions path, prefill/decode included: a body with
// kv_transfer_params.do_remote_decode is a prefill (max_output_tokens 1,
// not streamed) answering the response object with a top-level
// kv_transfer_params, and SGLang's bootstrap fields and Mooncake's
// transfer_id pair its legs as they do a chat's.
//
// store (default true, vLLM's) keeps a finished response in memory, the
// last maxStoredResponses of them, for GET /v1/responses/{id} and a later
// previous_response_id; an unknown id is vLLM's 404. Each engine stores
// what it answered, so a prefiller stores the one-token answer of a
// prefill leg under the id its decoder stores the whole answer: a next
// turn naming it renders a different conversation on each, as vLLM's
// engines would. background is refused with a 400: the sim runs a request
// only while its client waits.
//
// A stream is SSE frames "event: <type>\ndata: <json>\n\n", each with its
// type and a sequence_number from 0: response.created, response.in_progress,
// response.output_item.added, response.content_part.added, one
// response.output_text.delta per token with text, response.output_text.done,
// response.content_part.done, response.output_item.done, then
// response.completed (or response.incomplete, cut by max_output_tokens or
// aborted) with the whole response. There is no "data: [DONE]".

// maxStoredResponses bounds the responses an engine stores.
const maxStoredResponses = 1024

// wireResponses mirrors the Responses API fields the sim reads; the
// wireRequest fields that both APIs share (model, stream,
// kv_transfer_params, priority, SGLang's rid and bootstrap fields,
// ignore_eos, min_tokens) come in through the embedded struct.
type wireResponses struct {
	wireRequest
	Input              json.RawMessage `json:"input"`
	Instructions       *string         `json:"instructions"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Temperature        *float64        `json:"temperature"`
	TopP               *float64        `json:"top_p"`
	Store              *bool           `json:"store"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Background         *bool           `json:"background"`
}

// decodeResponses checks a Responses API body's shape and reads its input
// items; render tokenizes it once the previous response is known.
func decodeResponses(body []byte) (*wireBody, error) {
	var w wireResponses
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&w); err != nil {
		return nil, badRequest("invalid_json", "request body is not a valid JSON object: %v", err)
	}
	if dec.More() {
		return nil, badRequest("invalid_json", "request body has trailing data after the JSON object")
	}
	meta := &responsesMeta{instructions: w.Instructions, prevID: w.PreviousResponseID, store: true, temperature: 1, topP: 1, maxOutput: w.MaxOutputTokens, input: w.Input}
	if w.Store != nil {
		meta.store = *w.Store
	}
	if w.Background != nil {
		meta.background = *w.Background
	}
	if w.Temperature != nil {
		meta.temperature = *w.Temperature
	}
	if w.TopP != nil {
		meta.topP = *w.TopP
	}
	if _, err := responseInput(w.Input); err != nil {
		return nil, err
	}
	b := &wireBody{wireRequest: w.wireRequest, resp: meta}
	b.Temperature = w.Temperature // greedy: tokens by prefix, as for chat
	// Chat's and completions' own fields are no Responses API fields.
	b.Prompt, b.Messages, b.MaxCompletionTokens, b.N, b.BestOf = nil, nil, nil, nil, nil
	b.MaxTokens = w.MaxOutputTokens
	return b, nil
}

// responseInput reads input: a string (one user message) or message items.
func responseInput(raw json.RawMessage) ([]wireMessage, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, badRequest("missing_input", "input is required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []wireMessage{textMessage("user", s)}, nil
	}
	var items []struct {
		Type    string          `json:"type"`
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &items); err != nil || len(items) == 0 {
		return nil, badRequest("invalid_input", "input must be a string or a non-empty list of message items")
	}
	out := make([]wireMessage, len(items))
	for i, it := range items {
		if it.Type != "" && it.Type != "message" {
			return nil, badRequest("invalid_input", "input[%d]: item type %q: the sim takes message items only", i, it.Type)
		}
		if it.Role == "" {
			return nil, badRequest("invalid_input", "input[%d]: role is required", i)
		}
		if _, err := contentText(it.Content); err != nil {
			return nil, badRequest("invalid_input", "input[%d].content: %v", i, err)
		}
		out[i] = wireMessage{Role: it.Role, Content: it.Content}
	}
	return out, nil
}

func textMessage(role, text string) wireMessage {
	c, _ := json.Marshal(text) // a string always marshals
	return wireMessage{Role: role, Content: c}
}

// render resolves a Responses API body's conversation and tokenizes it:
// the previous response's (vLLM's 404 when this engine has not stored
// it), then the input, the instructions first.
func (b *wireBody) render(tk tokenizer, store *responseStore) error {
	m := b.resp
	input, err := responseInput(m.input)
	if err != nil {
		return err
	}
	if m.background {
		return badRequest("unsupported_background", "background is not supported: the sim runs a response only while its client waits")
	}
	if m.prevID != nil {
		prev, ok := store.get(*m.prevID)
		if !ok {
			return &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", numeric: true,
				Message: fmt.Sprintf("Response with id '%s' not found.", *m.prevID)}
		}
		m.history = append(m.history, prev.history...)
	}
	m.history = append(m.history, input...)
	msgs := m.history
	if m.instructions != nil {
		msgs = append([]wireMessage{textMessage("system", *m.instructions)}, msgs...)
	}
	t, err := chatPrompt(tk, msgs, true)
	if err != nil {
		return err
	}
	b.tokens, b.prompts = [][]uint32{t}, []int{len(t)}
	return nil
}

// storedResponse is one finished response and the conversation it ends.
type storedResponse struct {
	obj     *responseObject
	history []wireMessage
}

// responseStore keeps the last max stored responses, shared by an engine's ranks.
type responseStore struct {
	mu    sync.Mutex
	max   int
	byID  map[string]storedResponse
	order []string // oldest first
}

func newResponseStore(max int) *responseStore {
	return &responseStore{max: max, byID: make(map[string]storedResponse)}
}

func (s *responseStore) get(id string) (storedResponse, bool) {
	if s == nil {
		return storedResponse{}, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.byID[id]
	return r, ok
}

func (s *responseStore) put(id string, r storedResponse) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.byID[id]; !ok {
		s.order = append(s.order, id)
	}
	s.byID[id] = r
	for len(s.order) > s.max {
		delete(s.byID, s.order[0])
		s.order = s.order[1:]
	}
}

// handleGetResponse is GET /v1/responses/{id}.
func (e *Engine) handleGetResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	got, ok := e.store.get(id)
	if !ok {
		writeError(w, &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", numeric: true,
			Message: fmt.Sprintf("Response with id '%s' not found.", id)})
		return
	}
	writeJSON(w, http.StatusOK, got.obj)
}

// Response shapes: the OpenAI Responses API's, as vLLM fills them.
type responseObject struct {
	ID                 string             `json:"id"`
	Object             string             `json:"object"`
	CreatedAt          int64              `json:"created_at"`
	Model              string             `json:"model"`
	Status             string             `json:"status"`
	Output             []responseItem     `json:"output"`
	Usage              *responseUsage     `json:"usage"`
	Error              *json.RawMessage   `json:"error"`
	IncompleteDetails  *incompleteDetails `json:"incomplete_details"`
	Instructions       *string            `json:"instructions"`
	MaxOutputTokens    *int               `json:"max_output_tokens"`
	PreviousResponseID *string            `json:"previous_response_id"`
	ParallelToolCalls  bool               `json:"parallel_tool_calls"`
	ToolChoice         string             `json:"tool_choice"`
	Tools              []struct{}         `json:"tools"`
	Temperature        float64            `json:"temperature"`
	TopP               float64            `json:"top_p"`
	Background         bool               `json:"background"`
	ServiceTier        string             `json:"service_tier"`
	Truncation         string             `json:"truncation"`
	Store              bool               `json:"store"`
	Metadata           map[string]string  `json:"metadata"`
	// KVTransferParams is nil (omitted) in stream events; a whole answer
	// sets a *prefillKVParams, null when the engine holds nothing.
	KVTransferParams any `json:"kv_transfer_params,omitempty"`
}

type responseItem struct {
	Type    string         `json:"type"`
	ID      string         `json:"id"`
	Role    string         `json:"role"`
	Status  string         `json:"status"`
	Content []responsePart `json:"content"`
}

type responsePart struct {
	Type        string     `json:"type"`
	Text        string     `json:"text"`
	Annotations []struct{} `json:"annotations"`
}

type responseUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

type incompleteDetails struct {
	Reason string `json:"reason"`
}

// respStatus is a response's status for how its request finished.
func respStatus(finish string, aborted bool) (string, *incompleteDetails) {
	switch {
	case aborted:
		return "cancelled", nil
	case finish == "length":
		return "incomplete", &incompleteDetails{Reason: "max_output_tokens"}
	}
	return "completed", nil
}

func (p *responder) itemID() string { return "msg_" + p.rid }

// respObject is the response as it stands: status, the text so far.
func (p *responder) respObject(status string, details *incompleteDetails, complete int, done bool) *responseObject {
	m := p.api.resp
	o := &responseObject{
		ID: p.id, Object: "response", CreatedAt: p.created, Model: p.model, Status: status,
		Output: []responseItem{}, IncompleteDetails: details, Instructions: m.instructions,
		MaxOutputTokens: m.maxOutput, PreviousResponseID: m.prevID, ParallelToolCalls: true,
		ToolChoice: "auto", Tools: []struct{}{}, Temperature: m.temperature, TopP: m.topP,
		ServiceTier: "auto", Truncation: "disabled", Store: m.store, Metadata: map[string]string{},
	}
	if done {
		o.Output = []responseItem{p.respItem("completed")}
		u := p.usage(complete)
		o.Usage = &responseUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, TotalTokens: u.TotalTokens}
		o.Usage.InputTokensDetails.CachedTokens = p.cached
	}
	return o
}

func (p *responder) respItem(status string) responseItem {
	it := responseItem{Type: "message", ID: p.itemID(), Role: "assistant", Status: status, Content: []responsePart{}}
	if status == "completed" {
		it.Content = []responsePart{p.respPart()}
	}
	return it
}

func (p *responder) respPart() responsePart {
	return responsePart{Type: "output_text", Text: p.text.String(), Annotations: []struct{}{}}
}

// respEvent writes one Responses API SSE frame.
func (p *responder) respEvent(typ string, fields map[string]any) error {
	fields["type"] = typ
	fields["sequence_number"] = p.seq
	p.seq++
	return p.namedEvent(typ, fields)
}

// namedEvent writes one SSE frame with an event name, as the Responses and Messages streams
// have: "event: typ", then fields as its data.
func (p *responder) namedEvent(typ string, fields map[string]any) error {
	b, err := json.Marshal(fields)
	if err != nil {
		return err
	}
	buf := make([]byte, 0, len(b)+len(typ)+16)
	buf = append(buf, "event: "...)
	buf = append(buf, typ...)
	buf = append(buf, "\ndata: "...)
	buf = append(buf, b...)
	buf = append(buf, "\n\n"...)
	return p.write(buf)
}

// respBegin sends the events that open a stream, once its headers are out.
func (p *responder) respBegin() error {
	inProgress := p.respObject("in_progress", nil, 0, false)
	for _, ev := range []struct {
		typ    string
		fields map[string]any
	}{
		{"response.created", map[string]any{"response": inProgress}},
		{"response.in_progress", map[string]any{"response": inProgress}},
		{"response.output_item.added", map[string]any{"output_index": 0, "item": p.respItem("in_progress")}},
		{"response.content_part.added", map[string]any{"item_id": p.itemID(), "output_index": 0, "content_index": 0,
			"part": responsePart{Type: "output_text", Annotations: []struct{}{}}}},
	} {
		if err := p.respEvent(ev.typ, ev.fields); err != nil {
			return err
		}
	}
	return nil
}

// respEmit streams one token.
func (p *responder) respEmit(o output) error {
	if !p.started {
		if err := p.begin(1); err != nil {
			return err
		}
	}
	p.text.WriteString(o.text)
	if o.text != "" {
		if err := p.respEvent("response.output_text.delta", map[string]any{"item_id": p.itemID(), "output_index": 0,
			"content_index": 0, "delta": o.text, "logprobs": []struct{}{}}); err != nil {
			return err
		}
	}
	if o.finish == "" {
		return nil
	}
	return p.respFinish(o.finish, o.complete, false)
}

// respFinish ends a stream: the done events, then the whole response.
func (p *responder) respFinish(finish string, complete int, aborted bool) error {
	status, details := respStatus(finish, aborted)
	obj := p.respObject(status, details, complete, true)
	part := p.respPart()
	for _, ev := range []struct {
		typ    string
		fields map[string]any
	}{
		{"response.output_text.done", map[string]any{"item_id": p.itemID(), "output_index": 0, "content_index": 0,
			"text": part.Text, "logprobs": []struct{}{}}},
		{"response.content_part.done", map[string]any{"item_id": p.itemID(), "output_index": 0, "content_index": 0, "part": part}},
		{"response.output_item.done", map[string]any{"output_index": 0, "item": obj.Output[0]}},
	} {
		if err := p.respEvent(ev.typ, ev.fields); err != nil {
			return err
		}
	}
	typ := "response.completed"
	if status != "completed" {
		typ = "response.incomplete"
	}
	p.keep(obj)
	return p.respEvent(typ, map[string]any{"response": obj})
}

// respWhole writes a non-streaming response.
func (p *responder) respWhole(aborted bool) {
	status, details := respStatus(p.last.finish, aborted)
	obj := p.respObject(status, details, p.last.complete, true)
	obj.KVTransferParams = (*prefillKVParams)(nil)
	if !aborted {
		obj.KVTransferParams = p.kvParams(p.last)
	}
	if p.e.sglang() {
		obj.KVTransferParams = nil // SGLang answers no such field
	}
	p.keep(obj)
	p.writeBody(obj, p.req)
}

// keep stores a finished response, when its request asked for it.
func (p *responder) keep(obj *responseObject) {
	m := p.api.resp
	if !m.store || obj.Status == "cancelled" {
		return
	}
	stored := *obj
	stored.KVTransferParams = nil
	history := append(append([]wireMessage{}, m.history...), textMessage("assistant", p.text.String()))
	p.e.store.put(p.id, storedResponse{obj: &stored, history: history})
}

// respError reports an error in a stream that already started, as vLLM's
// Responses API does: an error event.
func (p *responder) respError(ae *apiError) {
	_ = p.respEvent("error", map[string]any{"code": ae.Code, "message": ae.Message, "param": nullable(ae.Param)})
}
