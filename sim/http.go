package sim

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// Handler serves every endpoint of the engine. Run must be running for
// completion requests to make progress.
func (e *Engine) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", e.byRank(func(r *Engine) http.HandlerFunc { return r.handleCompletion(apiCompletions) }))
	mux.HandleFunc("POST /v1/chat/completions", e.byRank(func(r *Engine) http.HandlerFunc { return r.handleCompletion(apiChat) }))
	mux.HandleFunc("POST /v1/responses", e.byRank(func(r *Engine) http.HandlerFunc { return r.handleCompletion(apiResponses) }))
	mux.HandleFunc("GET /v1/responses/{id}", e.handleGetResponse)
	mux.HandleFunc("POST /v1/messages", anthropicShape(e.byRank(func(r *Engine) http.HandlerFunc { return r.handleCompletion(apiMessages) })))
	mux.HandleFunc("POST /v1/messages/count_tokens", anthropicShape(e.handleCountTokens))
	if !e.sglang() {
		mux.HandleFunc("POST "+generateRoute, e.byRank(func(r *Engine) http.HandlerFunc { return r.handleCompletion(apiGenerate) }))
	}
	mux.HandleFunc("POST /abort_request", e.byRank(func(r *Engine) http.HandlerFunc { return r.handleAbort }))
	mux.HandleFunc("POST /kv/pull", e.byEngineID(func(r *Engine) http.HandlerFunc { return r.handlePull }))
	mux.HandleFunc("POST /kv/notify", e.byEngineID(func(r *Engine) http.HandlerFunc { return r.handleNotify }))
	mux.HandleFunc("POST /kv/heartbeat", e.byEngineID(func(r *Engine) http.HandlerFunc { return r.handleHeartbeat }))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /server_info", e.handleServerInfo)
	mux.HandleFunc("GET /get_server_info", e.handleServerInfo)
	mux.HandleFunc("GET /v1/models", e.handleModels)
	mux.HandleFunc("GET /kv_event_sources", e.handleKVEventSources)
	mux.HandleFunc("POST /tokenize", e.handleTokenize)
	mux.HandleFunc("POST /detokenize", e.pooling("detok", parseDetokenize))
	mux.HandleFunc("POST /v1/embeddings", e.pooling("embd", parseEmbeddings))
	mux.HandleFunc("POST /pooling", e.pooling("pool", parsePooling))
	for _, path := range []string{"/v1/score", "/score"} {
		mux.HandleFunc("POST "+path, e.pooling("score", parseScore))
	}
	for _, path := range []string{"/v1/rerank", "/rerank", "/v2/rerank"} {
		mux.HandleFunc("POST "+path, e.pooling("rerank", parseRerank))
	}
	mux.HandleFunc("POST /v1/audio/transcriptions", e.pooling("trsc", parseTranscription))
	mux.HandleFunc("GET /debug/kv", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, http.StatusOK, e.Stats()) })
	mux.Handle("GET /metrics", promhttp.HandlerFor(e.registry, promhttp.HandlerOpts{}))
	// vLLM's liveness probe: 200 while the process runs, draining or not.
	mux.HandleFunc("GET /live", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	return e.drainGate(mux)
}

// faults are the fault injections for one request: flag defaults, then headers.
type faults struct {
	failStatus int
	stall      time.Duration
	closeAfter int // -1: never
	slowWrite  time.Duration
	// transferFail: the request's KV transfer fails.
	transferFail bool
	// dieAfter: the engine dies once the request sent that many tokens
	// (-1: never).
	dieAfter int
}

// Fault injection headers, read on completion requests.
const (
	HeaderFailStatus = "X-Sim-Fail-Status"
	HeaderStall      = "X-Sim-Stall"
	HeaderCloseAfter = "X-Sim-Close-After"
	HeaderSlowWrite  = "X-Sim-Slow-Write"
	// HeaderTransferFail: true makes the request's KV transfer fail, sent to
	// a decoder or (SGLang) to either leg.
	HeaderTransferFail = "X-Sim-Transfer-Fail"
	// HeaderDieAfter: N kills the whole engine once the request has sent N
	// tokens of its answer, as a crash would (server.go).
	HeaderDieAfter = "X-Sim-Die-After"
)

