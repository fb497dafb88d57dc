package sim

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// A request body as the API reads it: the wire shapes, their validation
// into an apiRequest, the kv_transfer_params and the protocol fields that
// pair its legs (SGLang's bootstrap fields, Mooncake's transfer).

// Limits on what a request may ask for, so that a fuzzed or hostile body
// cannot make the sim allocate without bound.
const (
	maxBodyBytes     = 16 << 20
	maxTokensLimit   = 1 << 20
	maxChoices       = 128 // n and best_of, and prompts in one request
	defaultMaxTokens = 16
)

// kvTransferParams is vLLM's NixlConnector kv_transfer_params object, both
// as a request field and as a prefill response field. Absent fields and JSON
// nulls decode to zero values.
type kvTransferParams struct {
	DoRemoteDecode  bool   `json:"do_remote_decode"`
	DoRemotePrefill bool   `json:"do_remote_prefill"`
	RemoteBlockIDs  []int  `json:"remote_block_ids"`
	RemoteEngineID  string `json:"remote_engine_id"`
	RemoteRequestID string `json:"remote_request_id"`
	RemoteHost      string `json:"remote_host"`
	RemotePort      int    `json:"remote_port"`
	TPSize          int    `json:"tp_size"`
	// vLLM's MooncakeConnector's (mooncake.go); omitted when empty, so that
	// the NixlConnector's answers do not carry them.
	TransferID          string `json:"transfer_id,omitempty"`
	RemoteBootstrapAddr string `json:"remote_bootstrap_addr,omitempty"`
	RemoteDPRank        *int   `json:"remote_dp_rank,omitempty"`
	// Older vLLM's MooncakeConnector's, refused with a 400.
	BootstrapServerHost string `json:"bootstrap_server_host,omitempty"`
	BootstrapServerPort int    `json:"bootstrap_server_port,omitempty"`
}

// prefillKVParams is the kv_transfer_params a prefiller answers with: the
// request fields plus those 2026 vLLM adds, which the sim's decoders ignore
// as vLLM's ignore fields they do not use.
type prefillKVParams struct {
	kvTransferParams
	// RemoteNumTokens is the prompt's length in tokens.
	RemoteNumTokens int `json:"remote_num_tokens"`
	// RemoteBlocksExpiryTime is when the first lease ends, in unix seconds.
	// Heartbeats move the end later without changing this value.
	RemoteBlocksExpiryTime float64 `json:"remote_blocks_expiry_time"`
	// TransferMode is "read": the decoder reads the prefiller's blocks.
	TransferMode string `json:"transfer_mode"`
	DCPSize      int    `json:"dcp_size"`
	PPSize       int    `json:"pp_size"`
}

// apiRequest is what the sim needs from a completions or chat completions
// body; every other field (temperature, stop, ...) is accepted and ignored.
type apiRequest struct {
	chat         bool
	model        string
	promptTokens int
	maxTokens    int
	minTokens    int
	ignoreEOS    bool
	stream       bool
	includeUsage bool
	priority     int
	kind         reqKind
	// cacheSalt is the request's cache_salt, "" for none.
	cacheSalt string
	// resp is a Responses API request's own part (responses.go); nil otherwise.
	resp *responsesMeta
	// anthropic: a Messages API request (messages.go).
	anthropic bool
	// generate: a request of the token-in route (generate.go).
	generate bool
	kv       *kvTransferParams // decode only: where to pull from

	// prompts holds every prompt's token count (promptTokens is the first);
	// never more than one on a decode. tokens holds each prompt's token ids.
	prompts []int
	tokens  [][]uint32
	// samples is how many requests run per prompt, max(n, best_of), and n
	// how many choices per prompt the answer has; both 1 on a decode.
	samples, n int
	// crashesDecoder: prompt logprobs asked of a decode, which kills a vLLM
	// decoder's engine (vLLM #50792).
	crashesDecoder bool
	// byPrefix: tokens come from the prefix (temperature 0 or a seed; see
	// the token source below); seeded: the seed enters it too (not greedy).
	byPrefix, seeded bool
	seed             int64
	// returnTokenIDs: the answer carries token_ids and prompt_token_ids.
	returnTokenIDs bool
	// sg is the rid and bootstrap fields of a body sent to an SGLang engine.
	sg *sglangFields
	// mc is a Mooncake decode's prefill, xferID a Mooncake prefill's transfer_id.
	mc     *mooncakeLeg
	xferID string
}

