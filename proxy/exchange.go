package proxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/router"
)

// exchange is one client request on its way through the P/D flow. Only the handler's
// goroutine touches it, except where a field says otherwise.
type exchange struct {
	s *Server
	w http.ResponseWriter
	r *http.Request
	// ctx is the request's context: done when the client leaves, or when the proxy gives up
	// on the request (its cause then says why: errShuttingDown, a failed write).
	ctx    context.Context
	cancel context.CancelCauseFunc
	id     string // the client's X-Request-Id or one of ours: the table's key, in logs and in the answer
	// engineID is the id the engines see for this request, new and random for each one: an
	// engine's explicit abort (repeated a moment later) and SGLang's prefix match must never
	// reach another request, as they would through a client's id used twice.
	engineID string
	route    string
	start    time.Time
	req      *genRequest
	hdr      http.Header // headers passed on to backends
	// class is the request's priority class; nil when no class is configured.
	class *PriorityClass

	// own is the request's custody (its table entry, its decoder's lease, a hold no decoder
	// acknowledged) while the exchange has it; nil once it went to a release, to the legs'
	// abort, or to a prefill let finish in the background (abort.go).
	own *custody
	// paired: the request runs on paired legs (SGLang), which fail by aborting the legs.
	paired bool
	// named is the prefiller the request's header named in the sidecar mode; nil else.
	named    *router.Backend
	prefillB *router.Backend
	decodeB  *router.Backend
	kvParams json.RawMessage

	goneAt   atomic.Int64 // UnixNano when ctx was seen done; written by an AfterFunc
	wrote    bool         // a byte of the answer went to the client
	tail     []byte       // the last bytes of the answer the client got (tailSize; see eventBreak, streamDone)
	ttft     time.Duration
	prefillT time.Duration
	decodeT  time.Duration
	fallback bool
	chunks   int
	// joined, for a request on paired legs, records that the decoder has the room's KV; the
	// relay calls it at the decoder's first byte (joinLegs).
	joined func()
	// legsStart is when a request's paired legs went out.
	legsStart time.Time
	finished  bool // counted and logged (finish)
	// span is the request's trace span; nil when tracing is off.
	span trace.Span
	// heldAt is when the prefiller began to hold the request's KV (its answer, or the legs'
	// start), for the spans that release it.
	heldAt time.Time
	// afterGone counts the stream chunks read after the client left.
	afterGone int
	// tokens are the prompt's token ids, for the cache-aware policies and conditional
	// disaggregation (tokenize); nil when nothing asked for them or tokenizing failed.
	tokens []uint32
	// legRIDs are the ids a request on paired legs has on the engines, one per prompt.
	legRIDs []string
	// cutLegs, for a request on paired legs, cuts both legs' calls, the decoder's first, and
	// reports whether the prefill leg had been answered (the prefiller holds the KV).
	cutLegs func() bool
	// legDrain is a paired engine's drain leg (kvbackend.LegCalls.Drain); nil where an
	// explicit abort frees a hold.
	legDrain []byte
	// clientModel is the model the client named when it was an alias (req.model is then the
	// served one), empty else; rename puts it back into the answer.
	clientModel string
	rename      *renamer
	// label is the request's model label, set when its model was resolved.
	label string
	// ended, for a Responses stream, records that its last event went by (sawEnd).
	ended bool
	// abortConn: the answer broke after its headers went out in a non-streaming response; the
	// only honest end is to cut the connection.
	abortConn bool
}

// generate serves a generation route (/v1/completions, /v1/chat/completions, /v1/responses),
// whose bodies parse reads.
func (s *Server) generate(route string, parse func([]byte) (*genRequest, *apiError)) http.HandlerFunc {
	return s.exchangeHandler(route, func(x *exchange) *apiError { return x.run(parse) })
}

// exchangeHandler serves route with run, as one exchange: its id, its answer when run fails
// before a byte went out, its metrics and log line (finish), and the cut of a connection
// nothing honest can be sent on.
func (s *Server) exchangeHandler(route string, run func(x *exchange) *apiError) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		x := &exchange{s: s, w: w, r: r, route: route, start: time.Now(), id: requestID(r), engineID: newID()}
		w.Header().Set("X-Request-Id", x.id)
		defer x.recoverAnswer()
		err := run(x)
		status := http.StatusOK
		if err != nil {
			status = err.status
			if !x.wrote {
				writeError(w, err)
			}
		}
		s.finish(x, status, err)
		if x.abortConn || status == StatusClientClosed {
			// Nothing honest can be sent: the client left, or stopped reading, or the
			// headers and part of a non-streaming body are out. Returning would let net/http
			// answer 200 of its own when nothing was written, end a stream cleanly, or pass a
			// truncated JSON off as complete; cutting the connection (on HTTP/2, the stream)
			// tells a client still there that it failed.
			panic(http.ErrAbortHandler)
		}
	}
}

