package pdflow

// Every abort and every KV release of the proxy starts in this file: what happens when a
// client leaves at each stage, when a request fails with KV held, when a decode never reached
// its decoder, when a prefill answers after its client left, and how a hold nobody will
// decode is freed (a drain, the engine's explicit abort, or its own timer). Each takes the
// request's custody and ends it, or gives it on to the background work that does.

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// gone handles the client leaving (leave), and ends what of the request was left to it.
func (x *Exchange) gone(c custody) *api.Error {
	x.leave(c).end(x.s)
	return x.abandoned()
}

// leave handles the client leaving: one transition of the table says what to abort. It ends
// the custody where that gives it a hold to release (the zero custody comes back), and returns
// it otherwise.
func (x *Exchange) leave(c custody) custody {
	act, hold, stage := x.s.table.ClientGone(x.ID)
	if x.span != nil {
		x.span.SetAttributes(attrClientLeftStage.String(stage.String()))
	}
	seen := time.Now()
	if at := x.Times.GoneAt.Load(); at != 0 {
		seen = time.Unix(0, at)
	}
	x.s.aborts.add(x.abortRecord(stage, act, seen))
	if act != lifecycle.None {
		x.s.m.Propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
	}
	if ce := x.s.logger.Check(zap.DebugLevel, "client gone"); ce != nil {
		ce.Write(zap.String("request_id", x.ID), zap.Stringer("stage", stage), zap.Stringer("action", act))
	}
	p, pl := x.Legs.Prefill, x.Legs.paired
	switch act {
	case lifecycle.CancelPrefill:
		// The call's context is already cancelled, which closed the prefiller's connection.
		if hold != nil {
			// Paired legs: the room is held until both are aborted, the decoder's first.
			x.s.abortLegs(c, pl, p, x.Legs.Decode, hold, pl.drain, x.Legs.Decode, x.Req)
			return custody{}
		}
		if p != nil && canAbort(p) {
			// The engine may have finished its last step before the connection closed and
			// now hold KV nobody will pull (race R1): its explicit abort frees that too.
			x.s.abortOnEngine(x.traceParent(), x.EngineID, p)
		}
	case lifecycle.ReleaseKV:
		x.s.startRelease(x.s.cfg.KVRelease, c, x.held(hold))
		return custody{}
	case lifecycle.CancelDecode:
		if pl != nil {
			x.s.abortDecodeLeg(x.traceParent(), pl.rids, x.Legs.Decode)
		}
	}
	return c
}

// abandoned is the answer to a request whose context ended, once its backend work was
// aborted: nothing for a client that left (499), but a client the proxy gives up on itself
// (shutdown past its drain deadline) is told so, never left to take an empty answer for a
// success.
func (x *Exchange) abandoned() *api.Error {
	if errors.Is(context.Cause(x.Ctx), api.ErrShuttingDown) {
		return x.cut(api.ErrShutdownAnswer)
	}
	return api.ErrClientGone
}

// failWith is how a step of the flow fails with e: a client that left is handled as gone;
// else the request fails (fail, the decoder's lease given back with res) and the client is
// told e in the way its answer so far allows (cut). It ends the custody.
func (x *Exchange) failWith(c custody, res router.Result, e *api.Error) *api.Error {
	if x.Ctx.Err() != nil {
		return x.gone(c)
	}
	x.fail(c, res)
	return x.cut(e)
}

// fail ends the request as failed, the one way its mode fails, and ends its custody; res is
// what the decoder's lease is given back with. Sequential P/D (and aggregated serving, which
// holds nothing): KV the prefiller still holds for the request is released. Paired legs: while
// the room is held, both legs are aborted, the decoder's first, so that neither waits for a
// partner that never comes; once they joined, the decoder's leg, which SGLang would otherwise
// notice only seconds after its connection closed.
func (x *Exchange) fail(c custody, res router.Result) {
	c.res = res
	act, hold := x.s.table.Fail(x.ID)
	if act != lifecycle.ReleaseKV {
		hold = nil
	}
	x.letGo(c, hold)
}

