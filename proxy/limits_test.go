package proxy

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

const plainCompletion = `{"model":"m","prompt":"hi","max_tokens":2}`

// keyName is the name metrics show key by.
func keyName(key string) string { return "key-" + shortHash(key) }

// assertRefused checks a 429 of the client's limits as a client sees it: the OpenAI shape
// with OpenAI's type and code, and a Retry-After of at least 1 and at most maxRetry.
func assertRefused(t *testing.T, resp *http.Response, body []byte, maxRetry int) {
	t.Helper()
	_, typ, code, param := checkOpenAIError(t, resp, body, http.StatusTooManyRequests)
	if typ != "requests" || code != "rate_limit_exceeded" || param != nil {
		t.Errorf("error type %q code %q param %v, want requests, rate_limit_exceeded, null: %s", typ, code, param, body)
	}
	ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || ra < 1 || ra > maxRetry {
		t.Errorf("Retry-After %q, want 1 to %d seconds", resp.Header.Get("Retry-After"), maxRetry)
	}
	if resp.Header.Get("X-Request-Id") == "" {
		t.Error("a refusal carries no X-Request-Id")
	}
}

func TestOverTheRateLimitIsRefusedBeforeAnyEngineIsAsked(t *testing.T) {
	d := newEngine(t, vllmDecode)
	// One request per 100 s: the bucket does not refill during the test.
	h := aggregated(t, Config{Limits: LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 0.01, Burst: 1}}}, d)
	if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k1")); resp.StatusCode != http.StatusOK {
		t.Fatalf("first request: %d %s", resp.StatusCode, body)
	}
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		resp, body := h.do(http.MethodPost, path, `{"model":"m","prompt":"hi","messages":[{"role":"user","content":"hi"}]}`, bearer("k1"))
		assertRefused(t, resp, body, 100)
	}
	if n := len(d.generations()); n != 1 {
		t.Errorf("the engine got %d generation calls, want 1: a refused request reached it", n)
	}
	if v := h.value("pdproxy_backend_requests_total", nil); v != 1 {
		t.Errorf("pdproxy_backend_requests_total = %v, want 1: a refusal counted against the backend", v)
	}
	for _, b := range h.rt.Backends() {
		if !b.Healthy || b.Ejected || b.Ejections != 0 {
			t.Errorf("backend %s after refusals: %+v", b.Name, b)
		}
	}
	if v := h.value("pdproxy_limit_rejected_total", map[string]string{"key": keyName("k1"), "reason": "rate"}); v != 2 {
		t.Errorf("limit_rejected_total{reason=rate} = %v, want 2", v)
	}
	if v := h.value("pdproxy_requests_total", map[string]string{"route": "/v1/chat/completions", "code": "429"}); v != 1 {
		t.Errorf("requests_total{route=/v1/chat/completions,code=429} = %v, want 1", v)
	}
	// Another key has its own bucket; probes and metrics are never limited.
	if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k2")); resp.StatusCode != http.StatusOK {
		t.Errorf("another key: %d %s", resp.StatusCode, body)
	}
	for _, path := range []string{"/health", "/metrics", "/debug/backends", "/health"} {
		if resp, body := h.do(http.MethodGet, path, "", bearer("k1")); resp.StatusCode != http.StatusOK {
			t.Errorf("GET %s with a spent key: %d %s", path, resp.StatusCode, body)
		}
	}
	h.waitQuiet()
}

func TestTheTokenBucketRefills(t *testing.T) {
	d := newEngine(t, vllmDecode)
	h := aggregated(t, Config{Limits: LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 1, Burst: 1}}}, d)
	clk := testutil.NewClock(time.Now())
	h.srv.lim.now = clk.Now
	if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("first request: %d %s", resp.StatusCode, body)
	}
	resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, nil)
	assertRefused(t, resp, body, 1)
	clk.Advance(999 * time.Millisecond)
	resp, body = h.do(http.MethodPost, "/v1/completions", plainCompletion, nil)
	assertRefused(t, resp, body, 1)    // not quite refilled
	clk.Advance(10 * time.Millisecond) // past what Retry-After said
	if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("after Retry-After: %d %s", resp.StatusCode, body)
	}
}

