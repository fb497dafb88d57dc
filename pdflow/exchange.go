package pdflow

import (
	"context"
	"net/http"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
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
	Picked func(role routerconfig.Role, lease *router.Lease)
	// span is the request's trace span; nil when tracing is off.
	span  trace.Span
	Names naming
	Legs  legs
	Out   reply
	Tries tries
	Times timings
	// Sess is the session the request named (session_affinity); its zero value is none.
	Sess session
	// heads are where the replicas placed the heads of the request's text, in the prefill
	// and the decode pools (SharePlacements), read once (headsRead).
	heads     [2]heads
	headsRead bool
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
	// withKV records that the decode carried the prefiller's KV params.
	withKV bool
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

// Model is the model the client named, once its request was parsed.
func (x *Exchange) Model() string {
	switch {
	case x.Names.Client != "":
		return x.Names.Client
	case x.Req != nil:
		return x.Req.Model
	}
	return ""
}

// picked records a lease the request took for role, and tells Picked where it went.
func (x *Exchange) picked(role routerconfig.Role, lease *router.Lease) {
	x.Tries.taken.lease(lease)
	x.place(role, lease)
	if x.Picked != nil {
		x.Picked(role, lease)
	}
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
func (s *session) bound(role routerconfig.Role) string {
	if role == routerconfig.RolePrefill {
		return s.Prefill
	}
	return s.Decode
}

// boundText is how many bytes of its text the session's latest request sent the engine it
// was bound to for role.
func (s *session) boundText(role routerconfig.Role) int {
	if role == routerconfig.RolePrefill {
		return s.PrefillText
	}
	return s.DecodeText
}

// ReasonNoPrefiller is pdproxy_decode_only_total's reason for a request that came without a
// prefiller in the sidecar mode.
const ReasonNoPrefiller = "no_prefiller_header"

// NewExchange begins the exchange of one client request on route, id being the client's
// X-Request-Id (or one of the proxy's): the engines know it by a new random id of its own.
func (f *Flow) NewExchange(w http.ResponseWriter, r *http.Request, route, id string) *Exchange {
	x := &Exchange{s: f, W: w, R: r, Route: route, ID: id, EngineID: api.NewID()}
	x.Times.Start = time.Now()
	return x
}

// call is the request's call to backend b on path, with the client's headers.
func (x *Exchange) call(b *router.Backend, path string, body []byte) engine.Call {
	c := backendCall(b, path, x.EngineID, x.Hdr, body)
	c.ClientID = x.ID
	return c
}

// pairedLegs is the state of a request's paired legs, from the moment they went out.
type pairedLegs struct {
	// rids are the ids the request has on the engines, one per prompt.
	rids []string
	// neverTaken records that the decoder provably never took its leg (refused at connect):
	// the room may be drained by another decoder.
	neverTaken bool
	// cut cuts both legs' calls, the decoder's first, and reports whether the prefill leg had
	// been answered (the prefiller holds the KV); nil until the legs are under way.
	cut func() bool
	// drain is the engine's drain leg (engine.LegCalls.Drain); nil where an explicit abort
	// frees a hold.
	drain []byte
	// start is when the legs went out.
	start time.Time
	// joined records that the decoder has the room's KV (joinLegs).
	joined bool
}