func (s *Server) finish(x *exchange, status int, err *apiError) {
	x.finished = true
	x.endRequest(status, err)
	elapsed := time.Since(x.start)
	code := strconv.Itoa(status)
	model := x.label
	if model == "" {
		model = s.modelLabel(x.model()) // refused before its model was resolved
	}
	s.m.requests.WithLabelValues(x.route, code, model).Inc()
	s.m.duration.WithLabelValues(x.route, model).Observe(elapsed.Seconds())
	if x.ttft > 0 {
		s.m.ttft.WithLabelValues(x.route, model).Observe(x.ttft.Seconds())
	}
	level := zap.InfoLevel
	if status >= 500 && status != StatusClientClosed {
		level = zap.WarnLevel
	}
	ce := s.logger.Check(level, "request")
	if ce == nil {
		return
	}
	fields := []zap.Field{
		zap.String("request_id", x.id), zap.String("engine_request_id", x.engineID), zap.String("route", x.route), zap.Int("status", status),
		zap.Duration("duration", elapsed), zap.Duration("prefill_duration", x.prefillT),
		zap.Duration("decode_duration", x.decodeT), zap.Duration("ttft", x.ttft),
	}
	if x.req != nil {
		fields = append(fields, zap.Bool("stream", x.req.stream), zap.String("model", x.req.model))
		if x.clientModel != "" {
			fields = append(fields, zap.String("model_alias", x.clientModel))
		}
	}
	if x.prefillB != nil {
		fields = append(fields, zap.String("prefill_backend", x.prefillB.Name))
	}
	if x.decodeB != nil {
		fields = append(fields, zap.String("decode_backend", x.decodeB.Name))
	}
	if x.fallback {
		fields = append(fields, zap.Bool("decode_only_fallback", true))
	}
	if err != nil {
		fields = append(fields, zap.String("error", err.Error()))
	}
	ce.Write(fields...)
}

// model is the model the client named, once its request was parsed.
func (x *exchange) model() string {
	switch {
	case x.clientModel != "":
		return x.clientModel
	case x.req != nil:
		return x.req.model
	}
	return ""
}

// requestID is the client's X-Request-Id when it sent a usable one, else a new random id.
func requestID(r *http.Request) string {
	if id := r.Header.Get("X-Request-Id"); id != "" && len(id) <= 128 && printable(id) {
		return id
	}
	return newID()
}

// newID is a random id of 32 hex digits. Ids of one length are prefix-free.
func newID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

func (x *exchange) run(parse func([]byte) (*genRequest, *apiError)) *apiError {
	if x.s.sidecar != nil {
		// Before the body is read: a request naming a prefiller it may not is refused
		// whatever it carries.
		if e := x.namePrefiller(); e != nil {
			return e
		}
	}
	body, e := readBody(x.w, x.r, x.s.cfg.MaxBodyBytes, x.s.cfg.ReadBodyTimeout)
	if e != nil {
		return e
	}
	req, e := parse(body)
	if e != nil {
		return e
	}
	req.route = x.route
	if x.class, e = x.s.classes.classify(x.r, req); e != nil {
		return e
	}
	if a := admissionOf(x.r.Context()); a != nil && x.class != nil {
		a.class = x.class.Name
	}
	x.req = req
	if e := x.refuseState(); e != nil {
		return e
	}
	if e := x.resolveModel(); e != nil {
		return e
	}
	x.hdr = x.s.engineHeader(x.r.Header)
	return x.track(x.serve)
}

// engineHeader is what of a client's headers goes to the engines.
func (s *Server) engineHeader(in http.Header) http.Header {
	hdr := upstreamHeader(in)
	if s.keys != nil {
		// The client's key is for the proxy; a backend that wants one has its own api_key.
		hdr.Del("Authorization")
	}
	if s.sidecar != nil {
		// upstreamHeader drops x-prefiller-*; a header of another name is dropped here.
		hdr.Del(s.sidecar.header)
	}
	if s.classes != nil && s.classes.header != "" {
		hdr.Del(s.classes.header) // the proxy's own
	}
	return hdr
}

