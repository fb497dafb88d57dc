package proxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// tracedBy is a proxy option that exports every span, as it ends, over OTLP/HTTP to rcv.
func tracedBy(t *testing.T, rcv *testutil.OTLPReceiver) Option {
	t.Helper()
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(rcv.Endpoint+"/v1/traces"))
	if err != nil {
		t.Fatal(err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "pdproxy-test"))))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	return WithTracerProvider(tp)
}

// clientTrace is a traceparent a client sends: a new trace, sampled, and its span id.
func clientTrace() (header, traceID, spanID string) {
	var b [24]byte
	rand.Read(b[:])
	traceID, spanID = hex.EncodeToString(b[:16]), hex.EncodeToString(b[16:])
	return "00-" + traceID + "-" + spanID + "-01", traceID, spanID
}

// traceTree is a received trace, by span name.
type traceTree map[string][]testutil.Span

// waitTrace waits until the trace holds every span named in want (at least as many as given).
func waitTrace(t *testing.T, rcv *testutil.OTLPReceiver, traceID string, want map[string]int) traceTree {
	t.Helper()
	var tree traceTree
	testutil.WaitFor(t, testDeadline, func() (bool, string) {
		tree = traceTree{}
		for _, s := range rcv.Trace(traceID) {
			tree[s.Name] = append(tree[s.Name], s)
		}
		for name, n := range want {
			if len(tree[name]) < n {
				return false, fmt.Sprintf("trace %s has %d %q spans, want %d; it has %v", traceID, len(tree[name]), name, n, tree.names())
			}
		}
		return true, ""
	})
	return tree
}

func (tr traceTree) names() []string {
	var out []string
	for n, ss := range tr {
		out = append(out, fmt.Sprintf("%s x%d", n, len(ss)))
	}
	return out
}

func (tr traceTree) one(t *testing.T, name string) testutil.Span {
	t.Helper()
	if len(tr[name]) != 1 {
		t.Fatalf("%d %q spans, want 1", len(tr[name]), name)
	}
	return tr[name][0]
}

// attemptOf is the one attempt span of the trace, checked to be a child of the request's span
// srv: the calls of the attempt are its children.
func (tr traceTree) attemptOf(t *testing.T, srv testutil.Span) testutil.Span {
	t.Helper()
	att := tr.one(t, pdflow.SpanAttempt)
	childOf(t, att, srv, map[string]string{"pdproxy.attempt": "0"})
	return att
}

// childOf checks that span's parent is parent, and that its attributes include want.
func childOf(t *testing.T, span, parent testutil.Span, want map[string]string) {
	t.Helper()
	if span.ParentID != parent.SpanID {
		t.Errorf("%s's parent is %s, want %s (%s)", span.Name, span.ParentID, parent.SpanID, parent.Name)
	}
	for k, v := range want {
		if span.Attrs[k] != v {
			t.Errorf("%s: %s = %q, want %q", span.Name, k, span.Attrs[k], v)
		}
	}
}

// engineGotSpan checks that a call to an engine carried the trace, from span.
func engineGotSpan(t *testing.T, who string, r received, traceID string, span testutil.Span) {
	t.Helper()
	tp := r.Header.Get("Traceparent")
	if want := "00-" + traceID + "-" + span.SpanID + "-01"; tp != want {
		t.Errorf("%s got traceparent %q, want %q (the %s span)", who, tp, want, span.Name)
	}
}

func TestTraceOfAPDRequestContinuesTheClientsTraceOnBothCalls(t *testing.T) {
	rcv := testutil.NewOTLPHTTPReceiver(t)
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := newHarnessLogged(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{prefiller("p0", p.URL()), decoder("d0", d.URL())}},
		lifecycle.Config{}, nil, tracedBy(t, rcv))
	tp, traceID, clientSpan := clientTrace()
	resp, _ := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","max_tokens":5}`,
		http.Header{"Traceparent": {tp}, "Tracestate": {"vendor=x"}, "X-Request-Id": {"traced-1"}})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	tree := waitTrace(t, rcv, traceID, map[string]int{"POST /v1/completions": 1, pdflow.SpanPrefill: 1, pdflow.SpanDecode: 1})
	srv := tree.one(t, "POST /v1/completions")
	if srv.ParentID != clientSpan {
		t.Errorf("the request's span has parent %q, want the client's %q", srv.ParentID, clientSpan)
	}
	for k, v := range map[string]string{"pdproxy.request_id": "traced-1", "pdproxy.client_request_id": "traced-1",
		"http.response.status_code": "200", "pdproxy.stream": "false"} {
		if srv.Attrs[k] != v {
			t.Errorf("request span: %s = %q, want %q", k, srv.Attrs[k], v)
		}
	}
	if len(srv.Attrs["pdproxy.engine_request_id"]) != 32 {
		t.Errorf("request span: engine_request_id %q", srv.Attrs["pdproxy.engine_request_id"])
	}
	pre, dec := tree.one(t, pdflow.SpanPrefill), tree.one(t, pdflow.SpanDecode)
	att := tree.attemptOf(t, srv)
	if att.Attrs["pdproxy.attempt.outcome"] != "served" {
		t.Errorf("the attempt's outcome is %q, want served", att.Attrs["pdproxy.attempt.outcome"])
	}
	childOf(t, pre, att, map[string]string{"pdproxy.backend": "p0", "pdproxy.engine": "vllm"})
	childOf(t, dec, att, map[string]string{"pdproxy.backend": "d0", "pdproxy.engine": "vllm", "pdproxy.kv_params_forwarded": "true"})
	engineGotSpan(t, "the prefiller", p.only(t, "prefiller"), traceID, pre)
	engineGotSpan(t, "the decoder", d.only(t, "decoder"), traceID, dec)
	if ts := d.only(t, "decoder").Header.Get("Tracestate"); ts != "vendor=x" {
		t.Errorf("the decoder got tracestate %q, want the client's", ts)
	}
}