func (e *Engine) faults(h http.Header) (faults, error) {
	f := faults{failStatus: e.cfg.FailStatus, stall: e.cfg.Stall, closeAfter: -1, slowWrite: e.cfg.SlowWrite, transferFail: e.cfg.TransferFail}
	if v := h.Get(HeaderTransferFail); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return f, badRequest("invalid_fault", "%s: %q is not a boolean", HeaderTransferFail, v)
		}
		f.transferFail = b
	}
	if e.cfg.CloseAfter > 0 {
		f.closeAfter = e.cfg.CloseAfter
	}
	f.dieAfter = -1
	if e.cfg.DieAfter > 0 {
		f.dieAfter = e.cfg.DieAfter
	}
	if v := h.Get(HeaderDieAfter); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return f, badRequest("invalid_fault", "%s: %q is not a count", HeaderDieAfter, v)
		}
		f.dieAfter = n
	}
	if f.dieAfter >= 0 && e.die == nil {
		return f, badRequest("invalid_fault", "%s: only an engine run by sim.Server (or proxy sim) can die", HeaderDieAfter)
	}
	if v := h.Get(HeaderFailStatus); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 100 || n > 999 {
			return f, badRequest("invalid_fault", "%s: %q is not an HTTP status", HeaderFailStatus, v)
		}
		f.failStatus = n
	}
	if v := h.Get(HeaderCloseAfter); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return f, badRequest("invalid_fault", "%s: %q is not a count", HeaderCloseAfter, v)
		}
		f.closeAfter = n
	}
	for _, d := range []struct {
		name string
		dst  *time.Duration
	}{{HeaderStall, &f.stall}, {HeaderSlowWrite, &f.slowWrite}} {
		if v := h.Get(d.name); v != "" {
			dur, err := time.ParseDuration(v)
			if err != nil || dur < 0 {
				return f, badRequest("invalid_fault", "%s: %q is not a duration", d.name, v)
			}
			*d.dst = dur
		}
	}
	return f, nil
}

// apiKind is the API a generation request came in on.
type apiKind uint8

const (
	apiCompletions apiKind = iota // POST /v1/completions
	apiChat                       // POST /v1/chat/completions
	apiResponses                  // POST /v1/responses (responses.go)
	apiMessages                   // POST /v1/messages (messages.go)
	apiGenerate                   // POST /inference/v1/generate (generate.go)
)

// decodeFor is decodeBody for each API.
func decodeFor(tk tokenizer, kind apiKind, body []byte) (*wireBody, error) {
	switch kind {
	case apiResponses:
		return decodeResponses(body)
	case apiMessages:
		return decodeMessagesBody(tk, body)
	case apiGenerate:
		return decodeGenerate(body)
	}
	return decodeBody(tk, body, kind == apiChat)
}

