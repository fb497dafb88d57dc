package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// testDeadline bounds every wait in these tests. It only turns a hang into a failure; no test
// measures speed against it.
const testDeadline = 10 * time.Second

// received is one request a fake engine got.
type received struct {
	Method string
	Path   string
	Header http.Header
	Body   []byte
}

// fields is the body as top-level raw JSON values.
func (r received) fields(t *testing.T) map[string]json.RawMessage {
	t.Helper()
	var f map[string]json.RawMessage
	if err := json.Unmarshal(r.Body, &f); err != nil {
		t.Fatalf("%s %s: body is not a JSON object: %v\n%s", r.Method, r.Path, err, r.Body)
	}
	return f
}

// engineHandler answers one request; body is what the engine received.
type engineHandler func(w http.ResponseWriter, r *http.Request, body []byte)

// fakeEngine is a fake inference engine on a real port: it records every request and answers
// with its handler. Handlers that block must also watch r.Context() and stop, so that
// closing the server never waits on them.
type fakeEngine struct {
	srv  *httptest.Server
	stop chan struct{} // closed at cleanup: a handler still blocked gives up

	mu  sync.Mutex
	got []received
}

func newEngine(t *testing.T, h engineHandler) *fakeEngine {
	t.Helper()
	e := &fakeEngine{stop: make(chan struct{})}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		e.mu.Lock()
		e.got = append(e.got, received{Method: r.Method, Path: r.URL.Path, Header: r.Header.Clone(), Body: body})
		e.mu.Unlock()
		h(w, r, body)
	}))
	t.Cleanup(func() {
		close(e.stop)
		e.srv.Close()
	})
	return e
}

func (e *fakeEngine) URL() string { return e.srv.URL }

// generations are the completion calls the engine got (health and model listings left out).
func (e *fakeEngine) generations() []received {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []received
	for _, r := range e.got {
		if r.Method == http.MethodPost && (strings.HasPrefix(r.Path, "/v1/") || r.Path == api.GenerateRoute) {
			out = append(out, r)
		}
	}
	return out
}

// generationsWith are the completion calls the engine got whose body holds marker.
func (e *fakeEngine) generationsWith(marker string) []received {
	var out []received
	for _, g := range e.generations() {
		if strings.Contains(string(g.Body), marker) {
			out = append(out, g)
		}
	}
	return out
}

// callsTo are the calls the engine got on path.
func (e *fakeEngine) callsTo(path string) []received {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []received
	for _, r := range e.got {
		if r.Path == path {
			out = append(out, r)
		}
	}
	return out
}

// only returns the one generation call the engine got, failing the test otherwise.
func (e *fakeEngine) only(t *testing.T, who string) received {
	t.Helper()
	g := e.generations()
	if len(g) != 1 {
		t.Fatalf("%s got %d generation calls, want 1", who, len(g))
	}
	return g[0]
}

// wait blocks until ch is closed, the request is cancelled or the engine shuts down, and
// reports whether ch was closed.
func (e *fakeEngine) wait(r *http.Request, ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	case <-r.Context().Done():
	case <-e.stop:
	}
	return false
}

// poll waits in a handler until cond holds, and reports false if the request ends, the engine
// shuts down or the test deadline passes first.
func (e *fakeEngine) poll(r *http.Request, cond func() bool) bool {
	deadline := time.Now().Add(testDeadline)
	for !cond() {
		if r.Context().Err() != nil || time.Now().After(deadline) {
			return false
		}
		select {
		case <-e.stop:
			return false
		case <-time.After(2 * time.Millisecond):
		}
	}
	return true
}

// Prefill params as a vLLM prefiller returns them, with fields in no sorted order, a number
// literal that a float round trip would rewrite, an integer beyond float64 precision, an
// escape sequence and characters that HTML escaping would touch, and a field no vLLM version
// has: the proxy must pass every byte of it on.
const prefillerParams = `{"remote_port":5600,"do_remote_prefill":true,"do_remote_decode":false,` +
	`"remote_block_ids":[7,8,9],"remote_engine_id":"engine-p0","remote_request_id":"cmpl-p0-0",` +
	`"remote_host":"10.0.0.7","tp_size":1,"x_future":{"lease_s":30.50,"epoch":123456789012345678901,` +
	`"note":"caf\u00e9 <&>","list":[{"b":1,"a":2}]}}`

