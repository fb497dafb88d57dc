package proxy

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func tenant(name string) http.Header { return http.Header{"X-Tenant": {name}} }

// assertFlowRefusal checks a refusal of the wait queue as a client sees it: its status, its
// code in the OpenAI shape, and a Retry-After.
func assertFlowRefusal(t *testing.T, resp *http.Response, body []byte, status int, code string) {
	t.Helper()
	_, _, got, _ := checkOpenAIError(t, resp, body, status)
	if got != code {
		t.Errorf("code %q, want %q: %s", got, code, body)
	}
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 1 {
		t.Errorf("Retry-After %q, want a number of seconds", resp.Header.Get("Retry-After"))
	}
}

func TestFlowControlRefusesTheTenantOverItsShareWith429AndASaturatedPoolWith503(t *testing.T) {
	gate := make(chan struct{})
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if !d.wait(r, gate) {
			return
		}
		vllmDecode(w, r, body)
	})
	cfg := Config{FlowControl: FlowControlConfig{TenantHeader: "X-Tenant",
		Tenants: map[string]TenantConfig{"noisy": {Weight: 1}, "quiet": {Weight: 1}}}}
	h := newHarness(t, cfg, routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "d0", URL: d.URL(), Role: routerconfig.RoleDecode, MaxInflight: 1}},
		Queue: routerconfig.QueueConfig{Size: 2}})
	statuses := make(chan int, 8)
	send := func(who string) { go func() { statuses <- h.statusOf(plainCompletion, tenant(who)) }() }
	depth := func(who string) float64 {
		return h.value("pdproxy_flow_queue_depth", map[string]string{"tenant": who})
	}

	send("noisy") // takes the decoder's one slot
	eventually(t, "the engine to get the first request", func() bool { return len(d.generations()) == 1 })
	send("noisy")
	send("noisy")
	eventually(t, "noisy's two requests to queue", func() bool { return depth("noisy") == 2 })

	// The queue is full of noisy's requests: one more of noisy's is over its share.
	resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, tenant("noisy"))
	assertFlowRefusal(t, resp, body, http.StatusTooManyRequests, "tenant_queue_full")

	// A quiet tenant takes the place of noisy's newest waiter, which is told 429.
	send("quiet")
	if got := <-statuses; got != http.StatusTooManyRequests {
		t.Errorf("noisy's evicted waiter answered %d, want 429", got)
	}
	eventually(t, "quiet's request to queue", func() bool { return depth("quiet") == 1 })

	// A third tenant finds every tenant within its share: the pool is saturated, said in the
	// shape of its route.
	resp, body = h.do(http.MethodPost, "/v1/messages", `{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, tenant("someone"))
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Errorf("a third tenant: %d, Retry-After %q; want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	var anth struct {
		Type  string                `json:"type"`
		Error struct{ Type string } `json:"error"`
	}
	if err := json.Unmarshal(body, &anth); err != nil || anth.Type != "error" || anth.Error.Type == "" {
		t.Errorf("the /v1/messages refusal is not in Anthropic's shape: %s", body)
	}

	close(gate)
	ok := 0
	for range 3 {
		if s := <-statuses; s == http.StatusOK {
			ok++
		} else {
			t.Errorf("a queued request answered %d, want 200", s)
		}
	}
	h.waitQuiet()
	if n := len(d.generations()); n != ok {
		t.Errorf("the engine got %d requests and %d were answered 200: a refused request reached it", n, ok)
	}
	if v := h.value("pdproxy_backend_requests_total", nil); v != float64(ok) {
		t.Errorf("backend_requests_total = %v, want %d", v, ok)
	}
	for _, c := range []struct {
		code string
		want float64
	}{{"429", 2}, {"503", 1}, {"200", 3}} {
		if v := h.value("pdproxy_requests_total", map[string]string{"code": c.code}); v != c.want {
			t.Errorf("requests_total{code=%s} = %v, want %v", c.code, v, c.want)
		}
	}
	for _, who := range []string{"noisy", "quiet", "default"} {
		if v := depth(who); v != 0 {
			t.Errorf("flow_queue_depth{%s} after = %v, want 0", who, v)
		}
	}
	if _, present := h.metric("pdproxy_flow_queue_depth", map[string]string{"tenant": "someone"}); present {
		t.Error("a tenant header's value that names no tenant became a label")
	}
}

func TestFlowControlFindsTheTenantByHeaderThenKeyThenAddress(t *testing.T) {
	digest := func(key string) string { d := sha256.Sum256([]byte(key)); return hex.EncodeToString(d[:]) }
	cfg := Config{FlowControl: FlowControlConfig{TenantHeader: "X-Tenant", DefaultWeight: 2, MaxQueuePerTenant: 7,
		Tenants: map[string]TenantConfig{"acme": {Weight: 3, APIKeySHA256: []string{strings.ToUpper(digest("sk-acme"))}}, "beta": {}}}}
	if err := CheckFlowControl(&cfg, &routerconfig.QueueConfig{}); err != nil {
		t.Fatal(err)
	}
	ts, err := newTenants(cfg.FlowControl, nil)
	if err != nil {
		t.Fatal(err)
	}
	req := func(hdr http.Header, addr string) *http.Request {
		r, _ := http.NewRequest(http.MethodPost, "/v1/completions", nil)
		r.Header, r.RemoteAddr = hdr, addr
		return r
	}
	tests := []struct {
		name   string
		r      *http.Request
		label  string
		weight float64
		sameAs *http.Request // a request of the same flow; nil: none
	}{
		{"a header naming a tenant", req(http.Header{"X-Tenant": {"beta"}}, "10.0.0.1:1"), "beta", 2, req(http.Header{"X-Tenant": {"beta"}, "Authorization": {"Bearer sk-acme"}}, "10.0.0.2:1")},
		{"a key of a tenant", req(bearer("sk-acme"), "10.0.0.1:1"), "acme", 3, req(http.Header{"X-Tenant": {"acme"}}, "10.0.0.9:1")},
		{"a key of none, by x-api-key", req(http.Header{"X-Api-Key": {"sk-other"}}, "10.0.0.1:1"), "default", 2, req(bearer("sk-other"), "10.0.0.3:1")},
		{"a header naming no tenant", req(http.Header{"X-Tenant": {"Someone Else"}}, "10.0.0.1:1"), "default", 2, nil},
		{"nothing but an address", req(http.Header{}, "10.0.0.1:1"), "default", 2, req(http.Header{}, "10.0.0.1:2")},
	}
	keys := map[string]string{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := ts.flowOf(tt.r)
			if f.Label != tt.label || f.Weight != tt.weight || f.MaxQueue != 7 || f.Key == "" {
				t.Errorf("flow %+v, want label %s, weight %v, max queue 7", f, tt.label, tt.weight)
			}
			if tt.sameAs != nil && ts.flowOf(tt.sameAs).Key != f.Key {
				t.Errorf("%+v and %+v are different flows", f, ts.flowOf(tt.sameAs))
			}
			if other, dup := keys[f.Key]; dup {
				t.Errorf("the same flow as %q", other)
			}
			keys[f.Key] = tt.name
		})
	}
}

func TestFlowControlConfigRefusesWhatCannotTakeEffect(t *testing.T) {
	const digest = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae" // sha256("foo")
	tests := []struct {
		name  string
		cfg   Config
		queue routerconfig.QueueConfig
		want  string
	}{
		{"a queue that lets nothing wait", Config{FlowControl: FlowControlConfig{TenantHeader: "X-Tenant"}}, routerconfig.QueueConfig{Size: -1}, "queue.size"},
		{"a per-tenant bound above the queue", Config{FlowControl: FlowControlConfig{MaxQueuePerTenant: 11}}, routerconfig.QueueConfig{Size: 10}, "max_queue_per_tenant"},
		{"the priority header as the tenant header", Config{FlowControl: FlowControlConfig{TenantHeader: "x-priority"}, Priority: PriorityConfig{Header: "X-Priority"}}, routerconfig.QueueConfig{}, "priority.header"},
		{"a tenant nobody can be of", Config{FlowControl: FlowControlConfig{Tenants: map[string]TenantConfig{"acme": {Weight: 2}}}}, routerconfig.QueueConfig{}, "no request could be of it"},
		{"a reserved tenant name", Config{FlowControl: FlowControlConfig{TenantHeader: "X-Tenant", Tenants: map[string]TenantConfig{"default": {}}}}, routerconfig.QueueConfig{}, "reserved"},
		{"a negative weight", Config{FlowControl: FlowControlConfig{TenantHeader: "X-Tenant", Tenants: map[string]TenantConfig{"a": {Weight: -1}}}}, routerconfig.QueueConfig{}, "weight"},
		{"a digest that is not one", Config{FlowControl: FlowControlConfig{Tenants: map[string]TenantConfig{"a": {APIKeySHA256: []string{"abc"}}}}}, routerconfig.QueueConfig{}, "SHA-256"},
		{"one key in two tenants", Config{FlowControl: FlowControlConfig{Tenants: map[string]TenantConfig{"a": {APIKeySHA256: []string{digest}}, "b": {APIKeySHA256: []string{digest}}}}}, routerconfig.QueueConfig{}, "a's too"},
		{"a negative queue timeout", Config{FlowControl: FlowControlConfig{QueueTimeout: -1}}, routerconfig.QueueConfig{}, "queue_timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckFlowControl(&tt.cfg, &tt.queue)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("CheckFlowControl = %v, want an error naming %q", err, tt.want)
			}
		})
	}
	t.Run("a key digest none of the client keys has", func(t *testing.T) {
		t.Setenv("FLOW_KEYS", "bar")
		cfg := Config{APIKeysEnv: "FLOW_KEYS", FlowControl: FlowControlConfig{Tenants: map[string]TenantConfig{"a": {APIKeySHA256: []string{digest}}}}}
		_, err := New(cfg, stubRouter{}, nil, nil, nil, nil)
		if err == nil || !strings.Contains(err.Error(), "none of the client keys") {
			t.Errorf("New = %v, want a refusal of the digest", err)
		}
	})
	t.Run("no flow_control is no flow control", func(t *testing.T) {
		cfg := Config{}
		if err := CheckFlowControl(&cfg, &routerconfig.QueueConfig{Size: -1}); err != nil {
			t.Errorf("CheckFlowControl = %v", err)
		}
	})
}