func TestTokenBucketArithmetic(t *testing.T) {
	l := newLimiter(LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 2, Burst: 3}, MaxIdentities: 10}, 0)
	req := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	t0 := time.Unix(1000, 0)
	admit := func(at time.Duration) (bool, int) {
		a, e := l.admit(req, t0.Add(at))
		if e != nil {
			return false, e.RetryAfter
		}
		l.release(a, t0.Add(at))
		return true, 0
	}
	for i := range 3 {
		if ok, _ := admit(0); !ok {
			t.Fatalf("request %d of the burst refused", i)
		}
	}
	if ok, ra := admit(0); ok || ra != 1 {
		t.Errorf("fourth at once: admitted %v, Retry-After %d; want refused, 1", ok, ra)
	}
	if ok, _ := admit(500 * time.Millisecond); !ok {
		t.Error("a token due after 0.5 s at 2/s was not there")
	}
	if ok, _ := admit(500 * time.Millisecond); ok {
		t.Error("two requests took one token")
	}
	// An hour's quiet refills the bucket to its burst, no more.
	for i := range 3 {
		if ok, _ := admit(time.Hour); !ok {
			t.Fatalf("request %d after a quiet hour refused", i)
		}
	}
	if ok, _ := admit(time.Hour); ok {
		t.Error("the bucket held more than its burst")
	}
	slow := newLimiter(LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 0.1, Burst: 1}, MaxIdentities: 10}, 0)
	slow.admit(req, t0)
	if _, e := slow.admit(req, t0.Add(2*time.Second)); e == nil || e.RetryAfter != 8 {
		t.Errorf("at 0.1/s, 2 s after the last token: %+v, want Retry-After 8", e)
	}
}

// gate is a decoder whose streams send their first chunk and then wait for the gate to
// open or the client to leave.
type gate struct {
	open    chan struct{}
	started chan struct{}
}

func newGate() *gate { return &gate{open: make(chan struct{}), started: make(chan struct{}, 100)} }

func (g *gate) handler(e **fakeEngine) engineHandler {
	return func(w http.ResponseWriter, r *http.Request, body []byte) {
		if !strings.Contains(string(body), `"stream":true`) {
			vllmDecode(w, r, body)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		chunks := sseChunks(false)
		io.WriteString(w, chunks[0])
		w.(http.Flusher).Flush()
		g.started <- struct{}{}
		if !(*e).wait(r, g.open) {
			return
		}
		for _, c := range chunks[1:] {
			io.WriteString(w, c)
		}
	}
}

func TestConcurrencyLimitFreesWhenARequestEnds(t *testing.T) {
	for _, leave := range []bool{false, true} {
		name := "answer ends"
		if leave {
			name = "client leaves mid-stream"
		}
		t.Run(name, func(t *testing.T) {
			g := newGate()
			var d *fakeEngine
			d = newEngine(t, g.handler(&d))
			h := aggregated(t, Config{Limits: LimitsConfig{PerKey: KeyLimits{MaxConcurrent: 1}}}, d)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","stream":true}`, bearer("k")))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			if _, err := readEvent(br); err != nil {
				t.Fatalf("first event: %v", err)
			}
			testutil.Recv(t, testDeadline, g.started, "the stream to start")

			refused, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k"))
			assertRefused(t, refused, body, 1)
			if n := len(d.generations()); n != 1 {
				t.Errorf("the engine got %d generation calls, want 1", n)
			}
			if leave {
				cancel()
			} else {
				close(g.open)
				io.Copy(io.Discard, br)
			}
			h.waitQuiet()
			// The slot is free again, and the idle identity is forgotten.
			eventually(t, "the key to be admitted again", func() bool { return h.statusOf(plainCompletion, bearer("k")) == http.StatusOK })
			if n := h.srv.lim.identities(); n != 0 {
				t.Errorf("%d identities kept with nothing in flight and no rate limit", n)
			}
			if v := h.value("pdproxy_limit_rejected_total", map[string]string{"reason": "concurrency"}); v != 1 {
				t.Errorf("limit_rejected_total{reason=concurrency} = %v, want 1", v)
			}
		})
	}
}