// vllmPrefill answers as a vLLM prefiller does: a non-streaming one-token completion whose
// top-level kv_transfer_params is params ("null" for none, "" to leave the field out).
func vllmPrefill(params string) engineHandler {
	return func(w http.ResponseWriter, r *http.Request, _ []byte) {
		kv := ""
		if params != "" {
			kv = `,"kv_transfer_params":` + params
		}
		w.Header().Set("Content-Type", "application/json")
		if strings.HasSuffix(r.URL.Path, "/chat/completions") {
			io.WriteString(w, `{"id":"chatcmpl-p","object":"chat.completion","model":"m",`+
				`"choices":[{"index":0,"message":{"role":"assistant","content":"H"},"finish_reason":"length"}]`+kv+`}`)
			return
		}
		io.WriteString(w, `{"id":"cmpl-p","object":"text_completion","model":"m",`+
			`"choices":[{"index":0,"text":"H","finish_reason":"length"}]`+kv+`}`)
	}
}

// The answers the fake decoder gives.
const (
	decodeJSONCompletion = `{"id":"cmpl-d","object":"text_completion","model":"m","choices":[{"index":0,"text":"Hello","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}`
	decodeJSONChat       = `{"id":"chatcmpl-d","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}]}`
)

// sseChunks are the events the fake decoder streams, [DONE] last.
func sseChunks(chat bool) []string {
	if chat {
		return []string{
			`data: {"id":"chatcmpl-d","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}` + "\n\n",
			`data: {"id":"chatcmpl-d","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}` + "\n\n",
			"data: [DONE]\n\n",
		}
	}
	return []string{
		`data: {"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"Hel","finish_reason":null}]}` + "\n\n",
		`data: {"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"lo","finish_reason":"stop"}]}` + "\n\n",
		"data: [DONE]\n\n",
	}
}

// vllmDecode answers as a vLLM decoder does: an SSE stream when the request asks for one,
// else one JSON completion.
func vllmDecode(w http.ResponseWriter, r *http.Request, body []byte) {
	chat := strings.HasSuffix(r.URL.Path, "/chat/completions")
	var req struct {
		Stream bool `json:"stream"`
	}
	json.Unmarshal(body, &req)
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		if chat {
			io.WriteString(w, decodeJSONChat)
		} else {
			io.WriteString(w, decodeJSONCompletion)
		}
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	for _, c := range sseChunks(chat) {
		io.WriteString(w, c)
		w.(http.Flusher).Flush()
	}
}

// sickableDecoder is a vLLM decoder whose health check answers 503 while sick is set.
func sickableDecoder(t *testing.T, sick *atomic.Bool) *fakeEngine {
	return newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.Method != http.MethodPost {
			if sick.Load() {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
			return
		}
		vllmDecode(w, r, body)
	})
}

// answer is a fixed answer.
func answer(status int, contentType, body string) engineHandler {
	return func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		w.Header().Set("Content-Type", contentType)
		w.WriteHeader(status)
		io.WriteString(w, body)
	}
}

// closedURL is the address of a port nobody listens on any more.
func closedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

func prefiller(name, url string) routerconfig.BackendConfig {
	return routerconfig.BackendConfig{Name: name, URL: url, Role: routerconfig.RolePrefill}
}

func decoder(name, url string) routerconfig.BackendConfig {
	return routerconfig.BackendConfig{Name: name, URL: url, Role: routerconfig.RoleDecode}
}

// harness is a proxy on a real port in front of fake engines, with a real router and request
// table, all on one fresh registry.
type harness struct {
	t     *testing.T
	reg   *prometheus.Registry
	rt    *router.Router // nil with a stub router
	table *lifecycle.Table
	srv   *Server
	front *httptest.Server
}

// newHarness builds the proxy with cfg over a router with rcfg's backends. Active health
// checks are off unless rcfg sets them: a test decides who is healthy.
func newHarness(t *testing.T, cfg Config, rcfg routerconfig.Config) *harness {
	t.Helper()
	return newHarnessTable(t, cfg, rcfg, lifecycle.Config{})
}

// newHarnessTable is newHarness with a request table built from lcfg (e.g. its clock).
func newHarnessTable(t *testing.T, cfg Config, rcfg routerconfig.Config, lcfg lifecycle.Config) *harness {
	t.Helper()
	return newHarnessLogged(t, cfg, rcfg, lcfg, nil)
}

