package pdflow

// The engine calls a request's flow makes, and what their outcomes mean: which engine a
// backend runs, the call to it, a call's result for passive health, whether it may go to
// another engine, and the explicit aborts sent in the background.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
)

// resultOf turns a call's outcome into the router's passive-health input; a call ended by
// the client leaving says nothing about the backend.
func resultOf(err error, clientCtx context.Context) router.Result {
	if err == nil {
		return router.Result{Status: http.StatusOK}
	}
	if clientCtx != nil && clientCtx.Err() != nil {
		return router.Result{Canceled: true}
	}
	var se *engine.StatusError
	if errors.As(err, &se) {
		return router.Result{Status: se.Status}
	}
	return router.Result{Err: err}
}

// retriable reports whether a call provably never started on its backend, so that another
// may take it: the backend never took it (engine.CallError.Unprocessed), or, with refusals, the backend refused it with
// 502, 503 or 504. A decode that carried KV params is retried only on the first ground: a
// decoder that refused one may have told the prefiller already.
func retriable(err error, refusals bool) bool {
	var ce *engine.CallError
	if errors.As(err, &ce) && ce.Unprocessed {
		return true
	}
	var se *engine.StatusError
	if refusals && errors.As(err, &se) {
		return se.Status == http.StatusBadGateway || se.Status == http.StatusServiceUnavailable || se.Status == http.StatusGatewayTimeout
	}
	return false
}

func retryReason(err error) string {
	var se *engine.StatusError
	if errors.As(err, &se) {
		return strconv.Itoa(se.Status)
	}
	if unprocessedAlive(err) {
		return "connection_reset"
	}
	return "connect_error"
}

func BaseURL(b *router.Backend) string { return strings.TrimRight(b.URLString, "/") }

func backendCall(b *router.Backend, path, id string, hdr http.Header, body []byte) engine.Call {
	return engine.Call{Client: b.Client(), BaseURL: BaseURL(b), Path: path, ID: id, Header: hdr, Body: body, Engine: engineOf(b)}
}

// guard runs an engine call for request id, turning a panic in it into errEnginePanic,
// counted in pdproxy_panics_total and logged. Calls in background goroutines need it: a panic
// there would end the process.
func (s *Flow) guard(id string, call func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			s.m.Panics.Inc()
			s.logger.Error("panic in an engine call", zap.String("request_id", id), zap.Any("panic", v), zap.StackSkip("stack", 2))
			err = fmt.Errorf("%w: %v", errEnginePanic, v)
		}
	}()
	return call()
}

// unprocessedAlive reports whether err is a call the backend provably never took although it
// was reached: it reset a kept-open connection with the call unread.
func unprocessedAlive(err error) bool {
	var ce *engine.CallError
	return errors.As(err, &ce) && ce.Unprocessed && !ce.Connect
}

// mayHoldKV reports whether a failed prefill call may have left KV held on the prefiller: the
// request reached it (no connect error) and it did not answer with an error status.
func mayHoldKV(err error) bool {
	var se *engine.StatusError
	if errors.As(err, &se) {
		return false
	}
	var ce *engine.CallError
	return !errors.As(err, &ce) || !ce.Unprocessed
}

// withHeader is call with h's headers added, and, when lease took a data-parallel rank, the
// header naming it.
func withHeader(call engine.Call, h http.Header, lease *router.Lease) engine.Call {
	rank, ranked := lease.Rank()
	if len(h) == 0 && !ranked {
		return call
	}
	hdr := call.Header.Clone()
	if hdr == nil {
		hdr = http.Header{}
	}
	for k, v := range h {
		hdr[k] = v
	}
	if ranked {
		hdr.Set(engine.DataParallelRankHeader, strconv.Itoa(rank))
	}
	call.Header = hdr
	return call
}

// abortOnEngine sends an engine's explicit abort in the background, on its own short
// deadline: the client's context is already done.
func (s *Flow) abortOnEngine(parent trace.SpanContext, id string, b *router.Backend) {
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
func (s *Flow) abortCall(parent trace.SpanContext, id string, b *router.Backend, msg string) bool {
	eng, ok := engineOf(b).(engine.Aborter)
	if !ok {
		return false
	}
	span := s.bgSpan(parent, SpanAbort, b, attrEngineRequestID.String(id))
	ctx, cancel := context.WithTimeout(withSpan(context.Background(), span), defaultAbortCallTimeout)
	defer cancel()
	err := s.guard(id, func() error { return eng.Abort(ctx, b.AdminClient(), BaseURL(b), id) })
	endSpan(span, err)
	if err != nil {
		s.logger.Warn(msg, zap.String("engine_request_id", id), zap.String("backend", b.Name), zap.Error(err))
		return false
	}
	return true
}

// abortRepeatDelay is when an explicit abort is sent again (see abortOnEngine).
const abortRepeatDelay = 250 * time.Millisecond

// bgSpan starts the span of background work for the request whose span is parent; nil when
// tracing is off.
func (s *Flow) bgSpan(parent trace.SpanContext, name string, b *router.Backend, attrs ...attribute.KeyValue) trace.Span {
	if s.tr == nil {
		return nil
	}
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), parent)
	_, span := s.tr.t.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(backendAttrs(b, attrs)...))
	return span
}
