package pdflow

import (
	"context"
	"encoding/json"
	"net/http"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
)

// Exchange is one client request on its way through the P/D flow: who asked and what, and a
// few small values, one per concern (its names, its legs, the answer being relayed, its
// timings). What it holds on the engines is not here: the request's custody moves from step
// to step of the flow as a value (custody.go). Only the handler's goroutine touches it, except
// where a field says otherwise.
type Exchange struct {
	s *Flow
	W http.ResponseWriter
	R *http.Request
	// Ctx is the request's context: done when the client leaves, or when the proxy gives up
	// on the request (its cause then says why: api.ErrShuttingDown, a failed write).
	Ctx    context.Context
	Cancel context.CancelCauseFunc
	ID     string // the client's X-Request-Id or one of ours: the table's key, in logs and in the answer
	// EngineID is the id the engines see for this request, new and random for each one: an
	// engine's explicit abort (repeated a moment later) and SGLang's prefix match must never
	// reach another request, as they would through a client's id used twice.
	EngineID string
	Route    string
	Req      *api.Request
	Hdr      http.Header // headers passed on to backends
	// Class and Slack are the request's priority class and how long it may wait in a queue
	// (Hint.Class, Hint.Slack); "" when no class is configured.
	Class string
	Slack time.Duration
	// Tenant is the request's tenant as the router's queues serve it, MaxWait the longest it
	// waits there (flow control); the zero Flow when flow control is off.
	Tenant  router.Flow
	MaxWait time.Duration
	// Picked, when set, is told where each pick of a role went (a session's binding).
	Picked func(role router.Role, lease *router.Lease)
	// span is the request's trace span; nil when tracing is off.
	span  trace.Span
	Names naming
	Legs  legs
	Out   reply
	Tries tries
	Times timings
	// Sess is the session the request named (session_affinity); its zero value is none.
	Sess session
}

// naming is what the request's model is called: by the client, in its metrics, and how the
// answer is renamed back.
type naming struct {
	// Client is the model the Client named when it was an alias (req.model is then the
	// served one), empty else; rename puts it back into the answer.
	Client string
	Rename *api.Renamer
	// Label is the request's model Label, set when its model was resolved.
	Label string
}

// legs are the engines a request runs on, and what passes between them.
type legs struct {
	// Named is the prefiller the request's header Named in the sidecar mode; nil else.
	Named   *router.Backend
	Prefill *router.Backend
	Decode  *router.Backend
	// params are the prefiller's KV params, for the decoder; nil when it holds nothing.
	params json.RawMessage
	// heldAt is when the prefiller began to hold the request's KV (its answer, or the legs'
	// start), for the spans that release it.
	heldAt time.Time
	// Fallback: no prefiller served, and the decoder computes the prompt (decode_only_fallback).
	Fallback bool
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
	Wrote  bool // a byte of the answer went to the client
	chunks int
	// end watches what the client got for the end of the answer (stages.go).
	end api.EndWatch
	// translate, for a Messages request served as a chat completion, turns the engine's chat
	// answer into the Messages answer; nil else. Each attempt has its own.
	translate *api.ChatToMessages
	// afterGone counts the stream chunks read after the client left.
	afterGone int
	// AbortConn: the answer broke after its headers went out in a non-streaming response; the
	// only honest end is to cut the connection.
	AbortConn bool
	Finished  bool // counted and logged (finish)
	// broke is why the stream's decoder failed, when the stream goes on elsewhere.
	broke error
	// Resume is what the stream keeps to go on on another decoder (migration.go); nil when it
	// would not.
	Resume *resume
}

// timings are when the request began and how long its phases took.
type timings struct {
	Start   time.Time
	GoneAt  atomic.Int64 // UnixNano when ctx was seen done; written by an AfterFunc
	TTFT    time.Duration
	Prefill time.Duration
	Decode  time.Duration
}

// model is the model the client named, once its request was parsed.
func (x *Exchange) Model() string {
	switch {
	case x.Names.Client != "":
		return x.Names.Client
	case x.Req != nil:
		return x.Req.Model
	}
	return ""
}

// track serves a parsed request with serve while the table has it: the request's context
// (ended when its client leaves), its table entry, and its custody, which serve takes and
// ends, or gives on, however it ends. The safety net for a panic fails the request with the
// custody if it is still the exchange's.
func (x *Exchange) track(serve func(c *custody) *api.Error) (e *api.Error) {
	ctx, cancel := context.WithCancelCause(x.R.Context())
	defer cancel(nil)
	x.Ctx, x.Cancel = x.startRequest(ctx), cancel
	stop := context.AfterFunc(ctx, func() { x.Times.GoneAt.Store(time.Now().UnixNano()) })
	defer stop()

	if err := x.s.table.Begin(x.ID, x.Route, func() { cancel(api.ErrShuttingDown) }); err != nil {
		return api.NewError(api.KindDuplicateID, "a request with this X-Request-Id is already in flight").With("X-Request-Id", err, 0)
	}
	c := &custody{id: x.ID, engineID: x.EngineID, span: x.traceParent()}
	defer x.recoverRequest(c, &e)
	return serve(c)
}