// track serves a parsed request with serve while the table has it: the request's context
// (ended when its client leaves), its table entry, its custody, ended however serve ends,
// and the safety net for a panic.
func (x *exchange) track(serve func() *apiError) (e *apiError) {
	ctx, cancel := context.WithCancelCause(x.r.Context())
	defer cancel(nil)
	x.ctx, x.cancel = x.startRequest(ctx), cancel
	stop := context.AfterFunc(ctx, func() { x.goneAt.Store(time.Now().UnixNano()) })
	defer stop()

	if err := x.s.table.Begin(x.id, x.route, func() { cancel(errShuttingDown) }); err != nil {
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "duplicate_request_id",
			param: "X-Request-Id", message: "a request with this X-Request-Id is already in flight"}
	}
	x.own = &custody{id: x.id, engineID: x.engineID, span: x.traceParent()}
	defer func() {
		if c := x.handOff(); c != nil {
			c.end(x.s)
		}
	}()
	// Runs before the custody's end above: a panic fails the request the way its mode fails.
	defer x.recoverRequest(&e)
	return serve()
}

// errPanic is what a client is told when serving its request panicked.
var errPanic = &apiError{status: http.StatusBadGateway, typ: "internal_error", code: "internal",
	message: "the proxy failed while serving this request; it was aborted on its engines"}

// recoverRequest is the safety net of a request in flight: a panic while serving it still
// finishes it. It is failed the way its mode fails (what it holds is released, its legs
// aborted), counted in pdproxy_panics_total, logged with its id, and its client is told (a
// 502 when nothing was sent yet; an error event in a stream; a cut connection for a JSON
// answer under way). The panic never reaches net/http, which would drop the connection and
// leave the request uncounted.
func (x *exchange) recoverRequest(e **apiError) {
	v := recover()
	if v == nil {
		return
	}
	x.s.m.panics.Inc()
	x.s.logger.Error("panic serving a request", zap.String("request_id", x.id), zap.String("engine_request_id", x.engineID),
		zap.Any("panic", v), zap.StackSkip("stack", 1))
	func() {
		defer func() {
			if v := recover(); v != nil {
				x.s.m.panics.Inc()
				x.s.logger.Error("panic failing a request after a panic: its table entry ends as it is", zap.String("request_id", x.id), zap.Any("panic", v))
			}
		}()
		x.fail(router.Result{})
	}()
	*e = x.cut(errPanic)
}

// errEnginePanic is an engine call that panicked (an engine adapter's bug, or its
// transport's), made an error so that the call's owner releases what it holds as for any
// failed call.
var errEnginePanic = errors.New("an engine call panicked")

// guard runs an engine call for request id, turning a panic in it into errEnginePanic,
// counted in pdproxy_panics_total and logged. Calls in background goroutines need it: a panic
// there would end the process.
func (s *Server) guard(id string, call func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			s.m.panics.Inc()
			s.logger.Error("panic in an engine call", zap.String("request_id", id), zap.Any("panic", v), zap.StackSkip("stack", 2))
			err = fmt.Errorf("%w: %v", errEnginePanic, v)
		}
	}()
	return call()
}

// buildFailed is the answer to a request whose engine body could not be built.
func buildFailed(err error, what string) *apiError {
	if errors.Is(err, errEnginePanic) {
		return errPanic
	}
	return &apiError{status: http.StatusInternalServerError, typ: "internal_error", code: "internal", message: "could not build the " + what + " request", cause: err}
}

// recoverAnswer is the handler's last safety net, for a panic outside a request's serving
// (reading, parsing, answering): counted, logged, and a 502 when nothing was sent. The
// handler's own cut of a connection (http.ErrAbortHandler) passes.
func (x *exchange) recoverAnswer() {
	v := recover()
	if v == nil {
		return
	}
	if v == http.ErrAbortHandler {
		panic(v)
	}
	x.s.m.panics.Inc()
	x.s.logger.Error("panic answering a request", zap.String("request_id", x.id), zap.Any("panic", v), zap.StackSkip("stack", 1))
	if !x.finished {
		x.s.finish(x, errPanic.status, errPanic)
	}
	if !x.wrote {
		writeError(x.w, errPanic)
		return
	}
	// Part of the answer went out: only cutting the connection tells the client it failed.
	panic(http.ErrAbortHandler)
}

func (x *exchange) hint(exclude []string) router.Hint {
	h := router.Hint{RequestID: x.id, Prefix: x.req.prefix, Text: x.req.text, Tokens: x.tokens, Model: x.req.model, Exclude: exclude}
	if x.class != nil {
		h.Class, h.Slack = x.class.Name, x.class.MaxQueueWait
	}
	return h
}