// letGo lets go of what the request's legs hold once they failed, and ends the custody c:
// hold (nil when none is left to release) is released as the mode releases a
// failed request's, and paired legs are aborted. fail uses it for the request; a fresh pair
// (freshPair) for the attempt it replaces, with the attempt's own custody.
func (x *Exchange) letGo(c custody, hold *lifecycle.Hold) {
	pl := x.Legs.paired
	switch {
	case pl != nil && hold != nil:
		// No drain on its decoder: the request failed because one of its engines did, and
		// that may be the one. A decoder that provably never took its leg never had the
		// room either: another decoder of its kind may pull what an answered prefill holds.
		var drainOn *router.Backend
		if pl.neverTaken {
			drainOn = x.otherDecoder()
		}
		x.s.abortLegs(c, pl, x.Legs.Prefill, x.Legs.Decode, hold, pl.drain, drainOn, x.Req)
	case pl != nil:
		x.s.abortDecodeLeg(c.span, pl.rids, x.Legs.Decode)
		c.end(x.s)
	case hold != nil:
		x.s.startRelease(x.s.cfg.KVRelease, c, x.held(hold))
	default:
		c.end(x.s)
	}
}

// otherDecoder is a decoder of the request's decoder's kind other than it, usable now and
// serving the request's model, for a drain of the legs it failed with; nil when there is none.
func (x *Exchange) otherDecoder() *router.Backend {
	d := x.Legs.Decode
	for _, o := range x.s.router.Available(routerconfig.RoleDecode) {
		if o != d && o.Engine.Kind() == d.Engine.Kind() && (x.Req.Model == "" || o.Serves(x.Req.Model)) {
			return o
		}
	}
	return nil
}

// decodeFailed is how a decode ends that failed or timed out, in either mode, before its
// answer or in the middle of it: a client that left is handled as gone; else the request fails
// (fail) and the client is told, in the way its answer so far allows (cut). It ends the
// custody.
func (x *Exchange) decodeFailed(c custody, err error, wd *watchdog) *api.Error {
	res := resultOf(err, x.Ctx)
	if x.Ctx.Err() != nil && !wd.timedOut() {
		c.res = res
		return x.gone(c)
	}
	if wd.timedOut() {
		err = errors.Join(context.Cause(wd.ctx), err)
		res = router.Result{Status: http.StatusGatewayTimeout}
		if pl := x.Legs.paired; pl != nil && !pl.joined {
			// A paired decoder starts only once the prefiller filled the room: silent
			// before that, it waits on the prefiller, and is not blamed for it.
			res = router.Result{Canceled: true}
		}
	}
	x.fail(c, res)
	return x.cut(api.FromBackend(err, routerconfig.RoleDecode, api.KindDecodeTimeout))
}

// abortDecodeLeg aborts a paired request's decoder leg: its engine's explicit abort for each of
// its rids.
func (s *Flow) abortDecodeLeg(parent trace.SpanContext, rids []string, d *router.Backend) {
	if d == nil || !canAbort(d) {
		return
	}
	for _, rid := range rids {
		s.abortOnEngine(parent, rid, d)
	}
}

