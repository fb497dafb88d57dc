package pdflow

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/router"
)

// Span names and attribute keys, a contract with the dashboards and queries built on them.
const (
	SpanPrefill    = "pdproxy.prefill"
	SpanDecode     = "pdproxy.decode"
	SpanPrefillLeg = "pdproxy.prefill_leg"
	SpanDecodeLeg  = "pdproxy.decode_leg"
	SpanDrain      = "pdproxy.kv_drain"
	SpanAbort      = "pdproxy.engine_abort"
	SpanRelease    = "pdproxy.kv_release"
	SpanAttempt    = "pdproxy.attempt"

	attrRequestID       = attribute.Key("pdproxy.request_id")
	attrClientRequestID = attribute.Key("pdproxy.client_request_id")
	attrEngineRequestID = attribute.Key("pdproxy.engine_request_id")
	attrBackend         = attribute.Key("pdproxy.backend")
	attrEngine          = attribute.Key("pdproxy.engine")
	attrStream          = attribute.Key("pdproxy.stream")
	attrClientLeftStage = attribute.Key("pdproxy.client_left_stage")
	attrTokensAfter     = attribute.Key("pdproxy.tokens_after_disconnect")
	attrKVParams        = attribute.Key("pdproxy.kv_params_forwarded")
	attrKVHeldSeconds   = attribute.Key("pdproxy.kv_held_seconds")
	attrMigrationReason = attribute.Key("pdproxy.migration.reason")
	attrMigrationTokens = attribute.Key("pdproxy.migration.tokens_replayed")
	attrAttempt         = attribute.Key("pdproxy.attempt")
	attrAttemptOutcome  = attribute.Key("pdproxy.attempt.outcome")
	attrRetryRole       = attribute.Key("pdproxy.retry.role")
	attrRetryReason     = attribute.Key("pdproxy.retry.reason")
	attrReleaseMode     = attribute.Key("pdproxy.release_mode")
	attrReleaseReason   = attribute.Key("pdproxy.release_reason")
	attrDecodeOnly      = attribute.Key("pdproxy.decode_only")
	attrStatus          = attribute.Key("http.response.status_code")
)

// startRequest starts the request's server span, continuing the client's trace, and returns
// the context the request's calls run under.
func (x *Exchange) startRequest(ctx context.Context) context.Context {
	tr := x.s.tr
	if tr == nil {
		return ctx
	}
	ctx = tr.prop.Extract(ctx, propagation.HeaderCarrier(x.R.Header))
	attrs := []attribute.KeyValue{attrRequestID.String(x.ID), attrEngineRequestID.String(x.EngineID),
		attribute.String("http.request.method", x.R.Method), attribute.String("http.route", x.Route)}
	if id := x.R.Header.Get("X-Request-Id"); id != "" {
		attrs = append(attrs, attrClientRequestID.String(id))
	}
	ctx, x.span = tr.t.Start(ctx, x.R.Method+" "+x.Route, trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...))
	return ctx
}

// EndRequest ends the request's span with the status the client got.
func (x *Exchange) EndRequest(status int, e *api.Error) {
	if x.span == nil {
		return
	}
	x.span.SetAttributes(attrStatus.Int(status))
	if x.Req != nil {
		x.span.SetAttributes(attrStream.Bool(x.Req.Stream))
	}
	if x.Legs.Fallback || x.Req != nil && x.Req.DecodeOnly != "" {
		x.span.SetAttributes(attrDecodeOnly.Bool(true))
	}
	if x.Out.afterGone > 0 {
		x.span.SetAttributes(attrTokensAfter.Int(x.Out.afterGone))
	}
	if e != nil && status >= 500 && status != api.StatusClientClosed {
		x.span.SetStatus(codes.Error, e.Message)
	}
	x.span.End()
}

// traceParent is the request's span, for the spans of work that outlives the request's
// context (releases, aborts): the zero value when tracing is off.
func (x *Exchange) traceParent() trace.SpanContext {
	if x.span == nil {
		return trace.SpanContext{}
	}
	return x.span.SpanContext()
}

// callSpan starts the span of a call to backend b under the request's span; nil when tracing
// is off. withSpan puts it in the call's context, so that the call carries it to the engine.
func (x *Exchange) callSpan(name string, b *router.Backend, attrs ...attribute.KeyValue) trace.Span {
	if x.s.tr == nil {
		return nil
	}
	parent := x.span
	if x.Tries.span != nil {
		parent = x.Tries.span
	}
	_, span := x.s.tr.t.Start(trace.ContextWithSpan(context.Background(), parent), name,
		trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(backendAttrs(b, attrs)...))
	return span
}

// startAttempt starts the span of the request's attempt n (from 0), under the request's span:
// the calls of the attempt go under it. Nothing when tracing is off.
func (x *Exchange) startAttempt(n int) {
	if x.s.tr == nil || x.span == nil {
		return
	}
	_, x.Tries.span = x.s.tr.t.Start(trace.ContextWithSpan(context.Background(), x.span), SpanAttempt,
		trace.WithAttributes(attrAttempt.Int(n)))
}

// endAttempt ends the attempt's span with how the attempt ended: served, migrated (its stream
// goes on elsewhere), fresh_pair (its pair failed before the first byte), or failed.
func (x *Exchange) endAttempt(e *api.Error) {
	span := x.Tries.span
	if span == nil {
		return
	}
	x.Tries.span = nil
	outcome := "failed"
	switch e {
	case nil:
		outcome = "served"
	case errMoveOn:
		outcome, e = "migrated", nil
	case errFreshPair:
		outcome, e = "fresh_pair", nil
	}
	span.SetAttributes(attrAttemptOutcome.String(outcome))
	var err error
	if e != nil {
		err = e // a nil *api.Error must not become a non-nil error
	}
	endSpan(span, err)
}