// cacheRouter is what a router that routes on the engines' prefix caches offers: whether a
// role's policy wants the request's tokens, a tokenizer (an engine's /tokenize), and how many
// of a prompt's leading tokens a backend holds. Checked by type assertion: a router without
// it routes on the text alone.
type cacheRouter interface {
	WantsTokens(role router.Role) bool
	Tokens(ctx context.Context, req router.TokenizeRequest) ([]uint32, error)
	CachedTokens(backend string, tokens []uint32) (int, bool)
}

// tokenize gets the request's token ids once, before any backend is picked, when a policy
// scores engines by them (precise_cache_aware) or conditional disaggregation weighs them: a
// prompt of token ids is its own; anything else is asked of an engine. A request whose
// tokenizing fails is routed on its text.
func (x *exchange) tokenize() {
	cr, ok := x.s.router.(cacheRouter)
	if !ok || x.tokens != nil {
		return
	}
	if !cr.WantsTokens(router.RolePrefill) && !cr.WantsTokens(router.RoleDecode) && x.s.cfg.PDUncachedTokenThreshold <= 0 {
		return
	}
	if x.req.tokens != nil {
		x.tokens = x.req.tokens
		return
	}
	if x.req.text == "" || x.req.prompts > 1 || x.req.responses {
		// A Responses input renders through the engine's own conversion: the text routes it.
		return
	}
	req := router.TokenizeRequest{Model: x.req.model}
	if x.req.chat {
		req.Messages = x.req.messages
	} else {
		req.Prompt = x.req.text
	}
	toks, err := cr.Tokens(x.ctx, req)
	if err != nil {
		if ce := x.s.logger.Check(zap.DebugLevel, "tokenize failed: routing on the text"); ce != nil {
			ce.Write(zap.String("request_id", x.id), zap.Error(err))
		}
		return
	}
	x.tokens = toks
}

// cachedOnDecoder reports whether the reserved decoder already holds all but fewer than
// pd_uncached_token_threshold of the prompt's tokens, as its KV events tell: a remote
// prefill would only ship KV the decoder has, so the request goes decode-only.
func (x *exchange) cachedOnDecoder() bool {
	th := x.s.cfg.PDUncachedTokenThreshold
	cr, ok := x.s.router.(cacheRouter)
	if th <= 0 || !ok || len(x.tokens) == 0 || x.decodeB == nil {
		return false
	}
	n, fresh := cr.CachedTokens(x.decodeB.Name, x.tokens)
	return fresh && len(x.tokens)-n < th
}

// sequential accepts the engines that serve a request as a prefill, then a decode (vLLM),
// and pairedWith those that speak the same paired protocol as e (SGLang): one request never
// mixes the two.
func sequential(e router.Engine) bool { _, p := e.(kvbackend.Paired); return !p }

func pairedWith(d router.Engine) func(router.Engine) bool {
	return func(e router.Engine) bool { return e.Kind() == d.Kind() }
}

func (x *exchange) serve() *apiError {
	x.tokenize()
	if x.ctx.Err() != nil {
		return x.gone()
	}
	before := x.s.cfg.DecoderReservation != ReserveAfterPrefill
	if before {
		// The decoder is reserved first, so that a prefilled request never waits for one and
		// its KV is held only as long as sending the decode takes. Its engine says how the
		// request is served: paired legs (SGLang) go out together with it.
		if e := x.reserveDecoder(nil); e != nil {
			return e
		}
		if _, ok := engineOf(x.decodeB).(kvbackend.Paired); ok {
			return x.serveLegs()
		}
	}
	switch {
	case x.s.sidecar != nil && x.named == nil:
		// llm-d's scheduler sends no prefiller when it chose no prefill: llm-d's sidecar
		// then decodes the request alone, and so does this one.
		if !x.s.table.DecodeOnly(x.id) {
			return x.gone()
		}
		x.s.m.decodeOnly.WithLabelValues(reasonNoPrefiller).Inc()
	case x.s.sidecar == nil && !x.s.router.Has(router.RolePrefill):
	case x.req.decodeOnly != "":
		// P/D cannot serve this request safely: a decoder computes the prompt itself.
		if !x.s.table.DecodeOnly(x.id) {
			return x.gone()
		}
		x.s.m.decodeOnly.WithLabelValues(x.req.decodeOnly).Inc()
	case before && x.cachedOnDecoder():
		// Conditional disaggregation: the decoder computes the few uncached tokens itself.
		if !x.s.table.DecodeOnly(x.id) {
			return x.gone()
		}
		x.s.m.decodeOnly.WithLabelValues(decodeOnlyCached).Inc()
	default:
		if e := x.prefill(); e != nil {
			return e
		}
	}
	if !before {
		// Waiting for a decoder happens here, in kv_held: a client leaving meanwhile gets its KV
		// released, and the hold deadline keeps running. (Paired engines need their decoder
		// with the prefill, so this mode leaves them out.)
		if e := x.reserveDecoder(sequential); e != nil {
			return e
		}
	}
	return x.decode()
}

