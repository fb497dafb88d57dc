package pdflow

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// prefill runs the prefill call, on another prefiller when one provably never started it,
// and falls back to a decode-only request when no prefiller can serve and that is allowed. It
// returns the custody, and what the prefill left for the decode; on failure it ends the
// custody.
func (x *Exchange) prefill(c custody) (custody, prefilled, *api.Error) {
	start := time.Now()
	defer func() { x.Times.Prefill = time.Since(start) }()
	var (
		body    []byte
		bodyFor engine.Sequential // the engine body was built for
		tried   []string
		lastErr error
	)
	for attempt := 0; attempt <= x.s.cfg.PrefillRetries; attempt++ {
		h := x.hint(routerconfig.RolePrefill, tried)
		h.Accept = sequential
		lease, b, err := x.pickPrefiller(h)
		if err != nil {
			if x.Ctx.Err() != nil {
				return custody{}, prefilled{}, x.gone(c)
			}
			if attempt == 0 && errors.Is(err, router.ErrNoBackend) && len(x.s.router.Available(routerconfig.RolePrefill)) == 0 {
				// No prefiller is usable at all: prefill_unavailable says what to do.
				c, e := x.prefillUnavailable(c, err)
				return c, prefilled{}, e
			}
			if lastErr == nil {
				lastErr = err
			}
			break
		}
		x.Legs.Prefill = b
		if eng, _ := engineOf(b).(engine.Sequential); eng != bodyFor {
			if eng == nil {
				err = errors.New("the prefiller's engine does not serve a prefill on its own")
			} else {
				err = x.s.guard(x.ID, func() (err error) {
					body, err = eng.PrefillBody(x.Req.Fields, x.Req.API)
					return err
				})
			}
			if err != nil {
				lease.Release(router.Result{Canceled: true})
				return custody{}, prefilled{}, x.failWith(c, router.Result{}, BuildFailed(err, "prefill"))
			}
			bodyFor = eng
		}
		if attempt > 0 {
			// Counted only now that another prefiller takes it: a retry with nobody left to
			// try is no retry.
			x.s.m.Retries.WithLabelValues(string(routerconfig.RolePrefill), retryReason(lastErr)).Inc()
		}
		var started bool
		if attempt == 0 {
			started = x.s.table.StartPrefill(x.ID, b.Name)
		} else {
			started = x.s.table.PrefillRetry(x.ID, b.Name)
		}
		if !started {
			lease.Release(router.Result{Canceled: true})
			return custody{}, prefilled{}, x.gone(c)
		}
		var params json.RawMessage
		c, params, err = x.callPrefill(c, lease, b, body)
		if !unprocessedAlive(err) {
			// A prefiller that provably dropped the call on a kept-open connection is alive
			// and may take it again; any other failure sends the retry elsewhere.
			tried = append(tried, b.Name)
		}
		if !c.held() {
			// The client left during the call, which took the custody with it.
			return custody{}, prefilled{}, x.abandoned()
		}
		if err == nil {
			act, hold := x.s.table.Prefilled(x.ID, params)
			if act == lifecycle.ReleaseKV {
				// The request was aborted while the prefill ran. Cannot happen while only
				// this goroutine moves it; kept so that a hold is never dropped if that changes.
				x.s.startRelease(x.s.cfg.KVRelease, c, x.held(hold))
				return custody{}, prefilled{}, x.abandoned()
			}
			if x.Ctx.Err() != nil {
				return custody{}, prefilled{}, x.gone(c)
			}
			return c, prefilled{params}, nil
		}
		if x.Ctx.Err() != nil {
			return custody{}, prefilled{}, x.gone(c)
		}
		x.s.abortBrokenPrefill(x.traceParent(), x.EngineID, b, err)
		lastErr = err
		if !retriable(err, true) {
			break
		}
	}
	if errors.Is(lastErr, router.ErrTenantQueueFull) || errors.Is(lastErr, router.ErrPoolSaturated) {
		// Flow control refused the tenant its prefill: a decode-only fallback would let it
		// past its share on the decoders.
		return custody{}, prefilled{}, x.failWith(c, router.Result{}, api.FromRouter(lastErr, routerconfig.RolePrefill))
	}
	var se *engine.StatusError
	clientFault := errors.As(lastErr, &se) && se.Status >= 400 && se.Status < 500
	if !clientFault && *x.s.cfg.DecodeOnlyFallback {
		// Nobody prefilled: move on without KV, the decoder computes the prompt itself.
		if !x.s.table.DecodeOnly(x.ID) {
			return custody{}, prefilled{}, x.gone(c)
		}
		x.Legs.Fallback = true
		x.s.m.Fallbacks.Inc()
		return c, prefilled{}, nil
	}
	if rerr := lastErr; rerr != nil && (errors.Is(rerr, router.ErrNoBackend) || errors.Is(rerr, router.ErrQueueFull) || errors.Is(rerr, router.ErrQueueTimeout)) {
		return custody{}, prefilled{}, x.failWith(c, router.Result{}, api.FromRouter(rerr, routerconfig.RolePrefill))
	}
	return custody{}, prefilled{}, x.failWith(c, router.Result{}, api.FromBackend(lastErr, routerconfig.RolePrefill, api.KindPrefillTimeout))
}

