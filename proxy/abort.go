package proxy

// Every abort and every KV release of the proxy is in this file: what happens when a client
// leaves at each stage, when a request fails with KV held, when a decode never reached its
// decoder, when a prefill answers after its client left, and how a hold nobody will decode
// is freed (a drain, the engine's explicit abort, or its own timer).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

// custody is what a request holds while the proxy serves it: its entry in the table, the
// lease on the decoder reserved for it, and, once a decode its decoder never acknowledged has
// returned, the KV hold that decode carried. It has one owner at a time: the exchange while it
// serves, then whoever the exchange hands it to (a release, the legs' abort, a prefill let
// finish after the client left). Handing it on is taking it (handOff): the exchange has none
// afterwards. The owner ends it exactly once, with end or by running a release.
type custody struct {
	id       string // the request's key in the table
	engineID string // what the engines know it by
	// lease is the decoder reserved for the request; nil before that, and once given back.
	lease *router.Lease
	// res is what the lease is given back with: the decode's outcome, for passive health.
	res router.Result
	// unsent is a hold StartDecode handed over that no decoder acknowledged; nil else. Ending
	// the custody releases it.
	unsent *unsentHold
	// span is the request's trace span, the parent of its releases' and aborts' spans.
	span trace.SpanContext
}

// handOff takes the custody away from the exchange, for a new owner.
func (x *exchange) handOff() *custody {
	c := x.own
	x.own = nil
	return c
}

// setResult records the decode's outcome for the decoder's lease, while the exchange has the
// custody.
func (x *exchange) setResult(res router.Result) {
	if x.own != nil {
		x.own.res = res
	}
}

// giveBackLease ends the decoder's lease, if the custody still has one.
func (c *custody) giveBackLease(res router.Result) {
	if c.lease != nil {
		c.lease.Release(res)
		c.lease = nil
	}
}

// end ends the request: a hold no decoder acknowledged is released first (releaseUnsent, which
// ends the custody once it is), then its lease is given back and its table entry goes.
func (c *custody) end(s *Server) {
	if c.unsent != nil {
		s.releaseUnsent(c)
		return
	}
	c.giveBackLease(c.res)
	s.table.End(c.id)
}

// gone handles the client leaving: one transition of the table says what to abort.
func (x *exchange) gone() *apiError {
	act, hold, stage := x.s.table.ClientGone(x.id)
	if x.span != nil {
		x.span.SetAttributes(attrClientLeftStage.String(stage.String()))
	}
	seen := time.Now()
	if at := x.goneAt.Load(); at != 0 {
		seen = time.Unix(0, at)
	}
	x.s.aborts.add(x.abortRecord(stage, act, seen))
	switch act {
	case lifecycle.CancelPrefill:
		// The call's context is already cancelled, which closed the prefiller's connection.
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		if hold != nil {
			// Paired legs: the room is held until both are aborted, the decoder's first.
			x.s.abortLegs(x.handOff(), x.legRIDs, x.prefillB, x.decodeB, hold, x.cutLegs, x.legDrain, x.req)
		} else if b := x.prefillB; b != nil && canAbort(b) {
			// The engine may have finished its last step before the connection closed and
			// now hold KV nobody will pull (race R1): its explicit abort frees that too.
			x.s.abortOnEngine(x.traceParent(), x.engineID, b)
		}
	case lifecycle.ReleaseKV:
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		x.s.startRelease(release{mode: x.s.cfg.KVRelease, c: x.handOff(), hold: hold, req: x.req, prefill: x.prefillB, params: x.kvParams, heldAt: x.heldAt})
	case lifecycle.CancelDecode:
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		if x.paired {
			x.s.abortDecodeLeg(x.traceParent(), x.legRIDs, x.decodeB)
		}
	}
	if ce := x.s.logger.Check(zap.DebugLevel, "client gone"); ce != nil {
		ce.Write(zap.String("request_id", x.id), zap.Stringer("stage", stage), zap.Stringer("action", act))
	}
	return x.abandoned()
}

