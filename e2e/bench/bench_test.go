package bench

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// The Go benchmarks run client, proxy and backend in one process (the harness puts the proxy
// in its own): each sub-benchmark "proxy" follows its "direct" one in the same run, and
// reports its throughput as a ratio of it (ratio-vs-direct), with allocations per request of
// the whole path (client, proxy, backend: the difference is the proxy's).

// BenchmarkAggregatedStream is one streamed completion of 16 chunks, direct and through the
// proxy with a single decoder (no prefill).
func BenchmarkAggregatedStream(b *testing.B) {
	decode := startBackend(b)
	m := startInProcess(b, nil, decode)
	var direct float64
	b.Run("direct", func(b *testing.B) { direct = benchStreams(b, decode.URL(), nil, 0) })
	b.Run("proxy", func(b *testing.B) { benchStreams(b, m.URL(), nil, direct) })
}

// BenchmarkPDStream is one P/D request: direct to the decoder alone (decode-only, what the
// P/D throughput target compares with), direct as a client making the prefill and the decode
// call itself, and through the proxy.
func BenchmarkPDStream(b *testing.B) {
	prefill, decode := startBackend(b), startBackend(b)
	m := startInProcess(b, prefill, decode)
	var direct float64
	b.Run("direct-decode-only", func(b *testing.B) { direct = benchStreams(b, decode.URL(), nil, 0) })
	b.Run("direct-prefill-then-decode", func(b *testing.B) {
		base := newClient(64)
		pair, err := newPDDirect(base.Transport, prefill.URL(), streamBody(1))
		if err != nil {
			b.Fatal(err)
		}
		benchStreams(b, decode.URL(), pair, direct)
	})
	b.Run("proxy", func(b *testing.B) { benchStreams(b, m.URL(), nil, direct) })
}

// startMain starts pdproxy in this process with cfg, its logs discarded, and shuts it down
// when the test ends.
func startMain(tb testing.TB, cfg app.Config) *app.Main {
	tb.Helper()
	return startMainLogged(tb, cfg, zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zap.InfoLevel)))
}

// startMainLogged is startMain logging to logger.
func startMainLogged(tb testing.TB, cfg app.Config, logger *zap.Logger) *app.Main {
	tb.Helper()
	m, err := app.New(cfg, logger)
	if err != nil {
		tb.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := m.Shutdown(ctx); err != nil {
			tb.Errorf("shutdown: %v", err)
		}
	})
	return m
}

// startInProcess runs app.Main in this process on a free port, in front of the given
// backends, logging requests as a deployment does (JSON, info) into nothing.
func startInProcess(b *testing.B, prefill, decode *backend) *app.Main {
	b.Helper()
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 5 * time.Second}
	if prefill != nil {
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: prefill.URL(), Role: routerconfig.RolePrefill, Engine: engine.KindVLLM})
	}
	cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{URL: decode.URL(), Role: routerconfig.RoleDecode, Engine: engine.KindVLLM})
	return startMain(b, cfg)
}

// benchStreams streams completions to url from parallel clients (rt, when not nil, is the
// transport: a client that makes its own P/D calls), checks each stream ended with [DONE],
// and returns ns per request. With direct > 0 it also reports throughput as a ratio of it.
func benchStreams(b *testing.B, url string, rt http.RoundTripper, direct float64) float64 {
	client := newClient(64)
	if rt != nil {
		client.Transport = rt
	}
	defer client.CloseIdleConnections()
	body := streamBody(1)
	b.SetParallelism(16)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		var buf bytes.Buffer
		for pb.Next() {
			resp, err := client.Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				b.Error(err)
				return
			}
			buf.Reset()
			_, err = buf.ReadFrom(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK || !completeStream(buf.Bytes()) {
				b.Errorf("status %d, %v: %.200s", resp.StatusCode, err, buf.Bytes())
				return
			}
		}
	})
	b.StopTimer()
	ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	if direct > 0 {
		b.ReportMetric(direct/ns, "ratio-vs-direct")
	}
	return ns
}