// abortLegs frees a room that paired legs hold. The decoder is aborted first, then the
// prefiller, without waiting for the decoder's abort to succeed (aborting a prefiller in
// mid-transfer may leak; with the decoder told first no transfer starts, and a decoder that
// cannot be reached cannot claim the room either). A failed abort is tried again within a
// bound; one that never succeeds is counted (pdproxy_kv_release_failures_total{mode="abort"})
// and logged: with NIXL nothing else frees a prefiller's room, and a decoder keeps the blocks
// it reserved for the transfer until its waiting timeout. The hold (the prefiller's room) is
// released as aborted once the prefiller's abort succeeded. Both are repeated a moment later,
// as in abortOnEngine, in case an abort overtook its leg. abortLegs ends the request's custody
// once the hold is released.
//
// Engines without an explicit abort (vLLM's MooncakeConnector) are aborted by closing the
// legs' connections, the decoder's first (cut): a prefill cut before it ended holds nothing;
// one that was answered holds the KV until its engine's timer, unless a drain leg (drain, one
// token, the output discarded) makes a decoder pull it: drainOn, when it is not nil. A prefill
// that ended in the moment its connection closed holds its KV for the timer too (race R1:
// nothing else frees it).
func (s *Flow) abortLegs(c custody, pl *pairedLegs, p, d *router.Backend, hold *lifecycle.Hold, drain []byte, drainOn *router.Backend, req *api.Request) {
	hold.Claim()
	c = c.withoutLease(c.res)
	rids := pl.rids
	if !canAbort(d) || !canAbort(p) {
		prefilled := pl.cut != nil && pl.cut()
		switch {
		case !prefilled:
			hold.Release(lifecycle.ReleaseAborted)
			c.end(s)
		case drain == nil || drainOn == nil || req == nil:
			hold.Release(lifecycle.ReleaseExpired)
			c.end(s)
		default:
			s.bg.Add(1)
			go func() {
				defer s.bg.Done()
				defer s.recoverBackground(c, hold)
				defer c.end(s)
				if s.drainLeg(c, drainOn, req, drain) {
					hold.Release(lifecycle.ReleaseDrained)
					return
				}
				s.m.ReleaseFailure.WithLabelValues(ReleaseDrain).Inc()
				hold.Release(lifecycle.ReleaseExpired)
			}()
		}
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		defer s.recoverBackground(c, hold)
		defer c.end(s)
		legs := []*router.Backend{d, p}
		pending := map[*router.Backend][]string{}
		for _, b := range legs {
			for _, rid := range rids {
				if !s.abortCall(c.span, rid, b, "engine abort failed") {
					pending[b] = append(pending[b], rid)
				}
			}
		}
		s.bg.Add(1)
		time.AfterFunc(abortRepeatDelay, func() {
			defer s.bg.Done()
			for _, b := range legs {
				for _, rid := range rids {
					s.abortCall(c.span, rid, b, "repeated engine abort failed")
				}
			}
		})
		for i := 1; ; i++ {
			if _, held := pending[p]; !held {
				hold.Release(lifecycle.ReleaseAborted) // the room is free; a no-op the second time
			}
			if len(pending) == 0 || i == AbortRetries {
				break
			}
			time.Sleep(abortRetryBackoff << (i - 1))
			for _, b := range legs {
				var still []string
				for _, rid := range pending[b] {
					if !s.abortCall(c.span, rid, b, "engine abort failed") {
						still = append(still, rid)
					}
				}
				if len(still) == 0 {
					delete(pending, b)
				} else {
					pending[b] = still
				}
			}
		}
		for _, b := range legs {
			if _, failed := pending[b]; !failed {
				continue
			}
			s.m.ReleaseFailure.WithLabelValues(ReleaseAbort).Inc()
			msg := "could not abort a request's decode leg: the decoder keeps what it reserved for the room until its waiting timeout"
			if b == p {
				msg = "could not abort a request's prefill leg: the prefiller may hold its room until it restarts"
				hold.Release(lifecycle.ReleaseExpired)
			}
			s.logger.Error(msg, zap.String("engine_request_id", c.engineID), zap.String("backend", b.Name))
		}
	}()
}

// AbortRetries and abortRetryBackoff bound the tries of an abort that frees KV: 3 tries
// within about a second.
const (
	AbortRetries      = 3
	abortRetryBackoff = 150 * time.Millisecond
)

// releaseUnsent releases the custody's unsent hold, then ends the custody: the engine's
// explicit abort where it has one (it is exact, and a no-op if the decoder did pull the
// blocks), else kv_release, except that a hold a decoder may have taken is left to the
// engine rather than drained through a second decoder. A drain does not go to a decoder that
// could not be reached (avoid): it may be dead, and with nothing in flight it would be the
// first pick. One that answered is alive, and may be the only one there is.
func (s *Flow) releaseUnsent(c custody) {
	u := c.unsent
	c.unsent = nil
	c = c.withoutLease(c.res)
	mode := s.cfg.KVRelease
	switch {
	case mode == ReleaseWait:
	case u.prefill != nil && canAbort(u.prefill):
		mode = ReleaseAbort
	case u.taken:
		mode = ReleaseWait
	}
	if u.avoid != "" {
		s.startRelease(mode, c, u.heldKV, u.avoid)
		return
	}
	s.startRelease(mode, c, u.heldKV)
}

// abortStaleHold frees a hold whose deadline passed before the decode went out (race R4):
// its params are never forwarded, and an engine with an explicit abort can free it at once
// rather than at its own timer.
func (s *Flow) abortStaleHold(parent trace.SpanContext, id string, p *router.Backend) {
	if p != nil && canAbort(p) {
		s.abortOnEngine(parent, id, p)
	}
}