// abandoned is the answer to a request whose context ended, once its backend work was
// aborted: nothing for a client that left (499), but a client the proxy gives up on itself
// (shutdown past its drain deadline) is told so, never left to take an empty answer for a
// success.
func (x *exchange) abandoned() *apiError {
	if errors.Is(context.Cause(x.ctx), errShuttingDown) {
		return x.cut(errShutdownAnswer)
	}
	return errClientGone
}

// fail ends the request as failed, the one way its mode fails, and takes its custody; res is
// what the decoder's lease is given back with. Sequential P/D (and aggregated serving, which
// holds nothing): KV the prefiller still holds for the request is released. Paired legs: while
// the room is held, both legs are aborted, the decoder's first, so that neither waits for a
// partner that never comes; once they joined, the decoder's leg, which SGLang would otherwise
// notice only seconds after its connection closed.
func (x *exchange) fail(res router.Result) {
	c := x.handOff()
	if c == nil {
		return
	}
	c.res = res
	act, hold := x.s.table.Fail(x.id)
	switch {
	case x.paired && act == lifecycle.ReleaseKV:
		// No drain: the request failed because one of its engines did, and a drain would go
		// to its decoder, which may be that one.
		x.s.abortLegs(c, x.legRIDs, x.prefillB, x.decodeB, hold, x.cutLegs, nil, x.req)
	case x.paired:
		x.s.abortDecodeLeg(c.span, x.legRIDs, x.decodeB)
		c.end(x.s)
	case act == lifecycle.ReleaseKV:
		x.s.startRelease(release{mode: x.s.cfg.KVRelease, c: c, hold: hold, req: x.req, prefill: x.prefillB, params: x.kvParams, heldAt: x.heldAt})
	default:
		c.end(x.s)
	}
}

// decodeFailed is how a decode ends that failed or timed out, in either mode, before its
// answer or in the middle of it: a client that left is handled as gone; else the request fails
// (fail) and the client is told, in the way its answer so far allows (cut).
func (x *exchange) decodeFailed(err error, wd *watchdog) *apiError {
	res := resultOf(err, x.ctx)
	if x.ctx.Err() != nil && !wd.timedOut() {
		x.setResult(res)
		return x.gone()
	}
	if wd.timedOut() {
		err = errors.Join(context.Cause(wd.ctx), err)
		res = router.Result{Status: http.StatusGatewayTimeout}
		if x.paired && x.joined != nil {
			// A paired decoder starts only once the prefiller filled the room: silent
			// before that, it waits on the prefiller, and is not blamed for it.
			res = router.Result{Canceled: true}
		}
	}
	x.fail(res)
	return x.cut(fromBackend(err, router.RoleDecode, "decode_timeout"))
}

// abortDecodeLeg aborts a paired request's decoder leg: its engine's explicit abort for each of
// its rids.
func (s *Server) abortDecodeLeg(parent trace.SpanContext, rids []string, d *router.Backend) {
	if d == nil || !canAbort(d) {
		return
	}
	for _, rid := range rids {
		s.abortOnEngine(parent, rid, d)
	}
}

// canAbort reports whether b's engine has an explicit abort.
func canAbort(b *router.Backend) bool {
	_, ok := engineOf(b).(kvbackend.Aborter)
	return ok
}

