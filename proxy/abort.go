package proxy

// Every abort and every KV release of the proxy is in this file: what happens when a client
// leaves at each stage, when a request fails with KV held, when a decode never reached its
// decoder, when a prefill answers after its client left, and how a hold nobody will decode
// is freed (a drain, the engine's explicit abort, or its own timer).

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http/httptrace"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
)

// custody is what a request holds while the proxy serves it: its entry in the table, the
// lease on the decoder reserved for it, and, between StartDecode and the decoder's answer,
// the KV hold on its way to that decoder. It has one owner at a time: the exchange while it
// serves, then whoever the exchange hands it to (a release, a prefill let finish after the
// client left). The owner ends it exactly once, with end or by running a release.
type custody struct {
	id       string // the request's key in the table
	engineID string // what the engines know it by
	// lease is the decoder reserved for the request; nil before that, and once given back.
	lease *router.Lease
	// res is what the lease is given back with: the decode's outcome, for passive health.
	res router.Result
	// hold is a hold StartDecode handed over and no decoder has acknowledged yet; nil else.
	hold *lifecycle.Hold
	// avoid names a decoder that could not be reached with the hold: its release's drain
	// goes elsewhere. Empty: any decoder will do.
	avoid string
}

// handOff takes the custody away from the exchange, for a new owner.
func (x *exchange) handOff() *custody {
	c := x.own
	x.own = nil
	return c
}

// giveBackLease ends the decoder's lease, if the custody still has one.
func (c *custody) giveBackLease(res router.Result) {
	if c.lease != nil {
		c.lease.Release(res)
		c.lease = nil
	}
}

// end ends the request: its lease is given back and its table entry goes. A hold still here
// was never sent (every path that sends or releases it takes it first): it is left to the
// engine's timer, and so counted as expired.
func (c *custody) end(s *Server) {
	c.giveBackLease(c.res)
	if c.hold != nil {
		c.hold.Release(lifecycle.ReleaseExpired)
		c.hold = nil
	}
	s.table.End(c.id)
}