// abortBrokenPrefill aborts a prefill whose call failed after the prefiller took it (its
// answer broke or timed out): it may hold KV whose params never arrived, which the engine's
// explicit abort frees.
func (s *Flow) abortBrokenPrefill(parent trace.SpanContext, id string, p *router.Backend, err error) {
	if mayHoldKV(err) && canAbort(p) {
		s.abortOnEngine(parent, id, p)
	}
}

// prefillAnswerAfterClientLeft ends a request whose prefill was let finish after its client
// left (abort_during_prefill finish_then_release): the KV it now holds is released at once.
func (s *Flow) prefillAnswerAfterClientLeft(c custody, req *api.Request, p *router.Backend, params json.RawMessage, err error) {
	if err != nil || params == nil {
		if err != nil {
			s.abortBrokenPrefill(c.span, c.engineID, p, err)
		}
		c.end(s)
		return
	}
	if act, hold := s.table.Prefilled(c.id, params); act == lifecycle.ReleaseKV {
		s.startRelease(s.cfg.KVRelease, c, heldKV{hold: hold, req: req, prefill: p})
		return
	}
	c.end(s)
}

// release is a KV hold that no decoder will get, and what to free it with. The one path that
// took the hold (from the table, or from a decode its decoder never acknowledged) starts it
// (startRelease), with the request's custody; running it releases the hold exactly once and
// ends the custody.
type release struct {
	heldKV
	// mode is kv_release's: drain, abort (the engine's explicit abort; a drain where it has
	// none) or wait (the engine's own timer).
	mode string
	c    custody
	// exclude names decoders a drain must not go to.
	exclude []string
	// span is the release's span, the parent of its drain's or abort's.
	span trace.SpanContext
}

// startRelease releases kv with mode and ends the custody c: in the background unless there
// is nothing to send (the client is gone and nothing waits for it). A drain goes to none of
// the decoders exclude names.
func (s *Flow) startRelease(mode string, c custody, kv heldKV, exclude ...string) {
	kv.hold.Claim()
	r := release{heldKV: kv, mode: mode, c: c, exclude: exclude, span: c.span}
	span := s.bgSpan(c.span, SpanRelease, r.prefill, attrReleaseMode.String(r.mode))
	if span != nil {
		r.span = span.SpanContext()
		if since := r.hold.Since(); !since.IsZero() {
			span.SetAttributes(attrKVHeldSeconds.Float64(time.Since(since).Seconds()))
		}
	}
	if r.mode == ReleaseWait || r.prefill == nil {
		r.hold.Release(lifecycle.ReleaseExpired)
		endRelease(span, lifecycle.ReleaseExpired)
		r.c.res = router.Result{Canceled: true}
		r.c.end(s)
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		defer s.recoverBackground(c, r.hold)
		reason := lifecycle.ReleaseExpired
		defer func() { endRelease(span, reason) }()
		// The entry ends only once the hold is released: an End before would release it as
		// expired while the drain or abort is still on its way.
		r.c.res = router.Result{Canceled: true}
		defer func() { r.c.end(s) }()
		canAbort := canAbort(r.prefill)
		if r.mode == ReleaseAbort && canAbort {
			r.c = r.c.withoutLease(r.c.res)
			if s.abortHold(r) {
				reason = lifecycle.ReleaseAborted
				return
			}
			s.m.ReleaseFailure.WithLabelValues(ReleaseAbort).Inc()
			r.hold.Release(lifecycle.ReleaseExpired)
			return
		}
		// The decoder reserved for the request, if it still is, takes the drain.
		lease := r.c.lease
		r.c.lease = nil
		if s.drain(r, lease) {
			r.hold.Release(lifecycle.ReleaseDrained)
			reason = lifecycle.ReleaseDrained
			return
		}
		s.m.ReleaseFailure.WithLabelValues(ReleaseDrain).Inc()
		if canAbort && s.abortHold(r) {
			reason = lifecycle.ReleaseAborted
			return
		}
		// Left to the engine's own timer; the proxy never forwards these params again.
		r.hold.Release(lifecycle.ReleaseExpired)
	}()
}

// endRelease ends a release's span with how the hold ended.
func endRelease(span trace.Span, reason lifecycle.ReleaseReason) {
	if span != nil {
		span.SetAttributes(attrReleaseReason.String(string(reason)))
		span.End()
	}
}