// abortLegs frees a room that paired legs hold. The decoder is aborted first, then the
// prefiller, without waiting for the decoder's abort to succeed (aborting a prefiller in
// mid-transfer may leak; with the decoder told first no transfer starts, and a decoder that
// cannot be reached cannot claim the room either). A failed abort is tried again within a
// bound; one that never succeeds is counted (pdproxy_kv_release_failures_total{mode="abort"})
// and logged: with NIXL nothing else frees a prefiller's room, and a decoder keeps the blocks
// it reserved for the transfer until its waiting timeout. The hold (the prefiller's room) is
// released as aborted once the prefiller's abort succeeded. Both are repeated a moment later,
// as in abortOnEngine, in case an abort overtook its leg. abortLegs takes the request's
// custody and ends it once the hold is released.
//
// Engines without an explicit abort (vLLM's MooncakeConnector) are aborted by closing the
// legs' connections, the decoder's first (cut): a prefill cut before it ended holds nothing;
// one that was answered holds the KV until its engine's timer, unless a drain leg (drain, one
// token, the output discarded) makes the decoder pull it. A prefill that ended in the moment
// its connection closed holds its KV for the timer too (race R1: nothing else frees it).
func (s *Server) abortLegs(c *custody, rids []string, p, d *router.Backend, hold *lifecycle.Hold, cut func() bool, drain []byte, req *genRequest) {
	c.giveBackLease(c.res)
	if !canAbort(d) || !canAbort(p) {
		prefilled := cut != nil && cut()
		switch {
		case !prefilled:
			hold.Release(lifecycle.ReleaseAborted)
			c.end(s)
		case drain == nil || req == nil:
			hold.Release(lifecycle.ReleaseExpired)
			c.end(s)
		default:
			s.bg.Add(1)
			go func() {
				defer s.bg.Done()
				defer c.end(s)
				if s.drainLeg(c, d, req, drain) {
					hold.Release(lifecycle.ReleaseDrained)
					return
				}
				s.m.releaseFailure.WithLabelValues(ReleaseDrain).Inc()
				hold.Release(lifecycle.ReleaseExpired)
			}()
		}
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
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
			if len(pending) == 0 || i == abortRetries {
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
			s.m.releaseFailure.WithLabelValues(ReleaseAbort).Inc()
			msg := "could not abort a request's decode leg: the decoder keeps what it reserved for the room until its waiting timeout"
			if b == p {
				msg = "could not abort a request's prefill leg: the prefiller may hold its room until it restarts"
				hold.Release(lifecycle.ReleaseExpired)
			}
			s.logger.Error(msg, zap.String("engine_request_id", c.engineID), zap.String("backend", b.Name))
		}
	}()
}

// abortRetries and abortRetryBackoff bound the tries of an abort that frees KV: 3 tries
// within about a second.
const (
	abortRetries      = 3
	abortRetryBackoff = 150 * time.Millisecond
)

// unsentHold is a hold StartDecode handed over that no decoder acknowledged, with what its
// release needs.
type unsentHold struct {
	hold    *lifecycle.Hold
	req     *genRequest
	prefill *router.Backend
	params  json.RawMessage
	// avoid names a decoder that could not be reached with the hold: a drain goes elsewhere.
	avoid string
	// heldAt is when the prefiller began to hold it.
	heldAt time.Time
	// taken: the decode went out whole and its decoder neither acknowledged nor refused it, so
	// it may have read the params (a decoder that reads a request and then closes, or a
	// timeout while it pulls). No decoder may get them again: only the prefiller's explicit
	// abort, or its own lease, frees the blocks.
	taken bool
}

// releaseUnsent releases the custody's unsent hold, then ends the custody: the engine's
// explicit abort where it has one (it is exact, and a no-op if the decoder did pull the
// blocks), else kv_release, except that a hold a decoder may have taken is left to the
// engine rather than drained through a second decoder. A drain does not go to a decoder that
// could not be reached (avoid): it may be dead, and with nothing in flight it would be the
// first pick. One that answered is alive, and may be the only one there is.
func (s *Server) releaseUnsent(c *custody) {
	u := c.unsent
	c.unsent = nil
	c.giveBackLease(c.res)
	mode := s.cfg.KVRelease
	switch {
	case mode == ReleaseWait:
	case u.prefill != nil && canAbort(u.prefill):
		mode = ReleaseAbort
	case u.taken:
		mode = ReleaseWait
	}
	var exclude []string
	if u.avoid != "" {
		exclude = []string{u.avoid}
	}
	s.startRelease(release{mode: mode, c: c, hold: u.hold, req: u.req, prefill: u.prefill, params: u.params, exclude: exclude, heldAt: u.heldAt})
}