func TestTraceOfAClientThatLeftSaysAtWhichStage(t *testing.T) {
	for _, stage := range []lifecycle.State{lifecycle.Prefilling, lifecycle.KVHeld, lifecycle.Decoding} {
		t.Run(stage.String(), func(t *testing.T) {
			rcv := testutil.NewOTLPHTTPReceiver(t)
			release := make(chan struct{})
			t.Cleanup(func() { closeOnce(release) })
			var p, d *fakeEngine
			p = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
				if stage == lifecycle.Prefilling {
					p.wait(r, release)
					return
				}
				vllmPrefill(prefillerParams)(w, r, body)
			})
			d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
				switch {
				case strings.Contains(string(body), `"prompt":"first"`):
					d.wait(r, release) // occupies the only decoder slot
				case stage == lifecycle.Decoding && strings.Contains(string(body), `"stream":true`):
					w.Header().Set("Content-Type", "text/event-stream")
					w.Write([]byte(sseChunks(false)[0]))
					w.(http.Flusher).Flush()
					d.wait(r, release)
				default:
					vllmDecode(w, r, body)
				}
			})
			cfg := Config{}
			if stage == lifecycle.KVHeld {
				cfg.DecoderReservation = ReserveAfterPrefill
			}
			h := newHarnessLogged(t, cfg, routerconfig.Config{Backends: []routerconfig.BackendConfig{prefiller("p0", p.URL()),
				{Name: "d0", URL: d.URL(), Role: routerconfig.RoleDecode, MaxInflight: 1}}}, lifecycle.Config{}, nil, tracedBy(t, rcv))
			if stage == lifecycle.KVHeld {
				go h.statusOf(`{"model":"m","prompt":"first"}`, nil)
				eventually(t, "the first request to occupy the decoder", func() bool { return len(d.generations()) == 1 })
			}
			tp, traceID, _ := clientTrace()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan struct{})
			go func() {
				defer close(done)
				resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions",
					`{"model":"m","prompt":"second","stream":true}`, http.Header{"Traceparent": {tp}, "X-Request-Id": {"leaves"}}))
				if err == nil {
					resp.Body.Read(make([]byte, 512))
					<-ctx.Done() // leaves only when the test says so
					resp.Body.Close()
				}
			}()
			eventually(t, "the request to reach "+stage.String(), func() bool {
				st, ok := h.table.State("leaves")
				return ok && st == stage && (stage != lifecycle.Decoding || len(d.generations()) > 0)
			})
			cancel()
			<-done
			want := map[string]int{"POST /v1/completions": 1, pdflow.SpanPrefill: 1}
			switch stage {
			case lifecycle.KVHeld:
				want[pdflow.SpanRelease], want[pdflow.SpanDrain] = 1, 1
			case lifecycle.Decoding:
				want[pdflow.SpanDecode] = 1
			}
			tree := waitTrace(t, rcv, traceID, want)
			for _, sp := range rcv.Trace(traceID) {
				t.Logf("span %s id %s parent %s service %s attrs %v", sp.Name, sp.SpanID, sp.ParentID, sp.Service, sp.Attrs)
			}
			srv := tree.one(t, "POST /v1/completions")
			if got := srv.Attrs["pdproxy.client_left_stage"]; got != stage.String() {
				t.Errorf("client_left_stage %q, want %q", got, stage)
			}
			if srv.Attrs["http.response.status_code"] != "499" || srv.Error {
				t.Errorf("request span: status %q, error %v; want 499, not an error of the proxy", srv.Attrs["http.response.status_code"], srv.Error)
			}
			childOf(t, tree.one(t, pdflow.SpanPrefill), tree.attemptOf(t, srv), nil)
			if stage == lifecycle.KVHeld {
				rel := tree.one(t, pdflow.SpanRelease)
				childOf(t, rel, srv, map[string]string{"pdproxy.release_mode": "drain", "pdproxy.release_reason": "drained", "pdproxy.backend": "p0"})
				if rel.Attrs["pdproxy.kv_held_seconds"] == "" {
					t.Error("the release span does not say how long the KV was held")
				}
				childOf(t, tree.one(t, pdflow.SpanDrain), rel, map[string]string{"pdproxy.backend": "d0"})
			}
			closeOnce(release)
			h.waitQuiet()
		})
	}
}