func (e *Engine) handleCompletion(kind apiKind) http.HandlerFunc {
	chat := kind == apiChat
	return func(w http.ResponseWriter, r *http.Request) {
		// In flight from here: a drain waits for it, and cuts it when its
		// grace ends.
		ctx, leave, ok := e.drain.enter(r.Context())
		if !ok {
			writeUnavailable(w)
			return
		}
		defer leave()
		defer cutIfDrained(ctx)
		// vLLM names a request by X-Request-Id; SGLang by the body's rid.
		var rid string
		if !e.sglang() {
			rid = r.Header.Get("X-Request-Id")
			if rid == "" {
				rid = newRequestID()
			}
			w.Header().Set("X-Request-Id", rid)
		}
		f, err := e.faults(r.Header)
		if err != nil {
			writeError(w, err)
			return
		}
		// The body is read before an injected failure is answered, so that
		// remote_prefill_requests_total counts every decode that reached this
		// engine, whatever it answered.
		body, readErr := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
		var wb *wireBody
		if readErr == nil {
			wb, err = decodeFor(e.tok, kind, body)
			if e.readsRemotePrefill(wb) {
				e.countRemotePrefill()
			}
		}
		if f.failStatus != 0 {
			if f.failStatus == http.StatusServiceUnavailable || f.failStatus == http.StatusTooManyRequests {
				w.Header().Set("Retry-After", "1")
			}
			writeError(w, statusError(f.failStatus, "injected_fault", "injected failure (status %d)", f.failStatus))
			return
		}
		if readErr != nil {
			writeError(w, bodyReadError(readErr))
			return
		}
		if err != nil {
			// Malformed JSON or a wrong type: vLLM fails such a body before
			// its handler, so no prefiller hears of it.
			writeError(w, err)
			return
		}
		var mc *kvTransferParams
		if e.sglang() {
			wb.KVTransferParams = nil // not SGLang's
		}
		if e.mooncake() {
			// Mooncake's legs are not the NixlConnector's: mooncakeRequest reads them.
			mc, wb.KVTransferParams = wb.KVTransferParams, nil
		}
		var a *apiRequest
		if wb.resp != nil {
			err = wb.render(e.tok, e.store)
		}
		if err == nil {
			a, err = wb.validate(chat)
		}
		if err == nil {
			a.model, err = e.resolveModel(a.model)
		}
		if err == nil {
			err = e.checkPriority(a.priority)
		}
		if err == nil && e.sglang() {
			rid, err = e.sglangRequest(wb, a)
		}
		if err == nil && e.mooncake() {
			err = e.mooncakeRequest(mc, a)
		}
		var req *request
		if err == nil {
			req, err = e.newRequest(rid, a)
		}
		var children []child
		if err == nil {
			children, err = e.newChildren(rid, a)
		}
		if err != nil {
			e.rejectDecode(ctx, rid, wb.KVTransferParams, err)
			writeError(w, err)
			return
		}
		req.leg = a.sg.leg(0)
		req.transferFail = f.transferFail
		for _, c := range children {
			c.req.transferFail = f.transferFail
		}
		work, stop := e.lingering(ctx)
		defer stop()
		if e.sglang() {
			rids := []string{rid}
			for _, c := range children {
				rids = append(rids, c.req.rid)
			}
			defer e.track(rids)()
		}
		resp := &responder{
			e: e, req: req, w: w, rc: http.NewResponseController(w), ctx: ctx, work: work,
			api: a, rid: rid, model: a.model, created: e.clock.Now().Unix(), f: f,
			local: localAddr(r),
		}
		switch kind {
		case apiChat:
			resp.id = "chatcmpl-" + rid
		case apiResponses:
			resp.id = "resp_" + rid
		case apiMessages:
			resp.id = "chatcmpl-" + rid // vLLM's Messages answer keeps its chat's id
			if e.sglang() {
				resp.id = "msg_" + rid
			}
		case apiGenerate:
			resp.id = "generate-tokens-" + rid
		default:
			resp.id = "cmpl-" + rid
		}
		if a.kind != kindPrefill && len(children) > 0 {
			// Without kv_transfer_params, or an SGLang decode of several prompts.
			resp.serveChoices(append([]child{{req: req, index: 0, shown: true}}, children...))
			return
		}
		fan := e.startChildren(work, children)
		err = e.drive(work, req, resp.emit)
		resp.extra = fan.wait()
		resp.end(err)
	}
}

// readsRemotePrefill reports a body that asks this engine to decode a prompt prefilled
// elsewhere: kv_transfer_params with do_remote_prefill (vLLM), or a bootstrap_room sent to
// an SGLang decoder.
func (e *Engine) readsRemotePrefill(wb *wireBody) bool {
	if wb == nil {
		return false
	}
	if e.sglang() {
		return e.cfg.Role == "decode" && isSet(wb.BootstrapRoom)
	}
	kv := wb.KVTransferParams
	return kv != nil && kv.DoRemotePrefill
}

func localAddr(r *http.Request) *net.TCPAddr {
	if a, ok := r.Context().Value(http.LocalAddrContextKey).(*net.TCPAddr); ok {
		return a
	}
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)}
}