// handoff is a hold on its way to a decoder with the decode. It is open until the decoder
// acknowledges the decode ("100 Continue", which its server sends as the handler begins to
// read the body, or its answer's headers): the hold is then the decoder's, which pulls the
// blocks or tells the prefiller when it aborts or refuses the request. Or the proxy withdraws
// it first, when the decode returned without an acknowledgement: the hold is then the proxy's
// to release. A written request is no proof of delivery: a server still finishing the previous
// response on a reused connection drops a request whose connection closes before it reads it.
// So a decode cut short before it was acknowledged leaves the release to the proxy; one
// acknowledged is never sent to a second decoder, even when the answer, which for a whole
// JSON answer comes only at its end, never does. A client that leaves while the decode is on
// its way does not cut it before the acknowledgement (see watchdog): the decoder may have read
// it already. The acknowledgement arrives on the transport's goroutine, hence an atomic.
type handoff struct {
	state atomic.Int32
	held  unsentHold
}

const (
	handoffOpen int32 = iota
	handoffAcked
	handoffWithdrawn
)

// handOver starts the handoff of hold (nil: the decode carries none, and so is the handoff).
func (x *exchange) handOver(hold *lifecycle.Hold) *handoff {
	if hold == nil {
		return nil
	}
	return &handoff{held: unsentHold{hold: hold, req: x.req, prefill: x.prefillB, params: x.kvParams, heldAt: x.heldAt}}
}

// ack records the decoder's acknowledgement: the hold is the decoder's.
func (h *handoff) ack() {
	if h != nil && h.state.CompareAndSwap(handoffOpen, handoffAcked) {
		h.held.hold.Release(lifecycle.ReleaseDecoded)
	}
}

// withdraw ends a handoff the decoder d did not acknowledge, once the decode returned with
// err (nil: it was never sent): the hold, for the custody, with what its release may do. It is
// nil when the decoder acknowledged: the hold is the decoder's.
func (h *handoff) withdraw(err error, d *router.Backend) *unsentHold {
	if h == nil || !h.state.CompareAndSwap(handoffOpen, handoffWithdrawn) {
		return nil
	}
	u := h.held
	var se *kvbackend.StatusError
	var ce *kvbackend.CallError
	switch {
	case err == nil, errors.As(err, &se):
		// Never sent, or refused by a decoder that answered without reading it: alive, and
		// free to take the drain.
	case errors.As(err, &ce) && ce.Unprocessed:
		if ce.Connect {
			u.avoid = d.Name
		}
	default:
		u.taken = true
	}
	return &u
}

// refused reports whether a decoder refused, with err, a decode it had acknowledged.
func (h *handoff) refused(err error) bool {
	var se *kvbackend.StatusError
	return h != nil && h.state.Load() == handoffAcked && errors.As(err, &se)
}

// refusedAfterHandoff handles a decoder that refused a decode it had acknowledged, with its
// params: its engine tells the prefiller where RejectionFreesKV says so (vLLM #41269). Where
// not, the hold, which went to the decoder, is freed by the prefiller's explicit abort, or
// its lease: it may never go to a second decoder.
func (s *Server) refusedAfterHandoff(parent trace.SpanContext, engineID string, p, d *router.Backend, err error) {
	var se *kvbackend.StatusError
	errors.As(err, &se)
	status := se.Status
	if engineOf(d).RejectionFreesKV(status) || p == nil {
		return
	}
	if canAbort(p) {
		s.abortOnEngine(parent, engineID, p)
		return
	}
	s.logger.Warn("a decoder refused a decode it had the kv params of, and its engine does not tell the prefiller: the blocks stay held until the prefiller's lease ends",
		zap.String("engine_request_id", engineID), zap.String("decoder", d.Name), zap.Int("status", status))
}