func TestTraceOfARetriedPrefillHasBothTries(t *testing.T) {
	rcv := testutil.NewOTLPHTTPReceiver(t)
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	dead := prefiller("p-dead", closedURL(t))
	dead.Weight = 2 // least_inflight's ties go to the heavier: the dead one is tried first
	h := newHarnessLogged(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{dead, prefiller("p0", p.URL()), decoder("d0", d.URL())}},
		lifecycle.Config{}, nil, tracedBy(t, rcv))
	tp, traceID, _ := clientTrace()
	resp, _ := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, http.Header{"Traceparent": {tp}})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	tree := waitTrace(t, rcv, traceID, map[string]int{"POST /v1/completions": 1, pdflow.SpanPrefill: 2, pdflow.SpanDecode: 1})
	att := tree.attemptOf(t, tree.one(t, "POST /v1/completions"))
	byBackend := map[string]testutil.Span{}
	for _, s := range tree[pdflow.SpanPrefill] {
		childOf(t, s, att, nil)
		byBackend[s.Attrs["pdproxy.backend"]] = s
	}
	if !byBackend["p-dead"].Error || byBackend["p0"].Error {
		t.Errorf("prefill spans %+v: want the dead prefiller's failed and p0's not", tree[pdflow.SpanPrefill])
	}
	engineGotSpan(t, "the prefiller", p.only(t, "prefiller"), traceID, byBackend["p0"])
}

func TestTraceOfSGLangLegsCarriesOneTraceToBothEngines(t *testing.T) {
	rcv := testutil.NewOTLPHTTPReceiver(t)
	prefilled := make(chan struct{})
	var once = make(chan struct{}, 1)
	p := newEngine(t, sglangLeg(func(w http.ResponseWriter, r *http.Request, body []byte) {
		select {
		case once <- struct{}{}:
			close(prefilled)
		default:
		}
		answer(http.StatusOK, "application/json", `{"id":"p","choices":[{"text":"x"}]}`)(w, r, body)
	}))
	var d *fakeEngine
	d = newEngine(t, sglangLeg(func(w http.ResponseWriter, r *http.Request, body []byte) {
		if d.wait(r, prefilled) {
			vllmDecode(w, r, body)
		}
	}))
	h := newHarnessLogged(t, Config{}, sglangBackends(p, d, false), lifecycle.Config{}, nil, tracedBy(t, rcv))
	tp, traceID, _ := clientTrace()
	resp, _ := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, http.Header{"Traceparent": {tp}})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	h.waitQuiet()
	tree := waitTrace(t, rcv, traceID, map[string]int{"POST /v1/completions": 1, pdflow.SpanPrefillLeg: 1, pdflow.SpanDecodeLeg: 1})
	srv := tree.one(t, "POST /v1/completions")
	pl, dl := tree.one(t, pdflow.SpanPrefillLeg), tree.one(t, pdflow.SpanDecodeLeg)
	att := tree.attemptOf(t, srv)
	childOf(t, pl, att, map[string]string{"pdproxy.engine": "sglang", "pdproxy.backend": "p0"})
	childOf(t, dl, att, map[string]string{"pdproxy.engine": "sglang", "pdproxy.backend": "d0"})
	engineGotSpan(t, "the prefiller", p.only(t, "prefiller"), traceID, pl)
	engineGotSpan(t, "the decoder", d.only(t, "decoder"), traceID, dl)
}

func TestNoTraceparentReachesEnginesWhenNeitherTracingNorTheClientSendsOne(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := pd(t, Config{}, p, d)
	tp, _, _ := clientTrace()
	h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, http.Header{"Traceparent": {tp}})
	h.post("/v1/completions", `{"model":"m","prompt":"hi"}`)
	g := d.generations()
	if len(g) != 2 {
		t.Fatalf("%d decodes", len(g))
	}
	if got := g[0].Header.Get("Traceparent"); got != tp {
		t.Errorf("untraced proxy: the decoder got traceparent %q, want the client's %q passed on", got, tp)
	}
	if got := g[1].Header.Get("Traceparent"); got != "" {
		t.Errorf("untraced proxy: the decoder got traceparent %q from a client that sent none", got)
	}
}