// responder writes one completion response, streaming or not, with the
// request's fault injections applied to its writes.
type responder struct {
	e   *Engine
	req *request
	w   http.ResponseWriter
	rc  *http.ResponseController
	ctx context.Context
	// work is what the engine's requests run under: ctx, or (SGLang) ctx
	// ending DisconnectDelay late.
	work    context.Context
	api     *apiRequest
	f       faults
	local   *net.TCPAddr
	rid     string
	id      string
	model   string
	created int64

	started bool // stream: headers sent
	// blockOpen: a Messages stream's text block is started and not stopped.
	blockOpen bool
	events    int // stream: SSE events written
	// promptSent marks, with return_token_ids, the completions choices
	// whose stream carried their prompt_token_ids (by choice index).
	promptSent map[int]bool
	tokens     int // tokens of the answer handed to the client (or, whole, generated)
	seq        int // Responses API stream: the next event's sequence_number
	text       strings.Builder
	ids        []uint32      // whole answer: the tokens' ids
	last       output        // the last token, once finished
	cached     int           // prompt tokens the prefix cache held (of the first request)
	extra      []childResult // a prefill's fan-out: the other choices (fanout.go)
}

// Response shapes, vLLM's field names.
type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
	// PromptTokensDetails says how much of the prompt the prefix cache held.
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

type message struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type choice struct {
	Index        int      `json:"index"`
	Text         *string  `json:"text,omitempty"`
	Message      *message `json:"message,omitempty"`
	Delta        *message `json:"delta,omitempty"`
	Logprobs     any      `json:"logprobs"`
	FinishReason *string  `json:"finish_reason"`
	// TokenIDs and PromptTokenIDs answer return_token_ids (nil: absent).
	// TokenIDs are the choice's generated ids (a stream chunk's new ones,
	// which may be none: []); PromptTokenIDs a completions choice's prompt,
	// in a stream on the choice's first chunk only. A chat answer carries
	// its prompt's at the top level instead.
	TokenIDs       []uint32 `json:"token_ids,omitzero"`
	PromptTokenIDs []uint32 `json:"prompt_token_ids,omitzero"`
}

type completion struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage,omitempty"`
	// PromptTokenIDs is a chat's prompt ids with return_token_ids: the
	// rendered template's, on the whole answer or a stream's first chunk.
	PromptTokenIDs []uint32 `json:"prompt_token_ids,omitzero"`
	// KVTransferParams is left nil (omitted) in stream chunks; a whole
	// answer sets it to a *kvTransferParams, which is null when P holds nothing.
	KVTransferParams any `json:"kv_transfer_params,omitempty"`
}

// usage counts every prompt once, however many samples it had, and the
// completion tokens of the choices shown.
func (p *responder) usage(completionTokens int) *usage {
	prompt := 0
	for _, n := range p.api.prompts {
		prompt += n
	}
	u := &usage{PromptTokens: prompt, CompletionTokens: completionTokens, TotalTokens: prompt + completionTokens}
	if !p.e.cfg.DisablePrefixCache {
		u.PromptTokensDetails = &promptTokensDetails{CachedTokens: p.cached}
	}
	return u
}

// kvParams is the top-level kv_transfer_params of a prefill that ended in a
// hold: the address is the one this connection reached, so it works on port 0.
func (p *responder) kvParams(o output) *prefillKVParams {
	if o.held == nil {
		return nil
	}
	return &prefillKVParams{
		kvTransferParams: kvTransferParams{
			DoRemotePrefill: true,
			RemoteBlockIDs:  o.held,
			RemoteEngineID:  p.e.id,
			RemoteRequestID: p.rid,
			RemoteHost:      p.local.IP.String(),
			RemotePort:      p.local.Port,
			TPSize:          1,
		},
		RemoteNumTokens:        p.req.promptTokens,
		RemoteBlocksExpiryTime: float64(o.leaseEnd.UnixNano()) / 1e9,
		TransferMode:           "read",
		DCPSize:                1,
		PPSize:                 1,
	}
}