func TestTenantsBehindOneKeyHaveTheirOwnBudgets(t *testing.T) {
	t.Setenv("PDPROXY_TEST_KEYS", "key-one,key-two")
	d := newEngine(t, vllmDecode)
	h := aggregated(t, Config{APIKeysEnv: "PDPROXY_TEST_KEYS", Limits: LimitsConfig{
		PerKey: KeyLimits{RequestsPerSecond: 0.01, Burst: 1}, TenantHeader: "X-Tenant"}}, d)
	send := func(key, tenant string) int {
		hdr := bearer(key)
		if tenant != "" {
			hdr.Set("X-Tenant", tenant)
		}
		resp, _ := h.do(http.MethodPost, "/v1/completions", plainCompletion, hdr)
		return resp.StatusCode
	}
	steps := []struct {
		key, tenant string
		want        int
	}{
		{"key-one", "team-a", 200},
		{"key-one", "team-a", 429},
		{"key-one", "team-b", 200},
		{"key-one", "", 200},
		{"key-one", "", 429},
		{"key-two", "team-a", 200},
		{"key-one", "team-b", 429},
	}
	for i, s := range steps {
		if got := send(s.key, s.tenant); got != s.want {
			t.Errorf("step %d (%s, tenant %q): %d, want %d", i, s.key, s.tenant, got, s.want)
		}
	}
	if n := len(d.generations()); n != 4 {
		t.Errorf("the engine got %d calls, want the 4 admitted", n)
	}
	if v := h.value("pdproxy_key_requests_total", map[string]string{"key": keyName("key-one"), "tenant": "team-a", "class": "none"}); v != 1 {
		t.Errorf("key_requests_total{key-one, team-a} = %v, want 1", v)
	}
	if v := h.value("pdproxy_limit_rejected_total", map[string]string{"key": keyName("key-one"), "tenant": "team-b", "reason": "rate"}); v != 1 {
		t.Errorf("limit_rejected_total{key-one, team-b} = %v, want 1", v)
	}
	// The key itself never shows.
	_, body := h.do(http.MethodGet, "/metrics", "", bearer("key-one"))
	if strings.Contains(string(body), "key-one") || strings.Contains(string(body), "key-two") {
		t.Error("/metrics shows an API key")
	}
}

func TestIdentityStateStaysBoundedUnderRandomKeys(t *testing.T) {
	d := newEngine(t, vllmDecode)
	const bound = 16
	h := aggregated(t, Config{Limits: LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 0.01, Burst: 1}, MaxIdentities: bound}}, d)
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				var b [8]byte
				rand.Read(b[:])
				code := h.statusOf(plainCompletion, bearer(fmt.Sprintf("random-%d-%s", w, hex.EncodeToString(b[:]))))
				mu.Lock()
				codes[code]++
				mu.Unlock()
				if n := h.srv.lim.identities(); n > bound {
					t.Errorf("%d identities kept, bound %d", n, bound)
				}
			}
		}()
	}
	wg.Wait()
	if codes[http.StatusOK] != 200 {
		t.Errorf("answers %v, want 200 OK for each fresh key", codes)
	}
	// The label set is closed too: the first 64 keys by name, the rest as other.
	series := testutil.Series(t, h.reg, "pdproxy_key_requests_total", nil)
	if len(series) > labelsKept+1 {
		t.Errorf("%d key_requests_total series, want at most %d", len(series), labelsKept+1)
	}
	if v := h.value("pdproxy_key_requests_total", map[string]string{"key": "other"}); v != 200-labelsKept {
		t.Errorf("key_requests_total{key=other} = %v, want %d", v, 200-labelsKept)
	}
	h.waitQuiet()
}

func TestIdentitiesAllInFlightRefuseANewOne(t *testing.T) {
	l := newLimiter(LimitsConfig{PerKey: KeyLimits{MaxConcurrent: 4}, MaxIdentities: 2}, 0)
	now := time.Unix(1000, 0)
	var held []*admission
	for _, k := range []string{"a", "b"} {
		a, e := l.admit(withBearer(k), now)
		if e != nil {
			t.Fatalf("key %s: %v", k, e)
		}
		held = append(held, a)
	}
	if _, e := l.admit(withBearer("c"), now); e == nil || e.Limit != limitCapacity || e.Status != http.StatusTooManyRequests {
		t.Fatalf("a third identity with two in flight: %+v, want a 429 of reason capacity", e)
	}
	l.release(held[0], now)
	if _, e := l.admit(withBearer("c"), now); e != nil {
		t.Fatalf("a third identity once one is idle: %v", e)
	}
	l.release(held[1], now)
}

