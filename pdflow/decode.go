package pdflow

import (
	"encoding/json"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// decode sends the decode call, with what the prefill left (p), and relays its answer to the
// client. It hands the custody back with errMoveOn and errFreshPair, and ends it otherwise. A
// hold StartDecode hands over goes to the decoder through a handoff (handoff.go): it is the
// decoder's once the decoder acknowledges the decode, and until then the proxy's, which
// releases it if the decode ends first.
func (x *Exchange) decode(c custody, p prefilled) (custody, *api.Error) {
	start := time.Now()
	defer func() { x.Times.Decode = time.Since(start) }()
	var e *api.Error
	if !x.s.router.Usable(x.Legs.Decode) {
		// The decoder reserved before the prefill was ejected or went down meanwhile: the
		// decode goes to another one, with the same KV, not to an engine known to fail.
		if c, e = x.reserveDecoder(c.withoutLease(router.Result{Canceled: true}), sequential); e != nil {
			return c, e
		}
	}
	b := x.Legs.Decode
	// The body is built while the table still has the hold: if building it fails (or
	// panics), failing the request releases the hold as in kv_held.
	params := p.params
	body, err := x.decodeBody(b, params)
	if err != nil {
		return custody{}, x.failWith(c, router.Result{}, BuildFailed(err, "decode"))
	}
	forward, hold, ok := x.s.table.StartDecode(x.ID, b.Name)
	if !ok {
		return custody{}, x.gone(c)
	}
	if !forward && params != nil {
		// Past the hold's deadline (race R4): the params are never forwarded.
		params = nil
		x.s.abortStaleHold(x.traceParent(), x.EngineID, x.Legs.Prefill)
		if body, err = x.decodeBody(b, nil); err != nil {
			return custody{}, x.failWith(c, router.Result{}, BuildFailed(err, "decode"))
		}
	}
	x.Legs.withKV = params != nil
	ho := x.handOver(hold)
	// With abort_during_kv_pull after_first_token, a decode that is pulling KV is not cancelled
	// the moment the client leaves, but at its first byte (or its first-byte timeout): engines
	// that crash on an abort during the pull (race R3) never see one.
	deferCancel := params != nil && x.s.cfg.AbortDuringKVPull == PullAbortAfterFirstToken
	wd := newWatchdog(x.Ctx, deferCancel, hold != nil, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()

	span := x.callSpan(SpanDecode, b, attrKVParams.Bool(params != nil))
	defer func() { endSpan(span, err) }()
	call := x.call(b, x.Req.Route, body)
	if ho != nil {
		call.OnAck = func() {
			ho.ack()
			wd.onAck()
		}
	}
	var resp *http.Response
	c, resp, err = x.send(c, call, wd, span, sequential, func(b *router.Backend, call *engine.Call) (err error) {
		if _, _, ok := x.s.table.StartDecode(x.ID, b.Name); !ok {
			// Already decoding, the table names the new decoder; it refuses once the
			// client left.
			return errNotInTable
		}
		call.Body, err = x.decodeBody(b, params)
		return err
	})
	b = x.Legs.Decode
	if err == nil {
		// Answered without a "100 Continue" first: the headers are the acknowledgement.
		ho.ack()
		wd.onAck()
	}
	// A hold no decoder acknowledged stays the proxy's, to release as the decode's outcome
	// allows; one acknowledged is the decoder's, even when the answer is a refusal.
	c.unsent = ho.withdraw(err, b)
	if ho.refused(err) {
		x.s.refusedAfterHandoff(x.traceParent(), x.EngineID, x.Legs.Prefill, b, err)
	}
	if err != nil {
		if c, e = x.retryDecode(c, err, wd); e != nil {
			return c, e
		}
		return custody{}, x.decodeFailed(c, err, wd)
	}
	if c, e = x.relayAnswer(c, resp, wd); e != nil {
		err = e
	}
	return c, e
}

// send makes call to the request's decoder and, while a decoder provably never took it and
// the client is there, to another one accept takes (nil: any), up to decode_retries times:
// retarget readies the call for each new decoder (its body). The custody's lease and the
// request's decoder follow the call: the custody it returns holds the lease of the one it
// last went to.
func (x *Exchange) send(c custody, call engine.Call, wd *watchdog, span trace.Span, accept func(routerconfig.Engine) bool,
	retarget func(b *router.Backend, call *engine.Call) error) (custody, *http.Response, error) {
	call = withHeader(call, nil, c.lease)
	var resp *http.Response
	do := func() error {
		return x.s.guard(x.ID, func() (err error) {
			resp, err = call.Do(withSpan(wd.ctx, span))
			return err
		})
	}
	err := do()
	tried := []string{x.Legs.Decode.Name}
	for attempt := 0; err != nil && retriable(err, false) && x.Ctx.Err() == nil && attempt < x.s.cfg.DecodeRetries; attempt++ {
		h := x.hint(routerconfig.RoleDecode, tried)
		h.Accept = accept
		lease, aerr := x.s.router.Acquire(x.Ctx, routerconfig.RoleDecode, h)
		if aerr != nil {
			break
		}
		x.picked(routerconfig.RoleDecode, lease)
		c = c.withoutLease(resultOf(err, x.Ctx))
		b := lease.Backend()
		c.lease, x.Legs.Decode = lease, b
		tried = append(tried, b.Name)
		x.s.m.Retries.WithLabelValues(string(routerconfig.RoleDecode), retryReason(err)).Inc()
		call.Client, call.BaseURL, call.Engine, call.Header = b.Client(), BaseURL(b), engineOf(b), x.Hdr
		if err = retarget(b, &call); err != nil {
			break
		}
		call = withHeader(call, nil, lease)
		if span != nil {
			span.SetAttributes(attrBackend.String(b.Name))
		}
		err = do()
	}
	return c, resp, err
}

// relayAnswer relays a decoder's answer to the client. It hands the custody back with
// errMoveOn and errFreshPair, and ends it otherwise.
func (x *Exchange) relayAnswer(c custody, resp *http.Response, wd *watchdog) (custody, *api.Error) {
	defer resp.Body.Close()
	c.res = router.Result{Status: http.StatusOK}
	c, e := x.relay(c, resp, wd)
	if e != nil {
		return c, e
	}
	c.end(x.s)
	return custody{}, nil
}

// decodeBody is the decode's body for decoder b: its engine's, or for an engine without
// sequential P/D the client's body as it came (params is then nil: no prefiller made any).
func (x *Exchange) decodeBody(b *router.Backend, params json.RawMessage) (body []byte, err error) {
	err = x.s.guard(x.ID, func() (err error) {
		if eng, ok := engineOf(b).(engine.Sequential); ok {
			body, err = eng.DecodeBody(x.fieldsFor(b), params)
		} else {
			body, err = engine.DecodeBody(x.fieldsFor(b), params)
		}
		return err
	})
	return body, err
}
