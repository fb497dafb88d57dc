package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// TestTracesReachAnOTLPCollector runs the embedded default with tracing turned on by its
// config (gRPC) and by the standard OTEL_EXPORTER_OTLP_* variables (HTTP), and checks that a
// request's spans reach a collector on loopback under the client's trace.
func TestTracesReachAnOTLPCollector(t *testing.T) {
	// Batches go out every 50 ms instead of every 5 s.
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
	for _, tc := range []struct {
		name    string
		service string
		setup   func(t *testing.T) (*testutil.OTLPReceiver, func(*app.Config))
	}{
		{"config, grpc", "pdproxy-e2e", func(t *testing.T) (*testutil.OTLPReceiver, func(*app.Config)) {
			rcv := testutil.NewOTLPGRPCReceiver(t)
			return rcv, func(c *app.Config) {
				c.Tracing = app.TracingConfig{Endpoint: rcv.Endpoint, Protocol: "grpc", ServiceName: "pdproxy-e2e"}
			}
		}},
		{"environment, http", "pdproxy", func(t *testing.T) (*testutil.OTLPReceiver, func(*app.Config)) {
			rcv := testutil.NewOTLPHTTPReceiver(t)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rcv.Endpoint)
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
			return rcv, func(*app.Config) {}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rcv, mutate := tc.setup(t)
			s := startStack(t, fastSims, mutate)
			var b [24]byte
			rand.Read(b[:])
			traceID, parent := hex.EncodeToString(b[:16]), hex.EncodeToString(b[16:])
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp := post(t, ctx, s.url+"/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}`,
				"Traceparent", "00-"+traceID+"-"+parent+"-01")
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d", resp.StatusCode)
			}
			testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
				names := map[string]testutil.Span{}
				for _, sp := range rcv.Trace(traceID) {
					names[sp.Name] = sp
				}
				srv, ok := names["POST /v1/chat/completions"]
				att := names["pdproxy.attempt"]
				if !ok || att.ParentID != srv.SpanID || names["pdproxy.prefill"].ParentID != att.SpanID || names["pdproxy.decode"].ParentID != att.SpanID {
					return false, fmt.Sprintf("trace %s so far: %v", traceID, rcv.Trace(traceID))
				}
				if srv.ParentID != parent || srv.Service != tc.service || srv.Attrs["pdproxy.engine"] != "" {
					return false, fmt.Sprintf("request span %+v: want parent %s, service %s", srv, parent, tc.service)
				}
				return names["pdproxy.decode"].Attrs["pdproxy.engine"] == "sim", fmt.Sprintf("decode span %+v", names["pdproxy.decode"])
			})
		})
	}
}