// prefillUnavailable serves a request the pool has no usable prefiller for, as
// prefill_unavailable says: on a decoder alone, or not at all. It returns the custody, or ends
// it when it fails.
func (x *Exchange) prefillUnavailable(c custody, err error) (custody, *api.Error) {
	if x.s.cfg.PrefillUnavailable != PrefillUnavailableDecode {
		return custody{}, x.failWith(c, router.Result{}, api.FromRouter(err, routerconfig.RolePrefill))
	}
	if !x.s.table.DecodeOnly(x.ID) {
		return custody{}, x.gone(c)
	}
	x.Legs.Fallback = true
	x.s.m.Fallbacks.Inc()
	return c, nil
}

// prefilled is what a prefill left on its prefiller for the decode: the KV params that name
// the blocks it holds for the request (nil: it holds none, or no prefill ran). The hold is the
// table's until the decode takes it (StartDecode) or a release does, and names the same params.
type prefilled struct {
	params json.RawMessage
}

type prefillAnswer struct {
	params json.RawMessage
	err    error
}

// callPrefill makes the prefill call. With abort_during_prefill cancel the call carries the
// request's context, so the client leaving closes the prefiller's connection at once. With
// finish_then_release it runs on a context detached from the client on purpose: if the
// client leaves, the call goes on in the background and takes the request's custody, so that
// its KV is released as soon as the prefiller answers: the custody returned is then the zero
// one (the client's leaving has been handled, and the custody went with the call). Else it is
// c, with the prefiller's answer.
func (x *Exchange) callPrefill(c custody, lease *router.Lease, b *router.Backend, body []byte) (custody, json.RawMessage, error) {
	call := withHeader(x.call(b, x.Req.Route, body), nil, lease)
	timeout := x.s.cfg.PrefillTimeout
	span := x.callSpan(SpanPrefill, b)
	if x.s.cfg.AbortDuringPrefill == AbortPrefillCancel {
		ctx, cancel := context.WithTimeoutCause(withSpan(x.Ctx, span), timeout, api.ErrPhaseTimeout)
		defer cancel()
		var params json.RawMessage
		err := x.s.guard(x.ID, func() (err error) {
			params, err = call.Prefill(ctx)
			return err
		})
		if err == nil {
			lease.Prefilled() // the prefill's end, for the router's cost books
		}
		lease.Release(resultOf(err, x.Ctx))
		if err != nil && context.Cause(ctx) == api.ErrPhaseTimeout {
			err = errors.Join(api.ErrPhaseTimeout, err)
		}
		endSpan(span, err)
		return c, params, err
	}

	var taken atomic.Bool // set by whichever side handles the answer: the handler, or the call
	answer := make(chan prefillAnswer, 1)
	adopt := make(chan custody, 1)
	s, req := x.s, x.Req
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		ctx, cancel := context.WithTimeoutCause(withSpan(context.WithoutCancel(x.Ctx), span), timeout, api.ErrPhaseTimeout)
		defer cancel()
		var params json.RawMessage
		err := s.guard(x.ID, func() (err error) {
			params, err = call.Prefill(ctx)
			return err
		})
		if err == nil {
			lease.Prefilled()
		}
		lease.Release(resultOf(err, nil))
		if err != nil && context.Cause(ctx) == api.ErrPhaseTimeout {
			err = errors.Join(api.ErrPhaseTimeout, err)
		}
		endSpan(span, err)
		if taken.CompareAndSwap(false, true) {
			answer <- prefillAnswer{params, err}
			return
		}
		// The handler gave up on the client and hands over the request's custody.
		if c := <-adopt; c.held() {
			defer s.recoverBackground(c, nil)
			s.prefillAnswerAfterClientLeft(c, req, b, params, err)
		}
	}()
	select {
	case res := <-answer:
		return c, res.params, res.err
	case <-x.Ctx.Done():
		if taken.CompareAndSwap(false, true) {
			// The table learns first that the client left, so that the answer, whenever it
			// comes, is taken for a hold nobody will decode. The decoder reserved for the
			// request is of no use to it any more.
			adopt <- x.leave(c).withoutLease(router.Result{Canceled: true})
			return custody{}, nil, nil
		}
		res := <-answer
		return c, res.params, res.err
	}
}
