package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
)

// exchange is one client request on its way through the P/D flow: who asked and what, and a
// few small values, one per concern (its names, its legs, the answer being relayed, its
// timings). What it holds on the engines is not here: the request's custody moves from step
// to step of the flow as a value (custody.go). Only the handler's goroutine touches it, except
// where a field says otherwise.
type exchange struct {
	s *Server
	w http.ResponseWriter
	r *http.Request
	// ctx is the request's context: done when the client leaves, or when the proxy gives up
	// on the request (its cause then says why: api.ErrShuttingDown, a failed write).
	ctx    context.Context
	cancel context.CancelCauseFunc
	id     string // the client's X-Request-Id or one of ours: the table's key, in logs and in the answer
	// engineID is the id the engines see for this request, new and random for each one: an
	// engine's explicit abort (repeated a moment later) and SGLang's prefix match must never
	// reach another request, as they would through a client's id used twice.
	engineID string
	route    string
	req      *api.Request
	hdr      http.Header // headers passed on to backends
	// class is the request's priority class; nil when no class is configured.
	class *PriorityClass
	// span is the request's trace span; nil when tracing is off.
	span  trace.Span
	names naming
	legs  legs
	out   reply
	tries tries
	times timings
	// sess is the session the request named (session_affinity); its zero value is none.
	sess session
}

// naming is what the request's model is called: by the client, in its metrics, and how the
// answer is renamed back.
type naming struct {
	// client is the model the client named when it was an alias (req.model is then the
	// served one), empty else; rename puts it back into the answer.
	client string
	rename *api.Renamer
	// label is the request's model label, set when its model was resolved.
	label string
}

// legs are the engines a request runs on, and what passes between them.
type legs struct {
	// named is the prefiller the request's header named in the sidecar mode; nil else.
	named   *router.Backend
	prefill *router.Backend
	decode  *router.Backend
	// params are the prefiller's KV params, for the decoder; nil when it holds nothing.
	params json.RawMessage
	// heldAt is when the prefiller began to hold the request's KV (its answer, or the legs'
	// start), for the spans that release it.
	heldAt time.Time
	// fallback: no prefiller served, and the decoder computes the prompt (decode_only_fallback).
	fallback bool
	// tokens are the prompt's token ids, for the cache-aware policies and conditional
	// disaggregation (tokenize); nil when nothing asked for them or tokenizing failed.
	// lent: they are the router's, handed back (cacheRouter.ReturnTokens) when the
	// exchange ends.
	tokens []uint32
	lent   bool
	// paired is the state of paired legs (SGLang, Mooncake); nil for sequential P/D.
	paired *pairedLegs
}

// reply is the answer being relayed to the client.
type reply struct {
	wrote  bool // a byte of the answer went to the client
	chunks int
	// end watches what the client got for the end of the answer (stages.go).
	end api.EndWatch
	// translate, for a Messages request served as a chat completion, turns the engine's chat
	// answer into the Messages answer; nil else. Each attempt has its own.
	translate *api.ChatToMessages
	// afterGone counts the stream chunks read after the client left.
	afterGone int
	// abortConn: the answer broke after its headers went out in a non-streaming response; the
	// only honest end is to cut the connection.
	abortConn bool
	finished  bool // counted and logged (finish)
	// broke is why the stream's decoder failed, when the stream goes on elsewhere.
	broke error
	// resume is what the stream keeps to go on on another decoder (migration.go); nil when it
	// would not.
	resume *resume
}

// timings are when the request began and how long its phases took.
type timings struct {
	start   time.Time
	goneAt  atomic.Int64 // UnixNano when ctx was seen done; written by an AfterFunc
	ttft    time.Duration
	prefill time.Duration
	decode  time.Duration
}

// generate serves a generation route (/v1/completions, /v1/chat/completions, /v1/responses),
// whose bodies parse reads.
func (s *Server) generate(route string, parse func([]byte) (*api.Request, *api.Error)) http.HandlerFunc {
	return s.exchangeHandler(route, func(x *exchange) *api.Error { return x.run(parse) })
}

