package proxy

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/pdproxy/pdproxy/kvbackend"
	"github.com/pdproxy/pdproxy/router"
)

// decode sends the decode call and relays its answer to the client. A hold StartDecode hands
// over goes to the decoder through a handoff (abort.go): it is the decoder's once the decoder
// acknowledges the decode, and until then the proxy's, which releases it if the decode ends
// first.
func (x *exchange) decode() *apiError {
	start := time.Now()
	defer func() { x.decodeT = time.Since(start) }()
	b := x.decodeB
	// The body is built while the table still has the hold: if building it fails (or
	// panics), failing the request releases the hold as in kv_held.
	params := x.kvParams
	body, err := x.decodeBody(b, params)
	if err != nil {
		x.fail(router.Result{})
		return buildFailed(err, "decode")
	}
	forward, hold, ok := x.s.table.StartDecode(x.id, b.Name)
	if !ok {
		return x.gone()
	}
	if !forward && params != nil {
		// Past the hold's deadline (race R4): the params are never forwarded.
		params = nil
		x.s.abortStaleHold(x.traceParent(), x.engineID, x.prefillB)
		if body, err = x.decodeBody(b, nil); err != nil {
			x.fail(router.Result{})
			return buildFailed(err, "decode")
		}
	}
	ho := x.handOver(hold)
	// With abort_during_kv_pull after_first_token, a decode that is pulling KV is not cancelled
	// the moment the client leaves, but at its first byte (or its first-byte timeout): engines
	// that crash on an abort during the pull (race R3) never see one.
	deferCancel := params != nil && x.s.cfg.AbortDuringKVPull == PullAbortAfterFirstToken
	wd := newWatchdog(x.ctx, deferCancel, hold != nil, x.s.cfg.DecodeFirstByteTimeout, x.s.cfg.DecodeIdleTimeout)
	defer wd.stop()

	span := x.callSpan(spanDecode, b, attrKVParams.Bool(params != nil))
	defer func() { endSpan(span, err) }()
	call := withHeader(x.call(b, x.route, body), nil, x.own.lease)
	if ho != nil {
		call.OnAck = func() {
			ho.ack()
			wd.onAck()
		}
	}
	var resp *http.Response
	do := func() error {
		return x.s.guard(x.id, func() (err error) {
			resp, err = call.Do(withSpan(wd.ctx, span))
			return err
		})
	}
	err = do()
	tried := []string{b.Name}
	for attempt := 0; err != nil && retriable(err, false) && x.ctx.Err() == nil && attempt < x.s.cfg.DecodeRetries; attempt++ {
		// The decoder provably never took the call: another one may.
		h := x.hint(tried)
		h.Accept = sequential
		lease, aerr := x.s.router.Acquire(x.ctx, router.RoleDecode, h)
		if aerr != nil {
			break
		}
		x.own.giveBackLease(resultOf(err, x.ctx))
		x.own.lease, x.decodeB, b = lease, lease.Backend(), lease.Backend()
		tried = append(tried, b.Name)
		x.s.m.retries.WithLabelValues(string(router.RoleDecode), retryReason(err)).Inc()
		if call.Body, err = x.decodeBody(b, params); err != nil {
			break
		}
		call.Client, call.BaseURL, call.Engine, call.Header = b.Client(), baseURL(b), engineOf(b), x.hdr
		call = withHeader(call, nil, lease)
		if span != nil {
			span.SetAttributes(attrBackend.String(b.Name))
		}
		err = do()
	}
	if err == nil {
		// Answered without a "100 Continue" first: the headers are the acknowledgement.
		ho.ack()
		wd.onAck()
	}
	// A hold no decoder acknowledged stays the proxy's, to release as the decode's outcome
	// allows; one acknowledged is the decoder's, even when the answer is a refusal.
	x.own.unsent = ho.withdraw(err, b)
	if ho.refused(err) {
		x.s.refusedAfterHandoff(x.traceParent(), x.engineID, x.prefillB, b, err)
	}
	if err != nil {
		return x.decodeFailed(err, wd)
	}
	defer resp.Body.Close()
	x.own.res = router.Result{Status: http.StatusOK}
	if e := x.relay(resp, wd); e != nil {
		err = e
		return e
	}
	return nil
}

// decodeBody is the decode's body for decoder b: its engine's, or for an engine without
// sequential P/D the client's body as it came (params is then nil: no prefiller made any).
func (x *exchange) decodeBody(b *router.Backend, params json.RawMessage) (body []byte, err error) {
	err = x.s.guard(x.id, func() (err error) {
		if eng, ok := engineOf(b).(kvbackend.Sequential); ok {
			body, err = eng.DecodeBody(x.req.fields, params)
		} else {
			body, err = kvbackend.DecodeBody(x.req.fields, params)
		}
		return err
	})
	return body, err
}
