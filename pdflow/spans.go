package pdflow

import (
	"context"
	"errors"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/router"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracer is the proxy's side of tracing; nil when tracing is off.
type tracer struct {
	t    trace.Tracer
	prop propagation.TextMapPropagator
}

func backendAttrs(b *router.Backend, attrs []attribute.KeyValue) []attribute.KeyValue {
	if b != nil {
		attrs = append(attrs, attrBackend.String(b.Name), attrEngine.String(engineOf(b).Kind()))
	}
	return attrs
}

// withSpan is ctx carrying span, for a call that goes out under it.
func withSpan(ctx context.Context, span trace.Span) context.Context {
	if span == nil {
		return ctx
	}
	return trace.ContextWithSpan(ctx, span)
}

// endSpan ends span with the outcome of its work.
func endSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	var ae *api.Error
	if errors.As(err, &ae) && ae.Status == api.StatusClientClosed {
		err = nil // the client left: the call did what it was asked, and was cut
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