// exchangeHandler serves route with run, as one exchange: its id, its answer when run fails
// before a byte went out, its metrics and log line (finish), and the cut of a connection
// nothing honest can be sent on.
func (s *Server) exchangeHandler(route string, run func(x *exchange) *api.Error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		x := &exchange{s: s, w: w, r: r, route: route, id: requestID(r), engineID: api.NewID()}
		x.times.start = time.Now()
		w.Header().Set("X-Request-Id", x.id)
		defer x.recoverAnswer()
		err := run(x)
		status := http.StatusOK
		if err != nil {
			status = err.Status
			if !x.out.wrote {
				api.WriteError(w, err)
			}
		}
		s.finish(x, status, err)
		x.returnTokens()
		if x.out.abortConn || status == api.StatusClientClosed {
			// Nothing honest can be sent: the client left, or stopped reading, or the
			// headers and part of a non-streaming body are out. Returning would let net/http
			// answer 200 of its own when nothing was written, end a stream cleanly, or pass a
			// truncated JSON off as complete; cutting the connection (on HTTP/2, the stream)
			// tells a client still there that it failed.
			panic(http.ErrAbortHandler)
		}
	}
}

func (s *Server) finish(x *exchange, status int, err *api.Error) {
	x.out.finished = true
	x.endRequest(status, err)
	elapsed := time.Since(x.times.start)
	code := strconv.Itoa(status)
	model := x.names.label
	if model == "" {
		model = s.modelLabel(x.model()) // refused before its model was resolved
	}
	s.m.requests.WithLabelValues(x.route, code, model).Inc()
	s.m.duration.WithLabelValues(x.route, model).Observe(elapsed.Seconds())
	if x.times.ttft > 0 {
		s.m.ttft.WithLabelValues(x.route, model).Observe(x.times.ttft.Seconds())
	}
	level := zap.InfoLevel
	if status >= 500 && status != api.StatusClientClosed {
		level = zap.WarnLevel
	}
	ce := s.logger.Check(level, "request")
	if ce == nil {
		return
	}
	buf := logFields.Get().(*[]zap.Field)
	defer func() {
		clear(*buf) // the strings and errors they name go with the request
		logFields.Put(buf)
	}()
	fields := append((*buf)[:0],
		zap.String("request_id", x.id), zap.String("engine_request_id", x.engineID), zap.String("route", x.route), zap.Int("status", status),
		zap.Duration("duration", elapsed), zap.Duration("prefill_duration", x.times.prefill),
		zap.Duration("decode_duration", x.times.decode), zap.Duration("ttft", x.times.ttft),
	)
	if x.req != nil {
		fields = append(fields, zap.Bool("stream", x.req.Stream), zap.String("model", x.req.Model))
		if x.names.client != "" {
			fields = append(fields, zap.String("model_alias", x.names.client))
		}
	}
	if p := x.legs.prefill; p != nil {
		fields = append(fields, zap.String("prefill_backend", p.Name))
	}
	if d := x.legs.decode; d != nil {
		fields = append(fields, zap.String("decode_backend", d.Name))
	}
	if x.legs.fallback {
		fields = append(fields, zap.Bool("decode_only_fallback", true))
	}
	if x.tries.n > 1 {
		// Served by more than one attempt: on fresh pairs, or moved mid-stream.
		fields = append(fields, zap.Int("attempts", x.tries.n))
		if rs := x.out.resume; rs != nil && rs.attempt > 0 {
			fields = append(fields, zap.Int("migrations", rs.attempt))
		}
	}
	if err != nil {
		fields = append(fields, zap.String("error", err.Error()))
	}
	ce.Write(fields...)
	*buf = fields
}

// logFields are the buffers of the request log line's fields, reused: zap's cores encode
// the fields as Write is called (the observer of the tests copies them) and keep none.
var logFields = sync.Pool{New: func() any { b := make([]zap.Field, 0, 20); return &b }}

// model is the model the client named, once its request was parsed.
func (x *exchange) model() string {
	switch {
	case x.names.client != "":
		return x.names.client
	case x.req != nil:
		return x.req.Model
	}
	return ""
}