// abortStaleHold frees a hold whose deadline passed before the decode went out (race R4):
// its params are never forwarded, and an engine with an explicit abort can free it at once
// rather than at its own timer.
func (s *Server) abortStaleHold(parent trace.SpanContext, id string, p *router.Backend) {
	if p != nil && canAbort(p) {
		s.abortOnEngine(parent, id, p)
	}
}

// abortBrokenPrefill aborts a prefill whose call failed after the prefiller took it (its
// answer broke or timed out): it may hold KV whose params never arrived, which the engine's
// explicit abort frees.
func (s *Server) abortBrokenPrefill(parent trace.SpanContext, id string, p *router.Backend, err error) {
	if mayHoldKV(err) && canAbort(p) {
		s.abortOnEngine(parent, id, p)
	}
}

// prefillAnswerAfterClientLeft ends a request whose prefill was let finish after its client
// left (abort_during_prefill finish_then_release): the KV it now holds is released at once.
func (s *Server) prefillAnswerAfterClientLeft(c *custody, req *genRequest, p *router.Backend, params json.RawMessage, err error) {
	if err != nil || params == nil {
		if err != nil {
			s.abortBrokenPrefill(c.span, c.engineID, p, err)
		}
		c.end(s)
		return
	}
	if act, hold := s.table.Prefilled(c.id, true); act == lifecycle.ReleaseKV {
		s.startRelease(release{mode: s.cfg.KVRelease, c: c, hold: hold, req: req, prefill: p, params: params, heldAt: time.Now()})
		return
	}
	c.end(s)
}

// abortOnEngine sends an engine's explicit abort in the background, on its own short
// deadline: the client's context is already done.
func (s *Server) abortOnEngine(parent trace.SpanContext, id string, b *router.Backend) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		if !s.abortCall(parent, id, b, "engine abort failed") {
			return
		}
		// The abort travels on its own connection and can overtake the request it aborts
		// (the engine has not read it yet, so it ignores an unknown id, then finishes the
		// request and holds its KV). A second abort a moment later closes that gap; for an
		// engine that already forgot the request it is a no-op.
		s.bg.Add(1)
		time.AfterFunc(abortRepeatDelay, func() {
			defer s.bg.Done()
			s.abortCall(parent, id, b, "repeated engine abort failed")
		})
	}()
}

// abortCall sends one explicit abort on its own short deadline (the client's context is done
// by then) and logs a failure with msg.
func (s *Server) abortCall(parent trace.SpanContext, id string, b *router.Backend, msg string) bool {
	eng, ok := engineOf(b).(kvbackend.Aborter)
	if !ok {
		return false
	}
	span := s.bgSpan(parent, spanAbort, b, attrEngineRequestID.String(id))
	ctx, cancel := context.WithTimeout(withSpan(context.Background(), span), defaultAbortCallTimeout)
	defer cancel()
	err := s.guard(id, func() error { return eng.Abort(ctx, b.AdminClient(), baseURL(b), id) })
	endSpan(span, err)
	if err != nil {
		s.logger.Warn(msg, zap.String("engine_request_id", id), zap.String("backend", b.Name), zap.Error(err))
		return false
	}
	return true
}

// abortRepeatDelay is when an explicit abort is sent again (see abortOnEngine).
const abortRepeatDelay = 250 * time.Millisecond

// release is a KV hold that no decoder will get, and what to free it with. The one path that
// took the hold (from the table, or from a decode its decoder never acknowledged) makes it,
// with the request's custody; running it releases the hold exactly once and ends the custody.
type release struct {
	// mode is kv_release's: drain, abort (the engine's explicit abort; a drain where it has
	// none) or wait (the engine's own timer).
	mode string
	c    *custody
	hold *lifecycle.Hold
	req  *genRequest
	// prefill holds the blocks; nil when unknown, and then only its timer frees them.
	prefill *router.Backend
	params  json.RawMessage
	// exclude names decoders a drain must not go to.
	exclude []string
	// heldAt is when the prefiller began to hold the KV.
	heldAt time.Time
	// span is the release's span, the parent of its drain's or abort's.
	span trace.SpanContext
}