// newHarnessLogged is newHarnessTable with the proxy's logs going to logged too.
func newHarnessLogged(t *testing.T, cfg Config, rcfg routerconfig.Config, lcfg lifecycle.Config, logged zapcore.Core, opts ...Option) *harness {
	t.Helper()
	if rcfg.Health.Interval == 0 {
		rcfg.Health.Interval = -1
	}
	if rcfg.Engines == nil {
		rcfg.Engines = engineCatalog{}
	}
	reg := prometheus.NewRegistry()
	rt, err := router.New(rcfg, zaptest.NewLogger(t), reg)
	if err != nil {
		t.Fatalf("router.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		rt.Run(ctx)
	}()
	// Run closes the backends' idle connections as it returns, so none outlives the test.
	t.Cleanup(func() { cancel(); <-done })
	h := newFrontTable(t, cfg, rt, reg, lcfg, logged, opts...)
	h.rt = rt
	return h
}

// newFront serves a proxy with cfg over rt.
func newFront(t *testing.T, cfg Config, rt Router, reg *prometheus.Registry) *harness {
	t.Helper()
	return newFrontTable(t, cfg, rt, reg, lifecycle.Config{}, nil)
}

// newFrontTable is newFront with a table built from lcfg, and the proxy's logs going to
// logged too when it is not nil.
func newFrontTable(t *testing.T, cfg Config, rt Router, reg *prometheus.Registry, lcfg lifecycle.Config, logged zapcore.Core, opts ...Option) *harness {
	t.Helper()
	logger := zaptest.NewLogger(t)
	if logged != nil {
		logger = zap.New(zapcore.NewTee(logger.Core(), logged))
	}
	table := lifecycle.New(lcfg, logger, reg)
	srv, err := New(cfg, rt, table, logger, reg, reg, opts...)
	if err != nil {
		t.Fatalf("proxy.New: %v", err)
	}
	h := &harness{t: t, reg: reg, table: table, srv: srv, front: httptest.NewServer(srv.Handler())}
	t.Cleanup(func() {
		// A test that failed half way may leave a client waiting on an engine that waits on
		// the test: cutting the clients' connections unwinds every call in flight.
		h.front.CloseClientConnections()
		h.front.Close()
		ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
		defer cancel()
		if err := srv.Wait(ctx); err != nil {
			t.Errorf("background work of the proxy still running at the end of the test: %v", err)
		}
		srv.CloseIdleConnections()
	})
	return h
}

// pd is a harness with one prefiller and one decoder.
func pd(t *testing.T, cfg Config, p, d *fakeEngine) *harness {
	t.Helper()
	return newHarness(t, cfg, routerconfig.Config{Backends: []routerconfig.BackendConfig{prefiller("p0", p.URL()), decoder("d0", d.URL())}})
}

// aggregated is a harness with decoders only.
func aggregated(t *testing.T, cfg Config, ds ...*fakeEngine) *harness {
	t.Helper()
	var bs []routerconfig.BackendConfig
	for i, d := range ds {
		bs = append(bs, decoder("d"+string(rune('0'+i)), d.URL()))
	}
	return newHarness(t, cfg, routerconfig.Config{Backends: bs})
}

// request builds a request to the proxy, bounded by the test deadline.
func (h *harness) request(ctx context.Context, method, path, body string, hdr http.Header) *http.Request {
	h.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, h.front.URL+path, rd)
	if err != nil {
		h.t.Fatalf("build request: %v", err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	return req
}

// do sends a request and reads the whole answer.
func (h *harness) do(method, path, body string, hdr http.Header) (*http.Response, []byte) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
	defer cancel()
	resp, err := h.front.Client().Do(h.request(ctx, method, path, body, hdr))
	if err != nil {
		h.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		h.t.Fatalf("%s %s: read answer: %v", method, path, err)
	}
	return resp, b
}

// statusOf sends a completion request and returns its status once the whole answer is read
// (0 when the request failed). Safe from any goroutine.
func (h *harness) statusOf(body string, hdr http.Header) int {
	ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.front.URL+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return 0
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := h.front.Client().Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return 0
	}
	return resp.StatusCode
}

func (h *harness) post(path, body string) (*http.Response, []byte) {
	h.t.Helper()
	return h.do(http.MethodPost, path, body, nil)
}

// metric sums the series of name whose labels include want: a counter's or gauge's value,
// a histogram's sample count. present says whether any series matched.
func (h *harness) metric(name string, want map[string]string) (sum float64, present bool) {
	h.t.Helper()
	return testutil.Lookup(h.t, h.reg, name, want)
}

func (h *harness) value(name string, want map[string]string) float64 {
	h.t.Helper()
	v, _ := h.metric(name, want)
	return v
}

