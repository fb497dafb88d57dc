package pdflow

import (
	"context"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// track serves a parsed request with serve while the table has it: the request's context
// (ended when its client leaves), its table entry, and its custody, which serve takes and
// ends, or gives on, however it ends. The safety net for a panic fails the request with what
// it took (failTaken).
func (x *Exchange) track(serve func(c custody) *api.Error) (e *api.Error) {
	ctx, cancel := context.WithCancelCause(x.R.Context())
	defer cancel(nil)
	x.Ctx, x.Cancel = x.startRequest(ctx), cancel
	stop := context.AfterFunc(ctx, func() { x.Times.GoneAt.Store(time.Now().UnixNano()) })
	defer stop()

	if err := x.s.table.Begin(x.ID, x.Route, func() { cancel(api.ErrShuttingDown) }); err != nil {
		return api.NewError(api.KindDuplicateID, "a request with this X-Request-Id is already in flight").With("X-Request-Id", err, 0)
	}
	defer x.recoverRequest(&e)
	return serve(custody{id: x.ID, engineID: x.EngineID, span: x.traceParent()})
}

// ServeTracked serves the parsed request while the table has it (track), attempt after
// attempt (serve).
func (x *Exchange) ServeTracked() *api.Error {
	return x.track(func(c custody) *api.Error { return x.serve(c, x.attemptTraced) })
}

// serve serves the request, attempt after attempt while a stream goes on on other decoders
// (migration.go) or a pair that failed before the client got anything is replaced by a fresh
// one (freshpair.go). It ends the custody. An attempt hands the custody back with errMoveOn
// (still holding the decoder the stream leaves) and errFreshPair (holding nothing); with any
// other answer it ended it.
func (x *Exchange) serve(c custody, attempt func(c custody) (custody, *api.Error)) *api.Error {
	for {
		var e *api.Error
		switch c, e = attempt(c); e {
		case errMoveOn:
			if c, e = x.moveOn(c, x.Out.broke); e != nil {
				return e
			}
		case errFreshPair:
		default:
			return e
		}
	}
}

// attemptTraced is attempt under a span of its own.
func (x *Exchange) attemptTraced(c custody) (_ custody, e *api.Error) {
	x.startAttempt(x.Tries.N)
	x.Tries.N++
	defer func() { x.endAttempt(e) }()
	return x.attempt(c)
}

// attempt serves the request on one decoder (and one prefiller, under P/D). It hands the
// custody back with errMoveOn and errFreshPair, and ends it otherwise.
func (x *Exchange) attempt(c custody) (custody, *api.Error) {
	x.tokenize()
	if x.Ctx.Err() != nil {
		return custody{}, x.gone(c)
	}
	var e *api.Error
	before, accept := x.reservation()
	if before {
		// The decoder is reserved first, so that a prefilled request never waits for one and
		// its KV is held only as long as sending the decode takes. Its engine says how the
		// request is served: paired legs (SGLang) go out together with it.
		if c, e = x.reserveDecoder(c, accept); e != nil {
			return c, e
		}
		if _, ok := engineOf(x.Legs.Decode).(engine.Paired); ok {
			return x.serveLegs(c)
		}
	}
	var p prefilled
	switch {
	case x.s.sidecar && x.Legs.Named == nil:
		// llm-d's scheduler sends no prefiller when it chose no prefill: llm-d's sidecar
		// then decodes the request alone, and so does this one.
		if !x.s.table.DecodeOnly(x.ID) {
			return custody{}, x.gone(c)
		}
		x.s.m.DecodeOnly.WithLabelValues(ReasonNoPrefiller).Inc()
	case !x.s.sidecar && !x.s.router.Has(routerconfig.RolePrefill):
	case x.Req.DecodeOnly != "":
		// P/D cannot serve this request safely: a decoder computes the prompt itself.
		if !x.s.table.DecodeOnly(x.ID) {
			return custody{}, x.gone(c)
		}
		x.s.m.DecodeOnly.WithLabelValues(x.Req.DecodeOnly).Inc()
	case before && x.cachedOnDecoder():
		// Conditional disaggregation: the decoder computes the few uncached tokens itself.
		if !x.s.table.DecodeOnly(x.ID) {
			return custody{}, x.gone(c)
		}
		x.s.m.DecodeOnly.WithLabelValues(api.DecodeOnlyCached).Inc()
	default:
		if c, p, e = x.prefill(c); e != nil {
			return c, e
		}
	}
	if !before {
		// Waiting for a decoder happens here, in kv_held: a client leaving meanwhile gets its KV
		// released, and the hold deadline keeps running. (Paired engines need their decoder
		// with the prefill: reservation sent their requests the other way.)
		if c, e = x.reserveDecoder(c, sequential); e != nil {
			return c, e
		}
	}
	return x.decode(c, p)
}
