package app

import (
	"context"
	"fmt"
	"net/url"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// TracingConfig is where and how much the proxy traces. Tracing is off unless an endpoint is
// given, here or in OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT (the
// standard OpenTelemetry variables, honoured as the SDK documents them, OTEL_TRACES_SAMPLER
// and OTEL_TRACES_SAMPLER_ARG among them); a field set here wins over its variable.
type TracingConfig struct {
	// Endpoint is the OTLP collector, e.g. http://collector:4318 (HTTP; /v1/traces is added
	// when the URL has no path) or http://collector:4317 (gRPC); https for TLS.
	Endpoint string `yaml:"endpoint"`
	// Protocol is http/protobuf or grpc. [OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or
	// OTEL_EXPORTER_OTLP_PROTOCOL, else DefaultTracingProtocol]
	Protocol string `yaml:"protocol"`
	// SamplingRatio is the share of traces started here that are sampled, 0 to 1; a trace a
	// client's traceparent says is sampled (or not) stays so. [OTEL_TRACES_SAMPLER, else 1]
	SamplingRatio *float64 `yaml:"sampling_ratio"`
	// ServiceName names the proxy in the traces. [OTEL_SERVICE_NAME, else
	// DefaultServiceName]
	ServiceName string `yaml:"service_name"`
}

const (
	protocolHTTP = "http/protobuf"
	protocolGRPC = "grpc"
	// DefaultTracingProtocol is tracing.protocol when neither the config nor the
	// environment names one.
	DefaultTracingProtocol = protocolHTTP
	// DefaultServiceName is tracing.service_name when neither the config nor
	// OTEL_SERVICE_NAME names one.
	DefaultServiceName = "pdproxy"
)

// validate is the tracing section's check, called by Config.check.
func (c TracingConfig) validate() error {
	if c.Protocol != "" && c.Protocol != protocolHTTP && c.Protocol != protocolGRPC {
		return fmt.Errorf("tracing.protocol: %q is not %s or %s", c.Protocol, protocolHTTP, protocolGRPC)
	}
	if r := c.SamplingRatio; r != nil && (*r < 0 || *r > 1) {
		return fmt.Errorf("tracing.sampling_ratio: %v is not between 0 and 1", *r)
	}
	if c.Endpoint != "" {
		u, err := url.Parse(c.Endpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("tracing.endpoint: %q is not an http or https URL", c.Endpoint)
		}
	}
	return nil
}

// newTracerProvider builds the tracer provider c and the environment ask for; nil when
// tracing is off. c has passed validate (Config.check).
func newTracerProvider(ctx context.Context, c TracingConfig, getenv func(string) string) (*sdktrace.TracerProvider, error) {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return nil, nil
	}
	envEndpoint := firstSet(getenv, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
	if c.Endpoint == "" && envEndpoint == "" {
		return nil, nil
	}
	protocol := c.Protocol
	if protocol == "" {
		protocol = firstSet(getenv, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	if protocol == "" {
		protocol = DefaultTracingProtocol
	}
	var exp sdktrace.SpanExporter
	var err error
	switch protocol {
	case protocolHTTP:
		var opts []otlptracehttp.Option
		if c.Endpoint != "" {
			opts = append(opts, otlptracehttp.WithEndpointURL(tracesURL(c.Endpoint)))
		}
		exp, err = otlptracehttp.New(ctx, opts...)
	case protocolGRPC:
		var opts []otlptracegrpc.Option
		if c.Endpoint != "" {
			opts = append(opts, otlptracegrpc.WithEndpointURL(c.Endpoint))
		}
		exp, err = otlptracegrpc.New(ctx, opts...)
	default:
		return nil, fmt.Errorf("tracing: OTLP protocol %q is not %s or %s", protocol, protocolHTTP, protocolGRPC)
	}
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	name := c.ServiceName
	if name == "" {
		name = firstSet(getenv, "OTEL_SERVICE_NAME")
	}
	if name == "" {
		name = DefaultServiceName
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithBatcher(exp),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", name)))}
	if r := c.SamplingRatio; r != nil {
		opts = append(opts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(*r))))
	}
	// Without a ratio here the SDK reads OTEL_TRACES_SAMPLER, and samples every trace
	// (parent-based) when it is not set.
	return sdktrace.NewTracerProvider(opts...), nil
}

// tracesURL is an OTLP/HTTP endpoint with the traces path when it names none.
func tracesURL(endpoint string) string {
	u, err := url.Parse(endpoint)
	if err != nil || (u.Path != "" && u.Path != "/") {
		return endpoint
	}
	u.Path = "/v1/traces"
	return u.String()
}

func firstSet(getenv func(string) string, names ...string) string {
	for _, n := range names {
		if v := getenv(n); v != "" {
			return v
		}
	}
	return ""
}