func (p *responder) emit(o output) error {
	p.cached = o.cached
	if !p.api.stream {
		p.text.WriteString(o.text)
		p.ids = append(p.ids, o.id)
		p.last = o
		p.sentToken()
		return nil
	}
	if p.api.resp != nil {
		return p.respEmit(o)
	}
	if p.api.anthropic {
		return p.msgEmit(o)
	}
	if p.api.generate {
		return p.genEmit(o)
	}
	if !p.started {
		if err := p.begin(1); err != nil {
			return err
		}
	}
	var finish *string
	if o.finish != "" {
		finish = &o.finish
	}
	c := p.chunk(choice{FinishReason: finish}, o.text)
	p.streamIDs(c, o)
	if o.held != nil && !p.e.sglang() {
		c.KVTransferParams = p.kvParams(o)
	}
	if p.f.dieAfter == 0 {
		p.sentToken() // dies before the first token
	}
	if err := p.event(c); err != nil {
		return err
	}
	p.sentToken()
	if o.finish == "" {
		return nil
	}
	return p.done(o.complete)
}

// sentToken counts a token handed to the client and applies the
// die-after fault: the engine dies once the request has sent that many.
func (p *responder) sentToken() {
	if p.f.dieAfter < 0 {
		return
	}
	if p.f.dieAfter > 0 {
		p.tokens++
		if p.tokens < p.f.dieAfter {
			return
		}
	}
	p.e.die()
	panic(http.ErrAbortHandler) // the connection is gone with the engine
}

// begin sends the stream's headers (after the stall fault) and, for chat,
// the role chunks vLLM sends first, one for each of the choices.
func (p *responder) begin(choices int) error {
	if err := sleep(p.ctx, p.e.clock, p.f.stall); err != nil {
		return err
	}
	h := p.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	p.w.WriteHeader(http.StatusOK)
	p.started = true
	if p.api.resp != nil {
		return p.respBegin()
	}
	if p.api.anthropic {
		return p.msgBegin()
	}
	if !p.api.chat {
		return nil
	}
	for i := range choices {
		empty := ""
		c := p.chunk(choice{Index: i}, "")
		c.Choices[0].Delta = &message{Role: "assistant", Content: &empty}
		if i == 0 {
			c.PromptTokenIDs = p.promptIDs(0) // the stream's first chunk
		}
		if err := p.event(c); err != nil {
			return err
		}
	}
	return nil
}

// done ends a stream: the usage chunk if asked for, then [DONE].
func (p *responder) done(completionTokens int) error {
	if p.api.includeUsage {
		c := p.chunk(choice{}, "")
		c.Choices = []choice{}
		c.Usage = p.usage(completionTokens)
		if err := p.event(c); err != nil {
			return err
		}
	}
	return p.write([]byte("data: [DONE]\n\n"))
}

// chunk builds a streaming chunk carrying text in choices[0].
func (p *responder) chunk(ch choice, text string) *completion {
	c := &completion{ID: p.id, Created: p.created, Model: p.model}
	if p.api.chat {
		c.Object = "chat.completion.chunk"
		ch.Delta = &message{Content: &text}
	} else {
		c.Object = "text_completion"
		ch.Text = &text
	}
	c.Choices = []choice{ch}
	return c
}

func (p *responder) event(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	buf := make([]byte, 0, len(b)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, b...)
	buf = append(buf, "\n\n"...)
	return p.write(buf)
}

// write sends one SSE event and flushes it, applying the close-after and
// slow-write faults.
func (p *responder) write(b []byte) error {
	if p.f.closeAfter >= 0 && p.events >= p.f.closeAfter {
		// The honest way to cut a response that is already streaming.
		panic(http.ErrAbortHandler)
	}
	if err := sleep(p.ctx, p.e.clock, p.f.slowWrite); err != nil {
		return err
	}
	p.events++
	if _, err := p.w.Write(b); err != nil {
		return err
	}
	return p.rc.Flush()
}