func (x *Exchange) hint(role router.Role, exclude []string) router.Hint {
	if len(x.Tries.avoid) > 0 {
		exclude = x.Tries.avoided(exclude[:len(exclude):len(exclude)])
	}
	h := router.Hint{RequestID: x.ID, Prefix: x.Req.Prefix, Text: x.HintText(role), Tokens: x.Legs.tokens, Model: x.Req.Model, Exclude: exclude,
		LoRA: x.Req.Key.LoRA, CacheSalt: x.Req.Key.Salt, Session: x.Sess.Key, Bound: x.Sess.bound(role),
		BoundText: x.Sess.boundText(role)}
	h.Class, h.Slack, h.Flow, h.MaxWait = x.Class, x.Slack, x.Tenant, x.MaxWait
	return h
}

// picked tells Picked where a pick for role went.
func (x *Exchange) picked(role router.Role, lease *router.Lease) {
	if x.Picked != nil {
		x.Picked(role, lease)
	}
}

// serveTracked serves the parsed request while the table has it (track), attempt after
// attempt (serve).
func (x *Exchange) ServeTracked() *api.Error {
	return x.track(func(c *custody) *api.Error { return x.serve(c, x.attemptTraced) })
}

// serve serves the request, attempt after attempt while a stream goes on on other decoders
// (migration.go) or a pair that failed before the client got anything is replaced by a fresh
// one (freshpair.go). It takes the custody.
func (x *Exchange) serve(c *custody, attempt func(c *custody) *api.Error) *api.Error {
	for {
		switch e := attempt(c); e {
		case errMoveOn:
			if e := x.moveOn(c, x.Out.broke); e != nil {
				return e
			}
		case errFreshPair:
		default:
			return e
		}
	}
}

// attemptTraced is attempt under a span of its own.
func (x *Exchange) attemptTraced(c *custody) (e *api.Error) {
	x.startAttempt(x.Tries.N)
	x.Tries.N++
	defer func() { x.endAttempt(e) }()
	return x.attempt(c)
}

// attempt serves the request on one decoder (and one prefiller, under P/D). It takes the
// custody, except when the stream is to go on elsewhere (errMoveOn).
func (x *Exchange) attempt(c *custody) *api.Error {
	x.tokenize()
	if x.Ctx.Err() != nil {
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
		if _, ok := engineOf(x.Legs.Decode).(engine.Paired); ok {
			return x.serveLegs(c)
		}
	}
	switch {
	case x.s.sidecar && x.Legs.Named == nil:
		// llm-d's scheduler sends no prefiller when it chose no prefill: llm-d's sidecar
		// then decodes the request alone, and so does this one.
		if !x.s.table.DecodeOnly(x.ID) {
			return x.gone(c)
		}
		x.s.m.DecodeOnly.WithLabelValues(ReasonNoPrefiller).Inc()
	case !x.s.sidecar && !x.s.router.Has(router.RolePrefill):
	case x.Req.DecodeOnly != "":
		// P/D cannot serve this request safely: a decoder computes the prompt itself.
		if !x.s.table.DecodeOnly(x.ID) {
			return x.gone(c)
		}
		x.s.m.DecodeOnly.WithLabelValues(x.Req.DecodeOnly).Inc()
	case before && x.cachedOnDecoder():
		// Conditional disaggregation: the decoder computes the few uncached tokens itself.
		if !x.s.table.DecodeOnly(x.ID) {
			return x.gone(c)
		}
		x.s.m.DecodeOnly.WithLabelValues(api.DecodeOnlyCached).Inc()
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
func (x *Exchange) reservation() (before bool, accept func(router.Engine) bool) {
	if x.s.cfg.DecoderReservation != ReserveAfterPrefill {
		return true, nil
	}
	for _, d := range x.s.router.Available(router.RoleDecode) {
		if x.Req.Model != "" && !d.Serves(x.Req.Model) {
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
func (x *Exchange) reserveDecoder(c *custody, accept func(router.Engine) bool) *api.Error {
	h := x.hint(router.RoleDecode, nil)
	h.Accept = accept
	if rs := x.Out.Resume; rs != nil && rs.Attempt > 0 {
		h.Accept = func(e router.Engine) bool { return continuable(e) && (accept == nil || accept(e)) }
	}
	lease, err := x.s.router.Acquire(x.Ctx, router.RoleDecode, h)
	if err != nil {
		return x.failWith(c, router.Result{}, api.FromRouter(err, router.RoleDecode))
	}
	x.picked(router.RoleDecode, lease)
	c.lease, x.Legs.Decode = lease, lease.Backend()
	return nil
}

// session is what a request knows of its session: its key ("" for none), and the engines it
// was bound to for each role when the request arrived (from shared state; "" for none).
type session struct {
	Key             string
	Prefill, Decode string
	// PrefillText and DecodeText are how many bytes of its text the session's latest request
	// sent the engine it was bound to for each role (from shared state; 0 for unknown).
	PrefillText, DecodeText int
}

// bound is the engine the session was bound to for role.
func (s *session) bound(role router.Role) string {
	if role == router.RolePrefill {
		return s.Prefill
	}
	return s.Decode
}

// boundText is how many bytes of its text the session's latest request sent the engine it
// was bound to for role.
func (s *session) boundText(role router.Role) int {
	if role == router.RolePrefill {
		return s.PrefillText
	}
	return s.DecodeText
}

// ReasonNoPrefiller is pdproxy_decode_only_total's reason for a request that came without a
// prefiller in the sidecar mode.
const ReasonNoPrefiller = "no_prefiller_header"