// quiet reports whether nothing of a request is left: no table entry, no in-flight series
// above 0, no lease held on any backend.
func (h *harness) quiet() bool {
	if h.table.Len() != 0 {
		return false
	}
	if v := h.value("pdproxy_inflight_requests", nil); v != 0 {
		return false
	}
	if h.rt != nil {
		for _, b := range h.rt.Backends() {
			if b.Inflight != 0 {
				return false
			}
		}
	}
	return true
}

// waitQuiet waits until every request has left the proxy, and says what is left if that
// never happens.
func (h *harness) waitQuiet() {
	h.t.Helper()
	testutil.WaitFor(h.t, testDeadline, func() (bool, string) {
		if h.quiet() {
			return true, ""
		}
		var inflight []string
		if h.rt != nil {
			for _, b := range h.rt.Backends() {
				inflight = append(inflight, b.Name+"="+strconv.FormatInt(b.Inflight, 10))
			}
		}
		return false, fmt.Sprintf("requests left behind: table %d %v, pdproxy_inflight_requests sum %v, backend in-flight %v",
			h.table.Len(), h.table.Snapshot(), h.value("pdproxy_inflight_requests", nil), inflight)
	})
}

// eventually polls cond until it holds, failing the test at the deadline.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.Eventually(t, testDeadline, cond, "%s", what)
}

// closedWithin waits for ch to be closed, failing the test at the deadline.
func closedWithin(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	testutil.Recv(t, testDeadline, ch, "%s", what)
}

// checkOpenAIError asserts an error answer in the OpenAI shape, with every key present, and
// returns its fields.
func checkOpenAIError(t *testing.T, resp *http.Response, body []byte, status int) (message, typ, code string, param *string) {
	t.Helper()
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d; body %s", resp.StatusCode, status, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	var outer map[string]json.RawMessage
	if err := json.Unmarshal(body, &outer); err != nil {
		t.Fatalf("error body is not JSON: %v\n%s", err, body)
	}
	var inner map[string]json.RawMessage
	if err := json.Unmarshal(outer["error"], &inner); err != nil || inner == nil {
		t.Fatalf(`error body has no "error" object: %s`, body)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := inner[k]; !ok {
			t.Errorf("error body lacks %q: %s", k, body)
		}
	}
	json.Unmarshal(inner["message"], &message)
	json.Unmarshal(inner["type"], &typ)
	json.Unmarshal(inner["code"], &code)
	json.Unmarshal(inner["param"], &param)
	if message == "" || typ == "" {
		t.Errorf("error body has an empty message or type: %s", body)
	}
	return message, typ, code, param
}

// jsonEqual reports whether two JSON texts hold the same value.
func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var va, vb any
	if err := json.Unmarshal(a, &va); err != nil {
		t.Fatalf("not JSON: %v: %s", err, a)
	}
	if err := json.Unmarshal(b, &vb); err != nil {
		t.Fatalf("not JSON: %v: %s", err, b)
	}
	return reflect.DeepEqual(va, vb)
}

// readEvent reads one SSE event (up to and including its blank line).
func readEvent(br *bufio.Reader) (string, error) {
	var b bytes.Buffer
	for {
		line, err := br.ReadString('\n')
		b.WriteString(line)
		if err != nil {
			return b.String(), err
		}
		if line == "\n" {
			return b.String(), nil
		}
	}
}

// stubRouter refuses every lease with err: for the answers to a router's refusals.
type stubRouter struct{ err error }

func (s stubRouter) Acquire(context.Context, routerconfig.Role, router.Hint) (*router.Lease, error) {
	return nil, s.err
}
func (stubRouter) Available(routerconfig.Role) []*router.Backend { return nil }
func (stubRouter) Has(routerconfig.Role) bool                    { return false }
func (stubRouter) Usable(*router.Backend) bool                   { return false }
func (stubRouter) Ready() bool                                   { return false }
func (stubRouter) Backends() []router.BackendStatus              { return nil }
func (stubRouter) Models(routerconfig.Role) ([]string, bool)     { return nil, false }
func (stubRouter) Heads(routerconfig.Role, router.Hint, []int) ([]router.Head, time.Duration) {
	return nil, 0
}
func (stubRouter) SpreadEngines(routerconfig.Role, router.Hint) []string { return nil }

// engineCatalog gives the router engine's engines, as cmd/proxy does.
type engineCatalog struct{}

func (engineCatalog) Engine(kind string) (routerconfig.Engine, bool) {
	e, ok := engine.Lookup(kind)
	return e, ok
}

func (engineCatalog) Kinds() []string { return engine.Kinds() }
