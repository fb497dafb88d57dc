package sim

import (
	"bytes"
	"encoding/json"
)

// vLLM's token-in route, POST /inference/v1/generate (vllm/entrypoints/serve/disagg: the
// GenerateRequest and GenerateResponse models, ServingTokens): the prompt as token ids, the
// sampling parameters in an object of their own, kv_transfer_params, stream, stream_options,
// cache_salt and priority at the top. An answer carries token ids, no text:
//
//	{"request_id", "created", "model", "choices": [{"index", "logprobs", "finish_reason",
//	  "token_ids"}], "usage", "prompt_logprobs", "kv_transfer_params"}
//
// and a stream one event per token, {"request_id", "choices": [{..., "token_ids": [id]}],
// "usage": null}, the usage in an event of its own with no choice when stream_options asks,
// then [DONE]; an error during the stream is an {"error": ...} event before the [DONE]. The
// request's id is "generate-tokens-" and the X-Request-Id. The sim serves it under the vllm
// and mooncake protocols, with one sample (n 1) per request; SGLang has no such route.

// generateRoute is the token-in route's path.
const generateRoute = "/inference/v1/generate"

// wireGenerate mirrors the members of a generate body the sim reads.
type wireGenerate struct {
	Model          *string       `json:"model"`
	TokenIDs       []int64       `json:"token_ids"`
	SamplingParams *wireSampling `json:"sampling_params"`
	Stream         *bool         `json:"stream"`
	StreamOptions  *struct {
		IncludeUsage *bool `json:"include_usage"`
	} `json:"stream_options"`
	CacheSalt        *string           `json:"cache_salt"`
	Priority         *int              `json:"priority"`
	KVTransferParams *kvTransferParams `json:"kv_transfer_params"`
}

// wireSampling mirrors the members of vLLM's SamplingParams the sim reads.
type wireSampling struct {
	MaxTokens      *int            `json:"max_tokens"`
	MinTokens      *int            `json:"min_tokens"`
	IgnoreEOS      *bool           `json:"ignore_eos"`
	N              *int            `json:"n"`
	Temperature    *float64        `json:"temperature"`
	Seed           *int64          `json:"seed"`
	Logprobs       json.RawMessage `json:"logprobs"`
	PromptLogprobs json.RawMessage `json:"prompt_logprobs"`
}

// decodeGenerate decodes a generate body into the completion of its token ids it stands for,
// checking what vLLM's request model checks before the handler: token_ids present, not empty,
// no id negative; sampling_params present.
func decodeGenerate(body []byte) (*wireBody, error) {
	var g wireGenerate
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&g); err != nil {
		return nil, badRequest("invalid_json", "request body is not a valid JSON object: %v", err)
	}
	if dec.More() {
		return nil, badRequest("invalid_json", "request body has trailing data after the JSON object")
	}
	if len(g.TokenIDs) == 0 {
		return nil, badRequest("invalid_token_ids", "token_ids: a list of at least 1 token id is required")
	}
	ids := make([]uint32, len(g.TokenIDs))
	for i, id := range g.TokenIDs {
		if id < 0 || id > 1<<32-1 {
			return nil, badRequest("invalid_token_ids", "token_ids must not contain negative values")
		}
		ids[i] = uint32(id)
	}
	if g.SamplingParams == nil {
		return nil, badRequest("missing_sampling_params", "sampling_params is required")
	}
	if g.CacheSalt != nil && *g.CacheSalt == "" {
		return nil, badRequest("invalid_cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
	}
	sp := g.SamplingParams
	b := &wireBody{generate: true, prompts: []int{len(ids)}, tokens: [][]uint32{ids}}
	b.wireRequest = wireRequest{Model: g.Model, MaxTokens: sp.MaxTokens, MinTokens: sp.MinTokens, IgnoreEOS: sp.IgnoreEOS,
		Stream: g.Stream, N: sp.N, PromptLogprobs: sp.PromptLogprobs, Logprobs: sp.Logprobs, KVTransferParams: g.KVTransferParams,
		Priority: g.Priority, CacheSalt: g.CacheSalt, Temperature: sp.Temperature, Seed: sp.Seed}
	if g.StreamOptions != nil {
		b.StreamOptions = &struct {
			IncludeUsage *bool `json:"include_usage"`
		}{g.StreamOptions.IncludeUsage}
	}
	if sp.N != nil && *sp.N != 1 {
		return nil, badRequest("invalid_n", "sampling_params.n=%d: the sim serves one sample per generate request", *sp.N)
	}
	return b, nil
}

// genChoice is one choice of a generate answer or stream event.
type genChoice struct {
	Index        int      `json:"index"`
	Logprobs     any      `json:"logprobs"`
	FinishReason *string  `json:"finish_reason"`
	TokenIDs     []uint32 `json:"token_ids"`
}

// genEvent is one event of a generate stream: a token's (usage null), or the last one, the
// usage with no choice.
type genEvent struct {
	RequestID string      `json:"request_id"`
	Choices   []genChoice `json:"choices"`
	Usage     *usage      `json:"usage"`
}

// genAnswer is a whole generate answer.
type genAnswer struct {
	RequestID        string      `json:"request_id"`
	Created          int64       `json:"created"`
	Model            string      `json:"model"`
	Choices          []genChoice `json:"choices"`
	Usage            *usage      `json:"usage"`
	PromptLogprobs   any         `json:"prompt_logprobs"`
	KVTransferParams any         `json:"kv_transfer_params"`
}

// genEmit streams one output of a generate request: a token's event (the finish_reason on
// the last token's), and after the last one the stream's end.
func (p *responder) genEmit(o output) error {
	if !p.started {
		if err := p.begin(1); err != nil {
			return err
		}
	}
	var finish *string
	if o.finish != "" {
		finish = &o.finish
	}
	if p.f.dieAfter == 0 {
		p.sentToken() // dies before the first token
	}
	if err := p.event(genEvent{RequestID: p.id, Choices: []genChoice{{FinishReason: finish, TokenIDs: []uint32{o.id}}}}); err != nil {
		return err
	}
	p.sentToken()
	if o.finish == "" {
		return nil
	}
	return p.genDone(o.complete)
}

// genDone ends a generate stream: the usage event if asked for, then [DONE].
func (p *responder) genDone(completionTokens int) error {
	if p.api.includeUsage {
		if err := p.event(genEvent{RequestID: p.id, Choices: []genChoice{}, Usage: p.usage(completionTokens)}); err != nil {
			return err
		}
	}
	return p.write([]byte("data: [DONE]\n\n"))
}

// genWhole writes a generate answer, or the end of an aborted stream (vLLM sends no event for
// an output without new tokens: the stream just ends).
func (p *responder) genWhole(finish string, aborted bool) {
	if p.api.stream {
		if p.started || p.begin(1) == nil {
			_ = p.genDone(p.last.complete)
		}
		return
	}
	a := &genAnswer{RequestID: p.id, Created: p.created, Model: p.model, Usage: p.usage(p.last.complete),
		Choices: []genChoice{{FinishReason: &finish, TokenIDs: append([]uint32{}, p.ids...)}}}
	if !aborted {
		if kv := p.kvParams(p.last); kv != nil {
			a.KVTransferParams = kv
		}
	}
	p.writeBody(a, p.req)
}