func withBearer(key string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	r.Header.Set("Authorization", "Bearer "+key)
	return r
}

func TestLimitsAndPriorityConfigIsChecked(t *testing.T) {
	bad := []struct {
		name string
		cfg  Config
		want string
	}{
		{"negative concurrency", Config{Limits: LimitsConfig{PerKey: KeyLimits{MaxConcurrent: -1}}}, "limits.per_key.max_concurrent"},
		{"burst without rate", Config{Limits: LimitsConfig{PerKey: KeyLimits{Burst: 3}}}, "limits.per_key.burst"},
		{"class names twice", Config{Priority: PriorityConfig{Classes: []PriorityClass{{Name: "a"}, {Name: "a", Priority: 1}}}}, "priority.classes[1].name"},
		{"one priority for two classes", Config{Priority: PriorityConfig{Classes: []PriorityClass{{Name: "a"}, {Name: "b"}}}}, "priority.classes[1].priority"},
		{"reserved class name", Config{Priority: PriorityConfig{Classes: []PriorityClass{{Name: "none"}}}}, "priority.classes[0].name"},
		{"unknown default", Config{Priority: PriorityConfig{Classes: []PriorityClass{{Name: "a"}}, DefaultClass: "b"}}, "priority.default_class"},
		{"header without classes", Config{Priority: PriorityConfig{Header: "X-Priority"}}, "priority"},
		{"negative slack", Config{Priority: PriorityConfig{Classes: []PriorityClass{{Name: "a", MaxQueueWait: -time.Second}}}}, "max_queue_wait"},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.cfg.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate = %v, want an error naming %s", err, tt.want)
			}
		})
	}
}

// classesCfg is an interactive class (the default, no slack) and a batch class with slack
// that writes its priority into bodies that carry none.
func classesCfg(batchSlack time.Duration) PriorityConfig {
	return PriorityConfig{Header: "X-Priority", DefaultClass: "interactive", Classes: []PriorityClass{
		{Name: "interactive", Priority: 0},
		{Name: "batch", Priority: 10, MaxQueueWait: batchSlack, SetPriority: true},
	}}
}

func TestPriorityReachesBothLegs(t *testing.T) {
	tests := []struct {
		name, body, header string
		want               string // the priority both legs get; "" for none
		class              string
	}{
		{"the client's priority passes untouched", `{"model":"m","prompt":"hi","priority":7}`, "", "7", "interactive"},
		{"a body naming a class's priority is of that class", `{"model":"m","prompt":"hi","priority":10}`, "", "10", "batch"},
		{"a class that sets its priority fills it in", `{"model":"m","prompt":"hi"}`, "batch", "10", "batch"},
		{"a null priority is filled in as none", `{"model":"m","prompt":"hi","priority":null}`, "batch", "10", "batch"},
		{"a body priority that would run ahead of its class's becomes the class's", `{"model":"m","prompt":"hi","priority":-5}`, "batch", "10", "batch"},
		{"a body priority below its class's is kept", `{"model":"m","prompt":"hi","priority":20}`, "batch", "20", "batch"},
		{"a class that does not set one leaves the body's as it came", `{"model":"m","prompt":"hi","priority":-5}`, "interactive", "-5", "interactive"},
		{"a class that does not set one leaves none", `{"model":"m","prompt":"hi"}`, "interactive", "", "interactive"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := newEngine(t, vllmPrefill(prefillerParams)), newEngine(t, vllmDecode)
			h := pd(t, Config{Priority: classesCfg(time.Second)}, p, d)
			hdr := http.Header{}
			if tt.header != "" {
				hdr.Set("X-Priority", tt.header)
			}
			if resp, body := h.do(http.MethodPost, "/v1/completions", tt.body, hdr); resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			for who, e := range map[string]*fakeEngine{"prefiller": p, "decoder": d} {
				got := e.only(t, who)
				f := got.fields(t)
				if prio := string(f["priority"]); prio != tt.want || strings.Count(string(got.Body), `"priority"`) > 1 {
					t.Errorf("%s got priority %q, want %q once: %s", who, prio, tt.want, got.Body)
				}
				if got.Header.Get("X-Priority") != "" {
					t.Errorf("%s got the proxy's X-Priority header", who)
				}
			}
			if _, ok := d.only(t, "decoder").fields(t)["kv_transfer_params"]; !ok {
				t.Error("the decoder got no kv_transfer_params: the priority broke the P/D rewrite")
			}
			if v := h.value("pdproxy_key_requests_total", map[string]string{"class": tt.class}); v != 1 {
				t.Errorf("key_requests_total{class=%s} = %v, want 1", tt.class, v)
			}
		})
	}
}