// requestID is the client's X-Request-Id when it sent a usable one, else a new random id.
func requestID(r *http.Request) string {
	if id := r.Header.Get("X-Request-Id"); id != "" && len(id) <= 128 && printable(id) {
		return id
	}
	return api.NewID()
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

func (x *exchange) run(parse func([]byte) (*api.Request, *api.Error)) *api.Error {
	if x.s.sidecar != nil {
		// Before the body is read: a request naming a prefiller it may not is refused
		// whatever it carries.
		if e := x.namePrefiller(); e != nil {
			return e
		}
	}
	if hs := x.s.cfg.SessionAffinity.Headers; len(hs) > 0 {
		if e := x.readSession(hs); e != nil {
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
	req.Route = x.route
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
	x.keyRequest()
	if e := x.planResume(); e != nil {
		return e
	}
	x.hdr = x.s.engineHeader(x.r.Header)
	return x.track(func(c *custody) *api.Error { return x.serve(c, x.attemptTraced) })
}

// engineHeader is what of a client's headers goes to the engines.
func (s *Server) engineHeader(in http.Header) http.Header {
	hdr := api.UpstreamHeader(in)
	if s.keys != nil {
		// The client's key is for the proxy; a backend that wants one has its own api_key.
		hdr.Del("Authorization")
		hdr.Del("X-Api-Key")
	}
	if s.sidecar != nil {
		// api.UpstreamHeader drops x-prefiller-*; a header of another name is dropped here.
		hdr.Del(s.sidecar.header)
	}
	if s.classes != nil && s.classes.header != "" {
		hdr.Del(s.classes.header) // the proxy's own
	}
	return hdr
}

// track serves a parsed request with serve while the table has it: the request's context
// (ended when its client leaves), its table entry, and its custody, which serve takes and
// ends, or gives on, however it ends. The safety net for a panic fails the request with the
// custody if it is still the exchange's.
func (x *exchange) track(serve func(c *custody) *api.Error) (e *api.Error) {
	ctx, cancel := context.WithCancelCause(x.r.Context())
	defer cancel(nil)
	x.ctx, x.cancel = x.startRequest(ctx), cancel
	stop := context.AfterFunc(ctx, func() { x.times.goneAt.Store(time.Now().UnixNano()) })
	defer stop()

	if err := x.s.table.Begin(x.id, x.route, func() { cancel(api.ErrShuttingDown) }); err != nil {
		return api.NewError(api.KindDuplicateID, "a request with this X-Request-Id is already in flight").With("X-Request-Id", err, 0)
	}
	c := &custody{id: x.id, engineID: x.engineID, span: x.traceParent()}
	defer x.recoverRequest(c, &e)
	return serve(c)
}

func (x *exchange) hint(role router.Role, exclude []string) router.Hint {
	if len(x.tries.avoid) > 0 {
		exclude = x.tries.avoided(exclude[:len(exclude):len(exclude)])
	}
	h := router.Hint{RequestID: x.id, Prefix: x.req.Prefix, Text: x.hintText(role), Tokens: x.legs.tokens, Model: x.req.Model, Exclude: exclude,
		LoRA: x.req.Key.LoRA, CacheSalt: x.req.Key.Salt, Session: x.sess.key, Bound: x.sess.bound(role),
		BoundText: x.sess.boundText(role)}
	if x.class != nil {
		h.Class, h.Slack = x.class.Name, x.class.MaxQueueWait
	}
	if x.s.tenants != nil {
		// Read from the headers at each leg: every route's legs queue as their tenant's.
		h.Flow, h.MaxWait = x.s.tenants.flowOf(x.r), x.s.tenants.wait
	}
	return h
}

// serve serves the request, attempt after attempt while a stream goes on on other decoders
// (migration.go) or a pair that failed before the client got anything is replaced by a fresh
// one (freshpair.go). It takes the custody.
func (x *exchange) serve(c *custody, attempt func(c *custody) *api.Error) *api.Error {
	for {
		switch e := attempt(c); e {
		case errMoveOn:
			if e := x.moveOn(c, x.out.broke); e != nil {
				return e
			}
		case errFreshPair:
		default:
			return e
		}
	}
}

// attemptTraced is attempt under a span of its own.
func (x *exchange) attemptTraced(c *custody) (e *api.Error) {
	x.startAttempt(x.tries.n)
	x.tries.n++
	defer func() { x.endAttempt(e) }()
	return x.attempt(c)
}

// attempt serves the request on one decoder (and one prefiller, under P/D). It takes the
// custody, except when the stream is to go on elsewhere (errMoveOn).
func (x *exchange) attempt(c *custody) *api.Error {
	x.tokenize()
	if x.ctx.Err() != nil {
		return x.gone(c)
	}
	before, accept := x.reservation()
	if before {
		// The decoder is reserved first, so that a prefilled request never waits for one and
		// its KV is held only as long as sending the decode takes. Its engine says how the
		// request is served: paired legs (SGLang) go out together with it.
		if e := x.reserveDecoder(c, accept); e != nil {
			return e
		}
		if _, ok := engineOf(x.legs.decode).(engine.Paired); ok {
			return x.serveLegs(c)
		}
	}
	switch {
	case x.s.sidecar != nil && x.legs.named == nil:
		// llm-d's scheduler sends no prefiller when it chose no prefill: llm-d's sidecar
		// then decodes the request alone, and so does this one.
		if !x.s.table.DecodeOnly(x.id) {
			return x.gone(c)
		}
		x.s.m.decodeOnly.WithLabelValues(reasonNoPrefiller).Inc()
	case x.s.sidecar == nil && !x.s.router.Has(router.RolePrefill):
	case x.req.DecodeOnly != "":
		// P/D cannot serve this request safely: a decoder computes the prompt itself.
		if !x.s.table.DecodeOnly(x.id) {
			return x.gone(c)
		}
		x.s.m.decodeOnly.WithLabelValues(x.req.DecodeOnly).Inc()
	case before && x.cachedOnDecoder():
		// Conditional disaggregation: the decoder computes the few uncached tokens itself.
		if !x.s.table.DecodeOnly(x.id) {
			return x.gone(c)
		}
		x.s.m.decodeOnly.WithLabelValues(api.DecodeOnlyCached).Inc()
	default:
		if e := x.prefill(c); e != nil {
			return e
		}
	}
	if !before {
		// Waiting for a decoder happens here, in kv_held: a client leaving meanwhile gets its KV
		// released, and the hold deadline keeps running. (Paired engines need their decoder
		// with the prefill: reservation sent their requests the other way.)
		if e := x.reserveDecoder(c, sequential); e != nil {
			return e
		}
	}
	return x.decode(c)
}

// reservation says whether the request's decoder is reserved before its prefill, and which
// engines that reservation accepts (nil: any). Under before_prefill it always is. Under
// after_prefill it is not, except for a request that only paired engines (SGLang, Mooncake)
// can serve now, every usable decoder of its model being one: their legs go out together, so
// the decoder is needed with the prefiller, and is reserved first as under before_prefill.
// While a decoder of a sequential engine (vLLM's NixlConnector) may serve the request, it is
// served by one, as after_prefill asks.
func (x *exchange) reservation() (before bool, accept func(router.Engine) bool) {
	if x.s.cfg.DecoderReservation != ReserveAfterPrefill {
		return true, nil
	}
	for _, d := range x.s.router.Available(router.RoleDecode) {
		if x.req.Model != "" && !d.Serves(x.req.Model) {
			continue
		}
		if sequential(d.Engine) {
			return false, nil
		}
		before = true
	}
	return before, paired
}

// reserveDecoder takes a lease on a decoder for the request, into its custody c; one accept
// takes, when set. On failure it takes the custody.
func (x *exchange) reserveDecoder(c *custody, accept func(router.Engine) bool) *api.Error {
	h := x.hint(router.RoleDecode, nil)
	h.Accept = accept
	if rs := x.out.resume; rs != nil && rs.attempt > 0 {
		h.Accept = func(e router.Engine) bool { return continuable(e) && (accept == nil || accept(e)) }
	}
	lease, err := x.s.router.Acquire(x.ctx, router.RoleDecode, h)
	if err != nil {
		return x.failWith(c, router.Result{}, api.FromRouter(err, router.RoleDecode))
	}
	x.picked(router.RoleDecode, lease)
	c.lease, x.legs.decode = lease, lease.Backend()
	return nil
}

// refuseState refuses, under P/D, a Responses request that needs state on one engine: an
// earlier response the engine stored (previous_response_id), a run it keeps after answering
// (background), or a response it is to store for later (store: true). Disaggregated serving
// puts a request on two engines and the next one on two others, so that state would be on an
// engine the next request may never reach. Without prefillers, the request goes to one
// engine and passes.
func (x *exchange) refuseState() *api.Error {
	if x.req.State == "" || (x.s.sidecar == nil && !x.s.router.Has(router.RolePrefill)) {
		return nil
	}
	how := map[string]string{
		"previous_response_id": "send the conversation so far in input, or the earlier response whole in previous_response",
		"background":           "send it in the foreground (stream it to keep the connection busy)",
		"store":                "send store: false (or leave it out) and keep the response on the client",
	}[x.req.State]
	return api.NewError(api.KindUnsupportedParam, fmt.Sprintf("%s needs state kept on one engine, which disaggregated prefill/decode serving cannot promise; %s", x.req.State, how)).With(x.req.State, nil, 0)
}