// end writes what is left once drive returned err.
func (p *responder) end(err error) {
	switch {
	case err == nil && p.api.stream:
		return
	case err == nil || errors.Is(err, errAborted):
		p.writeWhole(err != nil)
		return
	case p.ctx.Err() != nil:
		if ce := p.e.log.Check(zap.DebugLevel, "client gone, request aborted"); ce != nil {
			ce.Write(zap.String("request_id", p.rid), zap.Error(err))
		}
		return
	}
	var ae *apiError
	if !errors.As(err, &ae) {
		// A write to the client failed: nobody is left to answer.
		p.e.log.Debug("response write failed", zap.String("request_id", p.rid), zap.Error(err))
		return
	}
	if !p.started {
		if ae.Status >= 500 {
			p.e.log.Warn("request failed", zap.String("request_id", p.rid), zap.Error(err))
		}
		writeError(p.w, ae)
		return
	}
	// Headers are gone: report in the stream, as vLLM does.
	if p.api.resp != nil {
		p.respError(ae)
		return
	}
	if p.api.anthropic {
		p.msgError(ae)
		return
	}
	if p.event(map[string]*apiError{"error": ae}) == nil {
		_ = p.write([]byte("data: [DONE]\n\n"))
	}
}

// writeWhole writes a non-streaming answer, or the end of an aborted stream.
func (p *responder) writeWhole(aborted bool) {
	finish := p.last.finish
	if aborted {
		finish = "abort"
	}
	if p.api.resp != nil {
		if !p.api.stream {
			p.respWhole(aborted)
		} else if p.started || p.begin(1) == nil {
			_ = p.respFinish(finish, p.last.complete, aborted)
		}
		return
	}
	if p.api.anthropic {
		if !p.api.stream {
			p.msgWhole(aborted)
		} else if p.started || p.begin(1) == nil {
			_ = p.msgFinish(finish, p.last.complete)
		}
		return
	}
	if p.api.generate {
		p.genWhole(finish, aborted)
		return
	}
	if p.api.stream {
		if !p.started && p.begin(1) != nil {
			return
		}
		c := p.chunk(choice{FinishReason: &finish}, "")
		p.streamIDs(c, output{})
		if p.event(c) == nil {
			_ = p.done(p.last.complete)
		}
		return
	}
	c := &completion{ID: p.id, Created: p.created, Model: p.model, Usage: p.usage(p.last.complete), KVTransferParams: (*prefillKVParams)(nil)}
	c.Object = "text_completion"
	if p.api.chat {
		c.Object = "chat.completion"
		c.PromptTokenIDs = p.promptIDs(0)
	}
	c.Choices = []choice{p.wholeChoice(0, p.text.String(), p.ids, finish)}
	for _, x := range p.extra {
		c.Choices = append(c.Choices, p.wholeChoice(x.index, x.text, x.ids, x.finish))
		c.Usage.CompletionTokens += x.complete
	}
	c.Usage.TotalTokens = c.Usage.PromptTokens + c.Usage.CompletionTokens
	if !aborted {
		c.KVTransferParams = p.kvParams(p.last)
	}
	if p.e.sglang() {
		c.KVTransferParams = nil // SGLang answers no such field
	}
	p.writeBody(c, p.req)
}

// writeBody writes a whole (non-streaming) answer, applying the stall,
// slow-write and close-after faults. reqs are the engine requests that made
// it: a client that leaves before the answer aborts them.
func (p *responder) writeBody(c any, reqs ...*request) {
	body, err := json.Marshal(c)
	if err != nil {
		p.e.log.Error("encode response", zap.String("request_id", p.rid), zap.Error(err))
		return
	}
	body = append(body, '\n')
	if err := sleep(p.ctx, p.e.clock, p.f.stall+p.f.slowWrite); err != nil {
		// The client left before the answer: the disconnect abort reaches an
		// engine that already finished (race R1), a counted no-op.
		for _, r := range reqs {
			p.e.abortRequest(r)
		}
		return
	}
	p.w.Header().Set("Content-Type", "application/json")
	if p.f.closeAfter >= 0 {
		// Promise the whole body, send part of it, cut: the client sees an
		// unexpected EOF mid-body.
		p.w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		if p.f.closeAfter > 0 {
			p.w.WriteHeader(http.StatusOK)
			_, _ = p.w.Write(body[:min(p.f.closeAfter, len(body)-1)])
			_ = p.rc.Flush()
		}
		panic(http.ErrAbortHandler)
	}
	_, _ = p.w.Write(body)
}