func (x *exchange) reserveDecoder(accept func(router.Engine) bool) *apiError {
	h := x.hint(nil)
	h.Accept = accept
	lease, err := x.s.router.Acquire(x.ctx, router.RoleDecode, h)
	if err != nil {
		if x.ctx.Err() != nil {
			return x.gone()
		}
		x.fail(router.Result{})
		return fromRouter(err, router.RoleDecode)
	}
	x.own.lease, x.decodeB = lease, lease.Backend()
	return nil
}

// engineOf is the engine a backend runs; the router carries it from config without knowing it.
func engineOf(b *router.Backend) kvbackend.Engine {
	if e, ok := b.Engine.(kvbackend.Engine); ok {
		return e
	}
	return kvbackend.VLLM
}

// resultOf turns a call's outcome into the router's passive-health input; a call ended by
// the client leaving says nothing about the backend.
func resultOf(err error, clientCtx context.Context) router.Result {
	if err == nil {
		return router.Result{Status: http.StatusOK}
	}
	if clientCtx != nil && clientCtx.Err() != nil {
		return router.Result{Canceled: true}
	}
	var se *kvbackend.StatusError
	if errors.As(err, &se) {
		return router.Result{Status: se.Status}
	}
	return router.Result{Err: err}
}

// retriable reports whether a call provably never started on its backend, so that another
// may take it: the backend never took it (kvbackend.CallError.Unprocessed), or, with refusals, the backend refused it with
// 502, 503 or 504. A decode that carried KV params is retried only on the first ground: a
// decoder that refused one may have told the prefiller already.
func retriable(err error, refusals bool) bool {
	var ce *kvbackend.CallError
	if errors.As(err, &ce) && ce.Unprocessed {
		return true
	}
	var se *kvbackend.StatusError
	if refusals && errors.As(err, &se) {
		return se.Status == http.StatusBadGateway || se.Status == http.StatusServiceUnavailable || se.Status == http.StatusGatewayTimeout
	}
	return false
}

func retryReason(err error) string {
	var se *kvbackend.StatusError
	if errors.As(err, &se) {
		return strconv.Itoa(se.Status)
	}
	if unprocessedAlive(err) {
		return "connection_reset"
	}
	return "connect_error"
}

func baseURL(b *router.Backend) string { return strings.TrimRight(b.URLString, "/") }

// call is the request's call to backend b on path, with the client's headers.
func (x *exchange) call(b *router.Backend, path string, body []byte) kvbackend.Call {
	c := backendCall(b, path, x.engineID, x.hdr, body)
	c.ClientID = x.id
	return c
}

func backendCall(b *router.Backend, path, id string, hdr http.Header, body []byte) kvbackend.Call {
	return kvbackend.Call{Client: b.Client(), BaseURL: baseURL(b), Path: path, ID: id, Header: hdr, Body: body, Engine: engineOf(b)}
}

// readBody reads the whole request body, bounded in size and in time: a body announced or
// found larger than the limit is 413 (announced, before a byte of it is read), one that does
// not arrive within read_body_timeout (bodyDeadline) is 408.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) ([]byte, *apiError) {
	tooLarge := &apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", code: "request_too_large",
		message: "request body is larger than the limit of " + formatBytes(limit)}
	if r.ContentLength > limit {
		return nil, tooLarge
	}
	// A body read to its end lifts the deadline: net/http's HTTP/1.1 server clears it for its
	// read that watches the connection while the answer is made (or the client would be taken
	// for gone at the deadline); on HTTP/2 it only ever ends the stream's body. After an error
	// it stays: net/http reads what is left of a body before it answers, and must not wait on
	// this one again.
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, tooLarge
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, &apiError{status: http.StatusRequestTimeout, typ: "invalid_request_error", code: "request_timeout",
				message: "the request body did not arrive within " + timeout.String(), cause: err}
		}
		return nil, &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "unreadable_body", message: "could not read the request body", cause: err}
	}
	return body, nil
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.FormatInt(n>>20, 10) + " MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.FormatInt(n>>10, 10) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " bytes"
}