func (s *Flow) abortHold(r release) bool {
	if !s.abortCall(r.span, r.c.engineID, r.prefill, "kv release by abort failed") {
		return false
	}
	r.hold.Release(lifecycle.ReleaseAborted)
	return true
}

// drainLegTimeout bounds a drain leg: the prefill it drains had ended, so a decoder pulls at
// once; one that does not answer by then leaves the KV to the prefiller's timer.
const drainLegTimeout = 30 * time.Second

// drainLeg sends decoder d a paired request's drain leg, on its own deadline (the client is
// gone), and reports whether the decoder answered it: it pulled the held KV.
func (s *Flow) drainLeg(c custody, d *router.Backend, req *api.Request, body []byte) bool {
	span := s.bgSpan(c.span, SpanDrain, d, attrEngineRequestID.String(c.engineID))
	timeout := drainLegTimeout
	if t := s.cfg.DecodeFirstByteTimeout; t > 0 && t < timeout {
		timeout = t // a drain waits for a pull and one token: no longer than a decode's first byte
	}
	ctx, cancel := context.WithTimeout(withSpan(context.Background(), span), timeout)
	defer cancel()
	err := s.guard(c.id, func() error {
		resp, err := backendCall(d, req.Route, c.engineID, nil, body).Do(ctx)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return err
	})
	endSpan(span, err)
	if err != nil {
		s.logger.Warn("kv drain of aborted legs failed", zap.String("request_id", c.id), zap.String("backend", d.Name), zap.Error(err))
		return false
	}
	return true
}

// drainPause is how long a drain waits before it tries again: for a decoder to be usable
// when none is, or after one could not be reached.
const drainPause = 100 * time.Millisecond

// drain sends a decoder a one-token decode with the held params, so that it pulls the blocks
// and the prefiller frees them, and reports whether one did: first the decoder of lease, the
// one reserved for the request, which drain gives back; else, with lease nil, any but
// r.exclude. Each try runs on its own deadline (the client that asked is gone), and may go
// past the decoders' in-flight limit: it frees memory, it must not queue behind load. A
// decoder that provably never read the drain (its connection refused, or dropped unread) may
// be down: the drain goes to another, and while no decoder is usable it waits for one, a
// pause at a time, for as long as the hold's params may go to a decoder (Hold.Left) and the
// proxy is not stopping. The exclusions hold for one pick: a decoder that is the only one
// usable once the others stay down gets the drain again, as a restarted one should. A decoder
// that read the drain and failed may have read the params: no other decoder gets them.
func (s *Flow) drain(r release, lease *router.Lease) bool {
	until := time.Now().Add(r.hold.Left())
	exclude := r.exclude
	waiting := false
	for try := 0; ; try++ {
		if try > 0 {
			select {
			case <-time.After(drainPause):
			case <-s.stopping:
				s.logger.Warn("kv drain given up: the proxy is stopping", zap.String("request_id", r.c.id))
				return false
			}
		}
		if !time.Now().Before(until) {
			// Past the hold deadline the params go to no decoder (race R4).
			if lease != nil {
				lease.Release(router.Result{Canceled: true})
			}
			s.logger.Warn("kv drain not sent: the hold deadline passed before a decoder could take it", zap.String("request_id", r.c.id))
			return false
		}
		if lease == nil {
			ctx, cancel := context.WithDeadline(context.Background(), until)
			var err error
			lease, err = s.router.Acquire(ctx, routerconfig.RoleDecode, router.Hint{RequestID: r.c.id, Overcommit: true, Exclude: exclude, Accept: sequential})
			cancel()
			if errors.Is(err, router.ErrNoBackend) {
				if !waiting {
					waiting = true
					s.logger.Warn("kv drain waits for a decoder", zap.String("request_id", r.c.id), zap.Error(err))
				}
				exclude = nil
				continue
			}
			if err != nil {
				s.logger.Warn("kv drain found no decoder", zap.String("request_id", r.c.id), zap.Error(err))
				return false
			}
		}
		name := lease.Backend().Name
		ok, unread := s.drainOn(r, lease)
		if !unread {
			return ok
		}
		lease, exclude = nil, []string{name}
	}
}