// wholeChoice is one choice of a non-streaming answer; ids are its tokens'.
func (p *responder) wholeChoice(index int, text string, ids []uint32, finish string) choice {
	ch := choice{Index: index, FinishReason: &finish}
	if p.api.chat {
		ch.Message = &message{Role: "assistant", Content: &text}
	} else {
		ch.Text = &text
		ch.PromptTokenIDs = p.promptIDs(index)
	}
	if p.api.returnTokenIDs {
		ch.TokenIDs = append([]uint32{}, ids...)
	}
	return ch
}

// promptIDs is, with return_token_ids, the prompt ids of choice index
// (prompt index/n); nil without it.
func (p *responder) promptIDs(index int) []uint32 {
	if !p.api.returnTokenIDs {
		return nil
	}
	if i := index / p.api.n; i < len(p.api.tokens) {
		return p.api.tokens[i]
	}
	return nil
}

// streamIDs adds return_token_ids' fields to c, a stream chunk of one
// choice carrying o: o's id when o is a token, and for completions the
// prompt's ids on the choice's first chunk, as vLLM's serving_completion
// streams them.
func (p *responder) streamIDs(c *completion, o output) {
	if !p.api.returnTokenIDs {
		return
	}
	ch := &c.Choices[0]
	ch.TokenIDs = []uint32{}
	if o.kind == outToken {
		ch.TokenIDs = append(ch.TokenIDs, o.id)
	}
	if p.api.chat || p.promptSent[ch.Index] {
		return
	}
	if p.promptSent == nil {
		p.promptSent = make(map[int]bool)
	}
	p.promptSent[ch.Index] = true
	ch.PromptTokenIDs = p.promptIDs(ch.Index)
}

// handleAbort is POST /abort_request. vLLM has no such endpoint (its dev-mode
// /abort_requests cannot free a hold): the vllm protocol's is the sim's own, exact
// request id, answering {}. The sglang protocol's is SGLang's: rid matched by prefix,
// abort_all, an empty 200 (sglang.go).
func (e *Engine) handleAbort(w http.ResponseWriter, r *http.Request) {
	if !e.adminAuthorized(r) {
		writeError(w, statusError(http.StatusUnauthorized, "unauthorized", "abort_request needs the admin API key"))
		return
	}
	var req struct {
		RID      string `json:"rid"`
		AbortAll bool   `json:"abort_all"`
	}
	err := json.NewDecoder(io.LimitReader(r.Body, maxBodyBytes)).Decode(&req)
	if e.sglang() && err == nil {
		e.abortSGLang(req.RID, req.AbortAll)
		w.WriteHeader(http.StatusOK)
		return
	}
	if err != nil || req.RID == "" {
		writeError(w, badRequest("invalid_abort", `abort_request needs a JSON body {"rid":"<request id>"}`))
		return
	}
	e.abortRID(req.RID)
	writeJSON(w, http.StatusOK, struct{}{})
}

// handleTokenize is vLLM's POST /tokenize: {"model","prompt"} or
// {"model","messages","add_generation_prompt"} (default true), answered
// with the tokens the engine counts and caches for that prompt.
func (e *Engine) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Prompt              json.RawMessage `json:"prompt"`
		Messages            []wireMessage   `json:"messages"`
		AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBodyBytes)).Decode(&req); err != nil {
		writeError(w, badRequest("invalid_json", "request body is not a valid JSON object: %v", err))
		return
	}
	var (
		tokens []uint32
		err    error
	)
	if req.Messages != nil {
		tokens, err = chatPrompt(e.tok, req.Messages, req.AddGenerationPrompt == nil || *req.AddGenerationPrompt)
		learn := []string{"\n", "assistant"}
		for _, m := range req.Messages {
			text, _ := contentText(m.Content)
			learn = append(learn, m.Role, text)
		}
		e.vocab.learn(learn...)
	} else {
		var s string
		if err = json.Unmarshal(req.Prompt, &s); err != nil {
			err = badRequest("invalid_prompt", "prompt must be a string, or send messages")
		}
		if err == nil {
			tokens, err = e.tok.prompt(s)
		}
		e.vocab.learn(s)
	}
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
	}{len(tokens), e.maxModelLen(), tokens})
}
