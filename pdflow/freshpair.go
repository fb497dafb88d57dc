package pdflow

import (
	"errors"
	"net/http"

	"go.opentelemetry.io/otel/trace"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// A pair that fails before the client got anything is replaced by a fresh one where that is
// safe: nothing has reached the client, so another attempt, from the start, is the same
// answer to it. What the failed attempt held is released as that attempt's (its legs aborted,
// its hold released, its decoder's lease given back charged with the failure), the engine that
// failed is left out of the next attempt while another one of its role is usable, and the
// request goes on under the same table entry (Table.Retry). Each role has its own budget of
// fresh pairs per request, prefill_retries and decode_retries, as the retries within an
// attempt have.
//
// What gets one: a paired decode leg its decoder provably never took (a connection refused
// or dropped unread); a paired prefill leg that provably never started or was refused with a
// 502, 503 or 504; a decode that carried the prefiller's KV and failed before its first byte
// reached the client (a 5xx, an error event before any token, a connection that broke or an
// answer that ended empty): its KV pull failed, or its decoder died while pulling, and the
// request is prefilled again, on another prefiller where there is one. A decode that timed out
// gets none: its decoder may only be slow, and a second one would double the load that slowed
// it.

// Why a pair was replaced: the reason label of pdproxy_retries_total, beside the status or
// connection error of a retry within an attempt.
const (
	freshKVPull        = "kv_pull_failed"
	freshDecoderFailed = "decoder_failed"
)

// freshPair replaces the request's pair after a failure of role (reason) before the client got
// anything, the engines in failed having failed it: when that is allowed, what the attempt
// holds goes as fail would let it go, with res for the decoder's lease, those engines are left
// out of the next attempt, the attempt is counted, and the answer is errFreshPair, the custody
// holding nothing, handed back. It is not allowed when the client got bytes or left, the
// role's budget is spent, the table moved on, or a failed engine has no other of its role to
// take its place (a failed pull excepted); it then answers nil with the custody as it was,
// and the caller fails the request as before.
func (x *Exchange) freshPair(c custody, res router.Result, role routerconfig.Role, reason string, failed ...*router.Backend) (custody, *api.Error) {
	budget, used := x.s.cfg.DecodeRetries, &x.Tries.decode
	if role == routerconfig.RolePrefill {
		budget, used = x.s.cfg.PrefillRetries, &x.Tries.prefill
	}
	if x.Out.Wrote || x.Ctx.Err() != nil || *used >= budget || x.Legs.Decode == nil {
		return c, nil
	}
	var avoid []avoided
	for _, b := range failed {
		switch {
		case b == nil:
		case x.othersUsable(b):
			avoid = append(avoid, avoidOf(b))
		case reason != freshKVPull:
			// With no other engine of its role, the next attempt would go to the one that
			// just lost the request, or to none: the client is told of this failure rather
			// than of a later one. A failed pull may go well on the same pair.
			return c, nil
		}
	}
	hold, ok := x.s.table.Retry(x.ID)
	if !ok {
		return c, nil
	}
	*used++
	c, attempt := c.split(res)
	x.letGo(attempt, hold)
	x.Tries.avoid = append(x.Tries.avoid, avoid...)
	x.s.m.Retries.WithLabelValues(string(role), reason).Inc()
	if x.span != nil {
		x.span.AddEvent("fresh_pair", trace.WithAttributes(attrRetryRole.String(string(role)), attrRetryReason.String(reason)))
	}
	x.EngineID = api.NewID() // as in moveOn
	c.engineID = x.EngineID
	x.Legs = legs{Named: x.Legs.Named, tokens: x.Legs.tokens, lent: x.Legs.lent}
	if rs := x.Out.Resume; rs != nil {
		// An error event the filter kept from the client belonged to the attempt.
		rs.pending, rs.errorEvent, rs.watching = rs.pending[:0], false, false
	}
	return c, errFreshPair
}

// othersUsable reports whether an engine of b's role other than b, and than those the
// request already avoids, may take requests now and serves the request's model: only then is b left out of the next attempt
// (with none, it is b or nothing).
func (x *Exchange) othersUsable(b *router.Backend) bool {
	for _, o := range x.s.router.Available(b.Role) {
		if o != b && !x.Tries.avoids(o) && (x.Req.Model == "" || o.Serves(x.Req.Model)) {
			return true
		}
	}
	return false
}

// retryDecode is freshPair for a decode that failed with err before its first byte reached
// the client: one that carried the prefiller's KV and was answered with a 5xx or an error
// event failed its pull, and the request is prefilled again; one whose
// connection broke or whose answer ended empty lost its decoder, which the next attempt
// avoids. A decode that timed out, or that a client error refused, is not tried again. It
// answers as freshPair does.
func (x *Exchange) retryDecode(c custody, err error, wd *watchdog) (custody, *api.Error) {
	if x.Out.Wrote || wd.timedOut() || x.Ctx.Err() != nil || retriable(err, false) {
		// A decode its decoder provably never took was tried on other decoders already
		// (send), with the same KV.
		return c, nil
	}
	var se *engine.StatusError
	if errors.As(err, &se) || errors.Is(err, errErrorEvent) {
		if !x.Legs.withKV || se != nil && se.Status < http.StatusInternalServerError {
			return c, nil
		}
		// The pull may have failed on either side: both are avoided where others can serve.
		// The decoder's 5xx is charged to it as any other: one that fails every pull must
		// still be ejected.
		return x.freshPair(c, resultOf(err, x.Ctx), routerconfig.RolePrefill, freshKVPull, x.Legs.Prefill, x.Legs.Decode)
	}
	return x.freshPair(c, resultOf(err, x.Ctx), routerconfig.RoleDecode, freshDecoderFailed, x.Legs.Decode)
}