// drainOn sends the drain to the decoder of lease, which it gives back, and reports whether
// the decoder took it (it pulled the held KV), and when not, whether the decoder provably never
// read it (unread), so that another may.
func (s *Flow) drainOn(r release, lease *router.Lease) (ok, unread bool) {
	b := lease.Backend()
	eng, isSeq := engineOf(b).(engine.Sequential)
	if !isSeq {
		lease.Release(router.Result{})
		return false, false
	}
	timeout := s.cfg.DrainTimeout
	if timeout <= 0 {
		timeout = r.prefill.KVHoldTimeout
	}
	if timeout <= 0 {
		timeout = DefaultPhaseTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	span := s.bgSpan(r.span, SpanDrain, b, attrEngineRequestID.String(r.c.engineID))
	var err error
	defer func() { endSpan(span, err) }()
	ctx = withSpan(ctx, span)
	var body []byte
	err = s.guard(r.c.id, func() (err error) {
		body, err = eng.DrainBody(r.req.Fields, r.req.API, r.hold.Params())
		return err
	})
	if err != nil {
		lease.Release(router.Result{})
		return false, false
	}
	path := r.req.Route
	var delivered atomic.Bool
	traced := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest: func(i httptrace.WroteRequestInfo) { delivered.Store(i.Err == nil) },
	})
	call := withHeader(backendCall(b, path, r.c.engineID, nil, body), nil, lease)
	err = s.guard(r.c.id, func() error {
		resp, err := call.Do(traced)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return err
	})
	if err != nil && ctx.Err() != nil && delivered.Load() {
		// A drain whose deadline passes after it reached the decoder still releases: the
		// decoder aborts a do_remote_prefill request that was never scheduled and notifies
		// the prefiller, which frees the blocks (vLLM does this; so does the simulator).
		lease.Release(router.Result{Canceled: true})
		return true, false
	}
	// A drain says little about the decoder's health (it may find the blocks already freed, by
	// design), so its outcome feeds no passive ejection.
	lease.Release(router.Result{})
	if err != nil {
		s.logger.Warn("kv drain failed", zap.String("request_id", r.c.id), zap.String("backend", b.Name), zap.Error(err))
		var ce *engine.CallError
		return false, errors.As(err, &ce) && ce.Unprocessed
	}
	return true, false
}

// end ends the request: a hold no decoder acknowledged is released first (releaseUnsent, which
// ends the custody once it is), then its lease is given back and its table entry goes (an
// attempt's custody leaves the entry to the request). The zero custody has nothing to end.
func (c custody) end(s *Flow) {
	switch {
	case !c.held():
	case c.unsent != nil:
		s.releaseUnsent(c)
	default:
		c = c.withoutLease(c.res)
		if !c.ofAttempt {
			s.table.End(c.id)
		}
	}
}

// abortRecord is the record of the client of x leaving while its request was in stage, seen
// gone at seen, with act done about it; the propagation is measured now, at the same point
// as pdproxy_abort_propagation_seconds.
func (x *Exchange) abortRecord(stage lifecycle.State, act lifecycle.Action, seen time.Time) AbortRecord {
	return AbortRecord{
		ID: x.ID, EngineRequestID: x.EngineID, Route: x.Route, Stage: stage, Action: act,
		Prefill: backendName(x.Legs.Prefill), Decode: backendName(x.Legs.Decode),
		At: seen, PropagationSeconds: time.Since(seen).Seconds(),
	}
}

// cut ends an answer that fails with e while its client is still there: e is the answer when
// nothing was sent yet. A stream whose status line went out long ago ends with an error event
// in the OpenAI shape, and no [DONE], so clients see it failed. A decoder that broke
// mid-event left a partial line: the error starts an event of its own, or the client would
// read it as the end of that line. A whole JSON answer under way can only be cut.
func (x *Exchange) cut(e *api.Error) *api.Error {
	switch {
	case !x.Out.Wrote:
	case x.Req.Stream:
		rc := http.NewResponseController(x.W)
		// The deadline of the last chunk may have passed during the decoder's silence: the
		// error event gets a write deadline of its own.
		x.writeDeadline(rc)
		x.W.Write(x.Out.end.EventBreak())
		switch x.Req.API {
		case engine.APIResponses:
			x.W.Write(api.ResponsesErrorEvent(e))
		case engine.APIMessages:
			x.W.Write(api.AnthropicErrorEvent(e))
		default:
			x.W.Write([]byte("data: "))
			x.W.Write(e.Body())
			x.W.Write([]byte("\n\n"))
		}
		rc.Flush()
	default:
		x.Out.AbortConn = true
	}
	return e
}