// wireRequest mirrors the JSON fields the sim reads.
type wireRequest struct {
	Model               *string         `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []wireMessage   `json:"messages"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	MinTokens           *int            `json:"min_tokens"`
	IgnoreEOS           *bool           `json:"ignore_eos"`
	Stream              *bool           `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage *bool `json:"include_usage"`
	} `json:"stream_options"`
	N      *int `json:"n"`
	BestOf *int `json:"best_of"`
	// PromptLogprobs, and Logprobs with Echo, ask for the prompt's logprobs;
	// any JSON value but null (and false for chat's logprobs) counts.
	PromptLogprobs   json.RawMessage   `json:"prompt_logprobs"`
	Echo             *bool             `json:"echo"`
	Logprobs         json.RawMessage   `json:"logprobs"`
	KVTransferParams *kvTransferParams `json:"kv_transfer_params"`
	// Priority is vLLM's: lower runs first under --scheduling-policy priority.
	Priority *int `json:"priority"`
	// CacheSalt is vLLM's cache_salt: the prompt's first block, and so every block after
	// it, is keyed by it too, so that only requests of the same salt share its KV.
	CacheSalt *string `json:"cache_salt"`
	// Temperature 0 (greedy) or a Seed makes the tokens a function of the
	// prefix; ReturnTokenIDs asks for vLLM's token_ids and prompt_token_ids.
	Temperature    *float64 `json:"temperature"`
	Seed           *int64   `json:"seed"`
	ReturnTokenIDs *bool    `json:"return_token_ids"`
	// SGLang's fields (sglang.go): a value, or an array with one per prompt.
	RID           json.RawMessage `json:"rid"`
	BootstrapHost json.RawMessage `json:"bootstrap_host"`
	BootstrapPort json.RawMessage `json:"bootstrap_port"`
	BootstrapRoom json.RawMessage `json:"bootstrap_room"`
}

type wireMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// parseRequest parses and validates a completions (chat=false) or chat
// completions body: decodeBody, then validate. Its errors are *apiError
// values with status 400.
func parseRequest(tk tokenizer, body []byte, chat bool) (*apiRequest, error) {
	b, err := decodeBody(tk, body, chat)
	if err != nil {
		return nil, err
	}
	return b.validate(chat)
}

// wireBody is a body that passed what vLLM checks before its handler runs:
// JSON syntax, field types and required fields (its pydantic request
// models). A decoder that rejects a body at this stage has not seen the
// request, so it notifies no prefiller; validate's rejections come from
// the serving layer, which does (vLLM #41269).
type wireBody struct {
	wireRequest
	// prompts holds each prompt's token count and tokens its token ids; a
	// chat has one prompt.
	prompts []int
	tokens  [][]uint32
	// resp is a Responses API body's own part (responses.go); nil otherwise.
	resp *responsesMeta
	// anthropic: a Messages API body (messages.go).
	anthropic bool
	// generate: a body of the token-in route (generate.go).
	generate bool
}

// decodeBody decodes body and checks its shape. Prompts are tokenized by
// the sim's tokenizer (tokenizer.go): a string prompt, each string of a
// list, or a chat rendered through the template (add_generation_prompt,
// default true); a prompt given as token ids is taken as it is.
func decodeBody(tk tokenizer, body []byte, chat bool) (*wireBody, error) {
	var b wireBody
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&b.wireRequest); err != nil {
		return nil, badRequest("invalid_json", "request body is not a valid JSON object: %v", err)
	}
	if dec.More() {
		return nil, badRequest("invalid_json", "request body has trailing data after the JSON object")
	}
	if b.CacheSalt != nil && *b.CacheSalt == "" {
		// vLLM's request models check it (check_cache_salt_support), before the handler.
		return nil, badRequest("invalid_cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
	}
	if chat {
		t, err := chatPrompt(tk, b.Messages, b.AddGenerationPrompt == nil || *b.AddGenerationPrompt)
		if err != nil {
			return nil, err
		}
		b.tokens = [][]uint32{t}
	} else {
		var err error
		if b.tokens, err = completionPrompts(tk, b.Prompt); err != nil {
			return nil, err
		}
	}
	b.prompts = make([]int, len(b.tokens))
	for i, t := range b.tokens {
		b.prompts[i] = len(t)
	}
	return &b, nil
}

// validate checks the values of a well-formed body, as vLLM's serving layer
// does (SamplingParams and the prompt's length).
func (b *wireBody) validate(chat bool) (*apiRequest, error) {
	w := &b.wireRequest
	req := &apiRequest{chat: chat, maxTokens: defaultMaxTokens, promptTokens: b.prompts[0], prompts: b.prompts, tokens: b.tokens, n: 1, samples: 1}
	if w.Model != nil {
		req.model = *w.Model
	}
	if w.N != nil {
		if *w.N < 1 || *w.N > maxChoices {
			return nil, badRequest("invalid_n", "n=%d: must be between 1 and %d", *w.N, maxChoices)
		}
		req.n, req.samples = *w.N, *w.N
	}
	if w.BestOf != nil {
		if *w.BestOf < req.n || *w.BestOf > maxChoices {
			return nil, badRequest("invalid_best_of", "best_of=%d: must be between n (%d) and %d", *w.BestOf, req.n, maxChoices)
		}
		req.samples = *w.BestOf
	}
	if len(b.prompts) > maxChoices {
		return nil, badRequest("invalid_prompt", "prompt: %d prompts, at most %d", len(b.prompts), maxChoices)
	}
	for _, t := range b.tokens {
		if err := checkVocabulary(t); err != nil {
			return nil, err
		}
	}
	maxTok := w.MaxTokens
	if chat && w.MaxCompletionTokens != nil {
		maxTok = w.MaxCompletionTokens
	}
	if maxTok != nil {
		if *maxTok < 1 || *maxTok > maxTokensLimit {
			return nil, badRequest("invalid_max_tokens", "max_tokens=%d: must be between 1 and %d", *maxTok, maxTokensLimit)
		}
		req.maxTokens = *maxTok
	}
	if w.MinTokens != nil {
		if *w.MinTokens < 0 || *w.MinTokens > req.maxTokens {
			return nil, badRequest("invalid_min_tokens", "min_tokens=%d: must be between 0 and max_tokens (%d)", *w.MinTokens, req.maxTokens)
		}
		req.minTokens = *w.MinTokens
	}
	if w.IgnoreEOS != nil {
		req.ignoreEOS = *w.IgnoreEOS
	}
	if w.Priority != nil {
		req.priority = *w.Priority
	}
	if w.CacheSalt != nil {
		req.cacheSalt = *w.CacheSalt
	}
	greedy := w.Temperature != nil && *w.Temperature == 0
	req.byPrefix = greedy || w.Seed != nil
	if w.Seed != nil && !greedy {
		req.seeded, req.seed = true, *w.Seed
	}
	req.returnTokenIDs = w.ReturnTokenIDs != nil && *w.ReturnTokenIDs
	req.resp, req.anthropic, req.generate = b.resp, b.anthropic, b.generate
	if w.Stream != nil {
		req.stream = *w.Stream
	}
	if w.StreamOptions != nil && w.StreamOptions.IncludeUsage != nil {
		req.includeUsage = *w.StreamOptions.IncludeUsage
	}
	if kv := w.KVTransferParams; kv != nil {
		switch {
		case kv.DoRemoteDecode && kv.DoRemotePrefill:
			return nil, badRequest("invalid_kv_transfer_params", "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
		case kv.DoRemoteDecode:
			req.kind = kindPrefill
		case kv.DoRemotePrefill:
			if !kv.reachable() {
				return nil, badRequest("invalid_kv_transfer_params", "kv_transfer_params: do_remote_prefill needs remote_host and remote_port")
			}
			// Empty or null remote_block_ids are valid: vLLM's prefiller
			// sends only full blocks, so a short prompt has none to read and
			// the decoder computes it itself.
			req.kind = kindDecode
			req.kv = kv
		}
	}
	if req.kind == kindDecode {
		// A prefill fans out (into requests that each hold, vLLM #38900 and
		// #54707), and so does a request without kv_transfer_params (each
		// child computing its prompt, as a vLLM server does: choices.go). A
		// decode reads one prefill's blocks: the sim answers one choice for
		// one prompt, and a proxy must not send it more.
		if len(b.prompts) != 1 {
			return nil, badRequest("invalid_prompt", "prompt: the sim takes one prompt per decode with kv_transfer_params, got %d", len(b.prompts))
		}
		if req.samples != 1 {
			return nil, badRequest("invalid_n", "n=%d, best_of=%d: the sim returns exactly one choice for a decode with kv_transfer_params", req.n, req.samples)
		}
	}
	req.crashesDecoder = req.kind == kindDecode &&
		(isSet(w.PromptLogprobs) || (w.Echo != nil && *w.Echo && isSet(w.Logprobs)))
	return req, nil
}

// isSet reports a JSON value other than absent, null and false.
func isSet(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && !bytes.Equal(raw, []byte("null")) && !bytes.Equal(raw, []byte("false"))
}

// reachable reports that p names a prefiller a decoder can call.
func (p *kvTransferParams) reachable() bool {
	return p.RemoteHost != "" && p.RemotePort > 0 && p.RemotePort <= 65535
}

// heldFor returns the params of a decode that would read blocks held for
// it, with the request id filled in, or nil: the decodes whose rejection
// must reach the prefiller.
func (p *kvTransferParams) heldFor(rid string) *kvTransferParams {
	if p == nil || !p.DoRemotePrefill || p.DoRemoteDecode || !p.reachable() || len(p.RemoteBlockIDs) == 0 {
		return nil
	}
	c := *p
	if c.RemoteRequestID == "" {
		c.RemoteRequestID = rid // older vLLM names P's request by the shared X-Request-Id
	}
	return &c
}

// completionPrompts tokenizes each prompt of a completions request: a
// string, a list of strings, a list of token ids or a list of such lists.
func completionPrompts(tk tokenizer, raw json.RawMessage) ([][]uint32, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, badRequest("missing_prompt", "prompt is required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		t, err := tk.prompt(s)
		if err != nil {
			return nil, err
		}
		return [][]uint32{t}, nil
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil && len(ss) > 0 {
		out := make([][]uint32, len(ss))
		for i, p := range ss {
			t, err := tk.prompt(p)
			if err != nil {
				return nil, err
			}
			out[i] = t
		}
		return out, nil
	}
	var ids []uint32
	if json.Unmarshal(raw, &ids) == nil && len(ids) > 0 {
		return [][]uint32{ids}, nil
	}
	var batches [][]uint32
	if json.Unmarshal(raw, &batches) == nil && len(batches) > 0 {
		for i, b := range batches {
			if len(b) == 0 {
				return nil, badRequest("invalid_prompt", "prompt[%d]: empty token list", i)
			}
		}
		return batches, nil
	}
	return nil, badRequest("invalid_prompt", "prompt must be a string, a list of strings, a list of token ids or a list of token id lists, not empty")
}

// checkVocabulary refuses a token id past the vocabulary, as vLLM's serving
// layer does.
func checkVocabulary(ids []uint32) error {
	for _, id := range ids {
		if id >= vocabSize {
			return badRequest("invalid_prompt", "prompt: token id %d is out of the vocabulary (%d ids)", id, vocabSize)
		}
	}
	return nil
}

// chatPrompt renders and tokenizes a chat's messages: at least one token.
func chatPrompt(tk tokenizer, msgs []wireMessage, addGenerationPrompt bool) ([]uint32, error) {
	if len(msgs) == 0 {
		return nil, badRequest("missing_messages", "messages is required and must not be empty")
	}
	cm := make([]chatMessage, len(msgs))
	for i, m := range msgs {
		if m.Role == "" {
			return nil, badRequest("invalid_messages", "messages[%d]: role is required", i)
		}
		text, err := contentText(m.Content)
		if err != nil {
			return nil, badRequest("invalid_messages", "messages[%d].content: %v", i, err)
		}
		cm[i] = chatMessage{role: m.Role, content: text}
	}
	return tk.chat(cm, addGenerationPrompt)
}

// contentText is a message content's text: a string, null, or a list of
// parts whose text ones are joined.
func contentText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("want a string or a list of content parts")
	}
	var b strings.Builder
	for _, p := range parts {
		b.WriteString(p.Text)
	}
	return b.String(), nil
}

// reqKind is what a request asks of the engine.
type reqKind uint8

const (
	kindAggregated reqKind = iota // prefill and decode here
	kindPrefill                   // do_remote_decode: prefill, then hold the KV for a decoder
	kindDecode                    // do_remote_prefill: pull the KV from a prefiller, then decode
)

func (k reqKind) String() string {
	switch k {
	case kindPrefill:
		return "prefill"
	case kindDecode:
		return "decode"
	default:
		return "aggregated"
	}
}

// sglangLeg is one prompt's bootstrap fields: the room and, on a decoder, where its
// prefiller's bootstrap server is.
type sglangLeg struct {
	room uint64
	host string
	port int
}

// sglangFields are the fields SGLang's protocol adds to a body, one entry per prompt.
type sglangFields struct {
	rids  []string // nil: no rid given
	rooms []uint64 // nil: no bootstrap_room, the body is not a leg
	hosts []string
	ports []int
}

// leg is prompt i's bootstrap fields, nil when the body is not a leg.
func (f *sglangFields) leg(i int) *sglangLeg {
	if f == nil || f.rooms == nil {
		return nil
	}
	l := &sglangLeg{room: f.rooms[i]}
	if f.hosts != nil {
		l.host, l.port = f.hosts[i], f.ports[i]
	}
	return l
}

// mooncakeLeg is a Mooncake decode's pointer to its prefill.
type mooncakeLeg struct {
	host       string // of remote_bootstrap_addr
	port       int
	engineID   string
	dpRank     int
	transferID string
}

// responsesMeta is what a Responses API answer needs of its request.
type responsesMeta struct {
	instructions *string
	prevID       *string
	// history is the conversation the answer extends, instructions
	// excluded: the previous response's history and output, then this input.
	history     []wireMessage
	store       bool
	background  bool
	temperature float64
	topP        float64
	maxOutput   *int
	// input is the raw input until render resolves it.
	input json.RawMessage
}

// bodyReadError is the answer to a request body that could not be read: a 413 past
// maxBodyBytes, else a 400.
func bodyReadError(err error) error {
	var tooBig *http.MaxBytesError
	if errors.As(err, &tooBig) {
		return statusError(http.StatusRequestEntityTooLarge, "body_too_large", "request body larger than %d bytes", maxBodyBytes)
	}
	return badRequest("unreadable_body", "read request body: %v", err)
}

func newRequestID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "sim-" + hex.EncodeToString(b[:])
}