// gone handles the client leaving: one transition of the table says what to abort.
func (x *exchange) gone() *apiError {
	act, hold, stage := x.s.table.ClientGone(x.id)
	seen := time.Now()
	if at := x.goneAt.Load(); at != 0 {
		seen = time.Unix(0, at)
	}
	switch act {
	case lifecycle.CancelPrefill:
		// The call's context is already cancelled, which closed the prefiller's connection.
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		if hold != nil {
			// Paired legs: the room is held until both are aborted, the decoder's first.
			x.s.abortLegs(x.handOff(), x.legRIDs, x.prefillB, x.decodeB, hold)
		} else if b := x.prefillB; b != nil && engineOf(b).CanAbort() {
			// The engine may have finished its last step before the connection closed and
			// now hold KV nobody will pull (race R1): its explicit abort frees that too.
			x.s.abortOnEngine(x.engineID, b)
		}
	case lifecycle.ReleaseKV:
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		x.s.startRelease(release{mode: x.s.cfg.KVRelease, c: x.handOff(), hold: hold, req: x.req, prefill: x.prefillB, params: x.kvParams})
	case lifecycle.CancelDecode:
		x.s.m.propagation.WithLabelValues(stage.String()).Observe(time.Since(seen).Seconds())
		if _, paired := engineOf(x.decodeB).(kvbackend.Paired); paired {
			// SGLang notices a closed stream only seconds later: its abort stops it now.
			for _, rid := range x.legRIDs {
				x.s.abortOnEngine(rid, x.decodeB)
			}
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

// fail ends the request as failed; KV still held for it is released.
func (x *exchange) fail() {
	if act, hold := x.s.table.Fail(x.id); act == lifecycle.ReleaseKV {
		x.s.startRelease(release{mode: x.s.cfg.KVRelease, c: x.handOff(), hold: hold, req: x.req, prefill: x.prefillB, params: x.kvParams})
	}
}

// failLegs ends a request on paired legs as failed; while the room is still held, both legs
// are aborted, the decoder's first, so that neither waits for a partner that never comes.
func (x *exchange) failLegs() {
	if act, hold := x.s.table.Fail(x.id); act == lifecycle.ReleaseKV {
		x.s.abortLegs(x.handOff(), x.legRIDs, x.prefillB, x.decodeB, hold)
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
// as in abortOnEngine, in case an abort overtook its leg. abortLegs takes the request's
// custody and ends it once the hold is released.
func (s *Server) abortLegs(c *custody, rids []string, p, d *router.Backend, hold *lifecycle.Hold) {
	c.giveBackLease(c.res)
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		defer c.end(s)
		legs := []*router.Backend{d, p}
		pending := map[*router.Backend][]string{}
		for _, b := range legs {
			for _, rid := range rids {
				if !s.abortCall(rid, b, "engine abort failed") {
					pending[b] = append(pending[b], rid)
				}
			}
		}
		s.bg.Add(1)
		time.AfterFunc(abortRepeatDelay, func() {
			defer s.bg.Done()
			for _, b := range legs {
				for _, rid := range rids {
					s.abortCall(rid, b, "repeated engine abort failed")
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
					if !s.abortCall(rid, b, "engine abort failed") {
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

// releaseUnsentHold releases, when the decode returns, a hold that StartDecode handed over
// and no decoder acknowledged (see decode): the engine's explicit abort where it has one (it
// is exact, and a no-op if the decoder did pull the blocks), else kv_release. A drain does
// not go to a decoder that could not be reached (custody.avoid): it may be dead, and with
// nothing in flight it would be the first pick. One that answered is alive, and may be the
// only one there is.
func (x *exchange) releaseUnsentHold() {
	if x.own == nil || x.own.hold == nil {
		return
	}
	c := x.handOff()
	hold := c.hold
	c.hold = nil
	c.giveBackLease(c.res)
	mode := x.s.cfg.KVRelease
	if x.prefillB != nil && engineOf(x.prefillB).CanAbort() && mode != ReleaseWait {
		mode = ReleaseAbort
	}
	var exclude []string
	if c.avoid != "" {
		exclude = []string{c.avoid}
	}
	x.s.startRelease(release{mode: mode, c: c, hold: hold, req: x.req, prefill: x.prefillB, params: x.kvParams, exclude: exclude})
}

// refusedAfterHandoff handles a decoder that refused a decode it had acknowledged, with its
// params: its engine tells the prefiller where RejectionFreesKV says so (vLLM #41269). Where
// not, the hold, which went to the decoder, is freed by the prefiller's explicit abort, or
// its lease: it may never go to a second decoder.
func (s *Server) refusedAfterHandoff(engineID string, p, d *router.Backend, status int) {
	if engineOf(d).RejectionFreesKV(status) || p == nil {
		return
	}
	if engineOf(p).CanAbort() {
		s.abortOnEngine(engineID, p)
		return
	}
	s.logger.Warn("a decoder refused a decode it had the kv params of, and its engine does not tell the prefiller: the blocks stay held until the prefiller's lease ends",
		zap.String("engine_request_id", engineID), zap.String("decoder", d.Name), zap.Int("status", status))
}

// abortStaleHold frees a hold whose deadline passed before the decode went out (race R4):
// its params are never forwarded, and an engine with an explicit abort can free it at once
// rather than at its own timer.
func (s *Server) abortStaleHold(id string, p *router.Backend) {
	if p != nil && engineOf(p).CanAbort() {
		s.abortOnEngine(id, p)
	}
}

// abortBrokenPrefill aborts a prefill whose call failed after the prefiller took it (its
// answer broke or timed out): it may hold KV whose params never arrived, which the engine's
// explicit abort frees.
func (s *Server) abortBrokenPrefill(id string, p *router.Backend, err error) {
	if mayHoldKV(err) && engineOf(p).CanAbort() {
		s.abortOnEngine(id, p)
	}
}

// prefillAnswerAfterClientLeft ends a request whose prefill was let finish after its client
// left (abort_during_prefill finish_then_release): the KV it now holds is released at once.
func (s *Server) prefillAnswerAfterClientLeft(c *custody, req *genRequest, p *router.Backend, params json.RawMessage, err error) {
	if err != nil || params == nil {
		if err != nil {
			s.abortBrokenPrefill(c.engineID, p, err)
		}
		c.end(s)
		return
	}
	if act, hold := s.table.Prefilled(c.id, true); act == lifecycle.ReleaseKV {
		s.startRelease(release{mode: s.cfg.KVRelease, c: c, hold: hold, req: req, prefill: p, params: params})
		return
	}
	c.end(s)
}

// abortOnEngine sends an engine's explicit abort in the background, on its own short
// deadline: the client's context is already done.
func (s *Server) abortOnEngine(id string, b *router.Backend) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		if !s.abortCall(id, b, "engine abort failed") {
			return
		}
		// The abort travels on its own connection and can overtake the request it aborts
		// (the engine has not read it yet, so it ignores an unknown id, then finishes the
		// request and holds its KV). A second abort a moment later closes that gap; for an
		// engine that already forgot the request it is a no-op.
		s.bg.Add(1)
		time.AfterFunc(abortRepeatDelay, func() {
			defer s.bg.Done()
			s.abortCall(id, b, "repeated engine abort failed")
		})
	}()
}

// abortCall sends one explicit abort on its own short deadline (the client's context is done
// by then) and logs a failure with msg.
func (s *Server) abortCall(id string, b *router.Backend, msg string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), defaultAbortCallTimeout)
	defer cancel()
	if err := engineOf(b).Abort(ctx, b.AdminClient(), baseURL(b), id); err != nil {
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
}

// startRelease runs r, in the background unless there is nothing to send: the client is gone
// and nothing waits for it.
func (s *Server) startRelease(r release) {
	if r.mode == ReleaseWait || r.prefill == nil {
		r.hold.Release(lifecycle.ReleaseExpired)
		r.c.res = router.Result{Canceled: true}
		r.c.end(s)
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		// The entry ends only once the hold is released: an End before would release it as
		// expired while the drain or abort is still on its way.
		defer r.c.end(s)
		r.c.res = router.Result{Canceled: true}
		canAbort := engineOf(r.prefill).CanAbort()
		if r.mode == ReleaseAbort && canAbort {
			r.c.giveBackLease(r.c.res)
			if s.abortHold(r) {
				return
			}
			s.m.releaseFailure.WithLabelValues(ReleaseAbort).Inc()
			r.hold.Release(lifecycle.ReleaseExpired)
			return
		}
		if s.drain(r) {
			r.hold.Release(lifecycle.ReleaseDrained)
			return
		}
		s.m.releaseFailure.WithLabelValues(ReleaseDrain).Inc()
		if canAbort && s.abortHold(r) {
			return
		}
		// Left to the engine's own timer; the proxy never forwards these params again.
		r.hold.Release(lifecycle.ReleaseExpired)
	}()
}

func (s *Server) abortHold(r release) bool {
	if !s.abortCall(r.c.engineID, r.prefill, "kv release by abort failed") {
		return false
	}
	r.hold.Release(lifecycle.ReleaseAborted)
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
	body, err := engineOf(b).DrainBody(r.req.fields, r.req.chat, r.params)
	if err != nil {
		lease.Release(router.Result{})
		return false
	}
	path := "/v1/completions"
	if r.req.chat {
		path = "/v1/chat/completions"
	}
	var delivered atomic.Bool
	traced := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest: func(i httptrace.WroteRequestInfo) { delivered.Store(i.Err == nil) },
	})
	call := backendCall(b, path, r.c.engineID, nil, body)
	resp, err := call.Do(traced)
	if err == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
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