func TestUnknownPriorityClassIsABadRequest(t *testing.T) {
	d := newEngine(t, vllmDecode)
	h := aggregated(t, Config{Priority: classesCfg(time.Second)}, d)
	resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, http.Header{"X-Priority": {"urgent"}})
	_, _, _, param := checkOpenAIError(t, resp, body, http.StatusBadRequest)
	if param == nil || *param != "X-Priority" {
		t.Errorf("param %v, want X-Priority", param)
	}
	resp, body = h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","priority":"high"}`, nil)
	checkOpenAIError(t, resp, body, http.StatusBadRequest)
	if n := len(d.generations()); n != 0 {
		t.Errorf("the engine got %d calls", n)
	}
}

// TestInteractiveOvertakesQueuedBatchAndNoBatchStarves fills the one decoder, queues a burst
// of batch requests behind it, then sends an interactive one: it is the next served, ahead
// of every batch request queued before it, and every batch request is served after.
func TestInteractiveOvertakesQueuedBatchAndNoBatchStarves(t *testing.T) {
	g := newGate()
	var d *fakeEngine
	d = newEngine(t, g.handler(&d))
	h := newHarness(t, Config{Priority: classesCfg(time.Minute)}, routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{Name: "d0", URL: d.URL(), Role: routerconfig.RoleDecode, MaxInflight: 1}}})
	const batches = 8
	type answer struct {
		name string
		code int
	}
	done := make(chan answer, batches+2)
	send := func(name, class string) {
		go func() {
			code := h.statusOf(`{"model":"m","prompt":"`+name+`","stream":true}`, http.Header{"X-Priority": {class}})
			done <- answer{name, code}
		}()
	}
	waiting := func(n int) {
		eventually(t, fmt.Sprintf("%d requests to queue", n), func() bool {
			return h.value("pdproxy_queue_waiting_requests", map[string]string{"role": "decode"}) == float64(n)
		})
	}
	send("batch-0", "batch")
	testutil.Recv(t, testDeadline, g.started, "the decoder to be busy")
	for i := 1; i <= batches; i++ {
		send(fmt.Sprintf("batch-%d", i), "batch")
	}
	waiting(batches)
	send("interactive", "interactive")
	waiting(batches + 1)
	close(g.open)

	var order []string
	for range batches + 2 {
		a := testutil.Recv(t, testDeadline, done, "every request to be answered")
		if a.code != http.StatusOK {
			t.Errorf("%s: %d, want 200: no class starves", a.name, a.code)
		}
	}
	for _, r := range d.generations() {
		var b struct{ Prompt string }
		json.Unmarshal(r.Body, &b)
		order = append(order, b.Prompt)
	}
	if len(order) != batches+2 || order[0] != "batch-0" || order[1] != "interactive" {
		t.Fatalf("the decoder served %v; want batch-0, then the interactive request, then the batch ones", order)
	}
	if !slices.Contains(order[2:], "batch-8") {
		t.Errorf("the last batch request was never served: %v", order)
	}
	for class, n := range map[string]float64{"batch": batches, "interactive": 1} {
		if v := h.value("pdproxy_queue_wait_seconds", map[string]string{"role": "decode", "class": class}); v != n {
			t.Errorf("queue_wait_seconds{class=%s} count = %v, want %v", class, v, n)
		}
	}
	h.waitQuiet()
}