// startRelease runs r, in the background unless there is nothing to send: the client is gone
// and nothing waits for it.
func (s *Server) startRelease(r release) {
	span := s.bgSpan(r.c.span, spanRelease, r.prefill, attrReleaseMode.String(r.mode))
	r.span = r.c.span
	if span != nil {
		r.span = span.SpanContext()
		if !r.heldAt.IsZero() {
			span.SetAttributes(attrKVHeldSeconds.Float64(time.Since(r.heldAt).Seconds()))
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
		reason := lifecycle.ReleaseExpired
		defer func() { endRelease(span, reason) }()
		// The entry ends only once the hold is released: an End before would release it as
		// expired while the drain or abort is still on its way.
		defer r.c.end(s)
		r.c.res = router.Result{Canceled: true}
		canAbort := canAbort(r.prefill)
		if r.mode == ReleaseAbort && canAbort {
			r.c.giveBackLease(r.c.res)
			if s.abortHold(r) {
				reason = lifecycle.ReleaseAborted
				return
			}
			s.m.releaseFailure.WithLabelValues(ReleaseAbort).Inc()
			r.hold.Release(lifecycle.ReleaseExpired)
			return
		}
		if s.drain(r) {
			r.hold.Release(lifecycle.ReleaseDrained)
			reason = lifecycle.ReleaseDrained
			return
		}
		s.m.releaseFailure.WithLabelValues(ReleaseDrain).Inc()
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

func (s *Server) abortHold(r release) bool {
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
func (s *Server) drainLeg(c *custody, d *router.Backend, req *genRequest, body []byte) bool {
	span := s.bgSpan(c.span, spanDrain, d, attrEngineRequestID.String(c.engineID))
	timeout := drainLegTimeout
	if t := s.cfg.DecodeFirstByteTimeout; t > 0 && t < timeout {
		timeout = t // a drain waits for a pull and one token: no longer than a decode's first byte
	}
	ctx, cancel := context.WithTimeout(withSpan(context.Background(), span), timeout)
	defer cancel()
	err := s.guard(c.id, func() error {
		resp, err := backendCall(d, req.route, c.engineID, nil, body).Do(ctx)
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

// drain sends a decoder a one-token decode with the held params, so that it pulls the blocks
// and the prefiller frees them: the decoder reserved for the request when the custody still
// has it, else any but r.exclude. It runs on its own deadline: the client that asked is gone.
// It may go past the decoders' in-flight limit: it frees memory, it must not queue behind load.
// A drain whose deadline passes after it reached the decoder still releases: the decoder
// aborts a do_remote_prefill request that was never scheduled and notifies the prefiller,
// which frees the blocks (vLLM does this; so does the simulator).
func (s *Server) drain(r release) bool {
	timeout := s.cfg.DrainTimeout
	if timeout <= 0 {
		timeout = r.prefill.KVHoldTimeout
	}
	if timeout <= 0 {
		timeout = defaultPhaseTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	lease := r.c.lease
	r.c.lease = nil
	if lease == nil {
		var err error
		lease, err = s.router.Acquire(ctx, router.RoleDecode, router.Hint{RequestID: r.c.id, Overcommit: true, Exclude: r.exclude, Accept: sequential})
		if err != nil {
			s.logger.Warn("kv drain found no decoder", zap.String("request_id", r.c.id), zap.Error(err))
			return false
		}
	}
	b := lease.Backend()
	eng, ok := engineOf(b).(kvbackend.Sequential)
	if !ok {
		lease.Release(router.Result{})
		return false
	}
	span := s.bgSpan(r.span, spanDrain, b, attrEngineRequestID.String(r.c.engineID))
	var err error
	defer func() { endSpan(span, err) }()
	ctx = withSpan(ctx, span)
	var body []byte
	err = s.guard(r.c.id, func() (err error) {
		body, err = eng.DrainBody(r.req.fields, r.req.chat, r.params)
		return err
	})
	if err != nil {
		lease.Release(router.Result{})
		return false
	}
	path := r.req.route
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
		lease.Release(router.Result{Canceled: true})
		return true
	}
	// A drain says little about the decoder's health (it may find the blocks already freed, by
	// design), so its outcome feeds no passive ejection.
	lease.Release(router.Result{})
	if err != nil {
		s.logger.Warn("kv drain failed", zap.String("request_id", r.c.id), zap.String("backend", b.Name), zap.Error(err))
		return false
	}
	return true
}

var (
	errFirstByteTimeout = fmt.Errorf("%w: no first byte from the decoder", errPhaseTimeout)
	errIdleTimeout      = fmt.Errorf("%w: the decoder went silent", errPhaseTimeout)
)

// ackGrace bounds how long a decode whose client left waits for the decoder's acknowledgement
// before it is cut: a healthy server acknowledges as soon as its handler reads the body.
const ackGrace = time.Second

// watchdog bounds a decode's phases (first byte, silence between chunks) and defers the
// client's cancel, when asked: to the decode's first byte (abort_during_kv_pull
// after_first_token), and, for a decode that carries a hold, to the decoder's acknowledgement
// (or ackGrace), so that the proxy learns whether the decoder has the params before it cuts
// the call.
type watchdog struct {
	ctx        context.Context
	cancel     context.CancelCauseFunc
	timer      *time.Timer
	idle       time.Duration
	toByte     bool // defer the client's cancel to the first byte
	toAck      bool // defer the client's cancel to the acknowledgement
	sawByte    atomic.Bool
	acked      atomic.Bool
	clientGone atomic.Bool
	timeout    atomic.Bool
	graceOnce  sync.Once
	grace      *time.Timer
	stopAfter  func() bool
}

func newWatchdog(client context.Context, toByte, toAck bool, firstByte, idle time.Duration) *watchdog {
	base := client
	if toByte || toAck {
		// Detached from the client on purpose: clientLeft cancels it when the wait is over.
		base = context.WithoutCancel(client)
	}
	ctx, cancel := context.WithCancelCause(base)
	wd := &watchdog{ctx: ctx, cancel: cancel, idle: idle, toByte: toByte, toAck: toAck}
	wd.timer = time.AfterFunc(firstByte, func() {
		wd.timeout.Store(true)
		if wd.sawByte.Load() {
			cancel(errIdleTimeout)
		} else {
			cancel(errFirstByteTimeout)
		}
	})
	if toByte || toAck {
		wd.stopAfter = context.AfterFunc(client, func() {
			wd.clientGone.Store(true)
			wd.cancelIfDone()
		})
	}
	return wd
}

// cancelIfDone cancels the call for a client that left, once nothing it waits for is pending.
func (wd *watchdog) cancelIfDone() {
	if !wd.clientGone.Load() || wd.toByte && !wd.sawByte.Load() {
		return
	}
	if wd.toAck && !wd.acked.Load() {
		wd.graceOnce.Do(func() {
			wd.grace = time.AfterFunc(ackGrace, func() { wd.cancel(context.Canceled) })
		})
		return
	}
	wd.cancel(context.Canceled)
}

// onAck records the decoder's acknowledgement of the decode.
func (wd *watchdog) onAck() {
	if !wd.acked.Swap(true) {
		wd.cancelIfDone()
	}
}

func (wd *watchdog) onBytes() {
	if !wd.sawByte.Swap(true) {
		wd.acked.Store(true)
		wd.cancelIfDone()
	}
	wd.timer.Reset(wd.idle)
}

func (wd *watchdog) timedOut() bool { return wd.timeout.Load() }

func (wd *watchdog) stop() {
	wd.timer.Stop()
	if wd.stopAfter != nil {
		wd.stopAfter()
	}
	wd.graceOnce.Do(func() {}) // no grace timer starts after this
	if wd.grace != nil {
		wd.grace.Stop()
	}
	wd.cancel(context.Canceled)
}
