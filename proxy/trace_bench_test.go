package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// BenchmarkTracing is one whole P/D request through the proxy on loopback (a prefill, then a
// decode of a short JSON answer, from fake engines), untraced, traced with nothing sampled,
// and with every request sampled and exported in batches over OTLP/HTTP to a collector on
// loopback: what tracing adds to a request, as a ratio of the untraced figure in the same run.
func BenchmarkTracing(b *testing.B) {
	serve := func(h func(http.ResponseWriter, *http.Request)) string {
		srv := httptest.NewServer(http.HandlerFunc(h))
		b.Cleanup(srv.Close)
		return srv.URL
	}
	p := serve(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"p","choices":[{"text":"x"}],"kv_transfer_params":`+prefillerParams+`}`)
	})
	d := serve(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, decodeJSONCompletion)
	})
	for _, bc := range []struct {
		name  string
		ratio float64 // < 0: no tracing
	}{{"off", -1}, {"sampled_0", 0}, {"sampled_1", 1}} {
		b.Run(bc.name, func(b *testing.B) {
			var opts []Option
			if bc.ratio >= 0 {
				rcv := testutil.NewOTLPHTTPReceiver(b)
				exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(rcv.Endpoint+"/v1/traces"))
				if err != nil {
					b.Fatal(err)
				}
				tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(bc.ratio))))
				b.Cleanup(func() { tp.Shutdown(context.Background()) })
				opts = append(opts, WithTracerProvider(tp))
			}
			reg := prometheus.NewRegistry()
			rt, err := router.New(routerconfig.Config{Backends: []routerconfig.BackendConfig{prefiller("p0", p), decoder("d0", d)},
				Engines: engineCatalog{}, Health: routerconfig.HealthConfig{Interval: -1}}, zap.NewNop(), reg)
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); rt.Run(ctx) }()
			b.Cleanup(func() { cancel(); <-done })
			s, err := New(Config{}, rt, lifecycle.New(lifecycle.Config{}, zap.NewNop(), reg), zap.NewNop(), reg, nil, opts...)
			if err != nil {
				b.Fatal(err)
			}
			front := httptest.NewServer(s.Handler())
			b.Cleanup(front.Close)
			client := front.Client()
			const body = `{"model":"m","prompt":"hello there","max_tokens":8}`
			b.ReportAllocs()
			for b.Loop() {
				resp, err := client.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("status %d", resp.StatusCode)
				}
			}
			b.StopTimer()
			s.Wait(context.Background())
			client.CloseIdleConnections()
			s.CloseIdleConnections()
		})
	}
}
