package proxy

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestBadRequestsAreRefusedWith400NamingTheField(t *testing.T) {
	const comp, chat = "/v1/completions", "/v1/chat/completions"
	for _, tc := range []struct {
		name, route, body string
		param             string // "" means null
		says              string // a word the message must contain
	}{
		{name: "malformed JSON", route: comp, body: `{"model":"m" "prompt":"hi"}`, says: "JSON"},
		{name: "truncated JSON says so", route: comp, body: `{"model":"m","prompt":"hi"`, says: "truncated"},
		{name: "empty body", route: comp, body: ``, says: "empty"},
		{name: "body is an array, not an object", route: comp, body: `[{"model":"m"}]`, says: "object"},
		{name: "body is a string, not an object", route: comp, body: `"model"`, says: "object"},
		{name: "body is null", route: comp, body: `null`, says: "object"},
		{name: "trailing garbage after the object", route: comp, body: `{"model":"m","prompt":"hi"} x`, says: "JSON"},
		{name: "invalid UTF-8 in the prompt", route: comp, body: "{\"model\":\"m\",\"prompt\":\"caf\xe9\"}", says: "UTF-8"},
		{name: "missing model", route: comp, body: `{"prompt":"hi"}`, param: "model"},
		{name: "empty model", route: comp, body: `{"model":"","prompt":"hi"}`, param: "model"},
		{name: "model is a number", route: comp, body: `{"model":7,"prompt":"hi"}`, param: "model"},
		{name: "missing prompt", route: comp, body: `{"model":"m"}`, param: "prompt"},
		{name: "prompt is a number", route: comp, body: `{"model":"m","prompt":5}`, param: "prompt"},
		{name: "prompt is an empty array", route: comp, body: `{"model":"m","prompt":[]}`, param: "prompt"},
		{name: "prompt array holds an object", route: comp, body: `{"model":"m","prompt":[{"a":1}]}`, param: "prompt"},
		{name: "missing messages", route: chat, body: `{"model":"m"}`, param: "messages"},
		{name: "messages is a string", route: chat, body: `{"model":"m","messages":"hi"}`, param: "messages"},
		{name: "messages is empty", route: chat, body: `{"model":"m","messages":[]}`, param: "messages"},
		{name: "a message is not an object", route: chat, body: `{"model":"m","messages":["hi"]}`, param: "messages"},
		{name: "a message is null", route: chat, body: `{"model":"m","messages":[null]}`, param: "messages[0]"},
		{name: "a message has no role", route: chat, body: `{"model":"m","messages":[{"role":"user","content":"a"},{"content":"b"}]}`, param: "messages[1].role"},
		{name: "stream is a string", route: comp, body: `{"model":"m","prompt":"hi","stream":"true"}`, param: "stream"},
		{name: "stream_options is a string", route: comp, body: `{"model":"m","prompt":"hi","stream_options":"yes"}`, param: "stream_options"},
		{name: "include_usage is a string", route: comp, body: `{"model":"m","prompt":"hi","stream_options":{"include_usage":"yes"}}`, param: "stream_options.include_usage"},
		{name: "max_tokens is a numeric string", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":"5"}`, param: "max_tokens"},
		{name: "max_tokens is a word", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":"many"}`, param: "max_tokens"},
		{name: "max_tokens is negative", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":-1}`, param: "max_tokens"},
		{name: "max_tokens is a fraction", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":2.5}`, param: "max_tokens"},
		{name: "max_tokens is absurd", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":100000000000}`, param: "max_tokens"},
		{name: "max_tokens beyond int64", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":1e300}`, param: "max_tokens"},
		{name: "max_completion_tokens is a string", route: chat, body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":"9"}`, param: "max_completion_tokens"},
		{name: "min_tokens is negative", route: comp, body: `{"model":"m","prompt":"hi","min_tokens":-3}`, param: "min_tokens"},
		{name: "n is a string", route: comp, body: `{"model":"m","prompt":"hi","n":"2"}`, param: "n"},
		{name: "max_tokens is 0", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":0}`, param: "max_tokens"},
		{name: "max_tokens is -0", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":-0}`, param: "max_tokens"},
		{name: "max_tokens is 2^24", route: comp, body: `{"model":"m","prompt":"hi","max_tokens":16777216}`, param: "max_tokens"},
		{name: "max_completion_tokens is 0", route: chat, body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}`, param: "max_completion_tokens"},
		{name: "n is 0", route: comp, body: `{"model":"m","prompt":"hi","n":0}`, param: "n"},
		{name: "a prompt array holds null", route: comp, body: `{"model":"m","prompt":["a",null]}`, param: "prompt"},
		{name: "a prompt array starts with null", route: comp, body: `{"model":"m","prompt":[null]}`, param: "prompt"},
		{name: "a token array holds null", route: comp, body: `{"model":"m","prompt":[[1,null]]}`, param: "prompt"},
		{name: "a token id is negative", route: comp, body: `{"model":"m","prompt":[1,-2]}`, param: "prompt"},
		{name: "token ids mixed with strings", route: comp, body: `{"model":"m","prompt":[1,"a"]}`, param: "prompt"},
		{name: "temperature is a string", route: comp, body: `{"model":"m","prompt":"hi","temperature":"0.7"}`, param: "temperature"},
		{name: "top_p is a boolean", route: chat, body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":true}`, param: "top_p"},
		{name: "presence_penalty is an object", route: comp, body: `{"model":"m","prompt":"hi","presence_penalty":{}}`, param: "presence_penalty"},
		{name: "seed is a fraction", route: comp, body: `{"model":"m","prompt":"hi","seed":1.5}`, param: "seed"},
		{name: "top_k is a string", route: comp, body: `{"model":"m","prompt":"hi","top_k":"5"}`, param: "top_k"},
		{name: "stop is a number", route: comp, body: `{"model":"m","prompt":"hi","stop":5}`, param: "stop"},
		{name: "stop holds a number", route: comp, body: `{"model":"m","prompt":"hi","stop":["a",5]}`, param: "stop"},
		{name: "echo is a string", route: comp, body: `{"model":"m","prompt":"hi","echo":"yes"}`, param: "echo"},
		{name: "ignore_eos is a number", route: comp, body: `{"model":"m","prompt":"hi","ignore_eos":1}`, param: "ignore_eos"},
		{name: "a completion's logprobs is a boolean", route: comp, body: `{"model":"m","prompt":"hi","logprobs":true}`, param: "logprobs"},
		{name: "a chat's logprobs is a number", route: chat, body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"logprobs":2}`, param: "logprobs"},
		{name: "best_of is 0", route: comp, body: `{"model":"m","prompt":"hi","best_of":0}`, param: "best_of"},
		{name: "prompt_logprobs is negative", route: comp, body: `{"model":"m","prompt":"hi","prompt_logprobs":-1}`, param: "prompt_logprobs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newEngine(t, vllmDecode)
			h := aggregated(t, Config{}, d)
			resp, body := h.post(tc.route, tc.body)
			msg, typ, _, param := checkOpenAIError(t, resp, body, http.StatusBadRequest)
			if typ != "invalid_request_error" {
				t.Errorf("type %q, want invalid_request_error", typ)
			}
			switch {
			case tc.param == "" && param != nil:
				t.Errorf("param %q, want null", *param)
			case tc.param != "" && (param == nil || *param != tc.param):
				t.Errorf("param %v, want %q; body %s", param, tc.param, body)
			}
			if tc.param != "" && !strings.Contains(msg, fieldWord(tc.param)) {
				t.Errorf("message %q does not name %s", msg, tc.param)
			}
			if tc.says != "" && !strings.Contains(msg, tc.says) {
				t.Errorf("message %q does not say %q", msg, tc.says)
			}
			if resp.Header.Get("X-Request-Id") == "" {
				t.Errorf("the error answer has no X-Request-Id")
			}
			if g := d.generations(); len(g) != 0 {
				t.Errorf("a refused request reached the decoder %d times", len(g))
			}
			h.waitQuiet()
		})
	}
}

func TestBodyOverTheLimitIs413(t *testing.T) {
	d := newEngine(t, vllmDecode)
	h := aggregated(t, Config{MaxBodyBytes: 1 << 10}, d)
	body := `{"model":"m","prompt":"` + strings.Repeat("a", 4<<10) + `"}`
	resp, b := h.post("/v1/completions", body)
	_, _, code, _ := checkOpenAIError(t, resp, b, http.StatusRequestEntityTooLarge)
	if code != "request_too_large" {
		t.Errorf("code %q, want request_too_large", code)
	}
	if g := d.generations(); len(g) != 0 {
		t.Errorf("an oversized request reached the decoder")
	}
	// Just under the limit still passes.
	resp, _ = h.post("/v1/completions", `{"model":"m","prompt":"`+strings.Repeat("a", 900)+`"}`)
	if resp.StatusCode != http.StatusOK {
		t.Errorf("a body under the limit got %d, want 200", resp.StatusCode)
	}
}

func TestBackendFailuresReachTheClientAsOpenAIErrors(t *testing.T) {
	const vllm400 = `{"object":"error","message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError","param":null,"code":400}`
	off := false
	for _, tc := range []struct {
		name       string
		cfg        Config
		prefill    engineHandler // nil: aggregated
		prefillURL string        // set: the prefiller sits at this address
		decode     engineHandler
		decodeURL  string
		status     int
		wantBody   string // exact body when the backend's own answer passes through
		wantCode   string
		noDecode   bool
	}{
		{name: "a decoder's 400 passes through with its status and body", decode: answer(400, "application/json", vllm400),
			status: 400, wantBody: vllm400},
		{name: "a decoder's 404 for an unknown model passes through", decode: answer(404, "application/json", `{"error":{"message":"model x not found"}}`),
			status: 404, wantBody: `{"error":{"message":"model x not found"}}`},
		{name: "a prefiller's 400 passes through and no decode is sent", prefill: answer(400, "application/json", vllm400), decode: vllmDecode,
			status: 400, wantBody: vllm400, noDecode: true},
		{name: "a decoder's 500 is a 502 that does not leak its body", decode: answer(500, "text/plain", "Traceback: CUDA error at 10.1.2.3"),
			status: 502, wantCode: "backend_error"},
		{name: "a decoder at a closed port is a 502", decodeURL: "closed",
			status: 502, wantCode: "backend_unreachable"},
		{name: "a prefiller answering non-JSON is a clean 502", cfg: Config{DecodeOnlyFallback: &off},
			prefill: answer(200, "text/html", "<html>Traceback: 10.1.2.3</html>"), decode: vllmDecode,
			status: 502, wantCode: "backend_unreachable", noDecode: true},
		{name: "a prefiller returning kv_transfer_params as a string is a clean 502", cfg: Config{DecodeOnlyFallback: &off},
			prefill: vllmPrefill(`"10.1.2.3:5600"`), decode: vllmDecode,
			status: 502, wantCode: "bad_kv_transfer_params", noDecode: true},
		{name: "a prefiller returning kv_transfer_params as an array is a clean 502", cfg: Config{DecodeOnlyFallback: &off},
			prefill: vllmPrefill(`[1,2]`), decode: vllmDecode,
			status: 502, wantCode: "bad_kv_transfer_params", noDecode: true},
		{name: "a prefiller's 500 without fallback is a 502", cfg: Config{DecodeOnlyFallback: &off},
			prefill: answer(500, "text/plain", "Traceback: 10.1.2.3"), decode: vllmDecode,
			status: 502, wantCode: "backend_error", noDecode: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d *fakeEngine
			durl := tc.decodeURL
			if durl == "closed" {
				durl = closedURL(t)
			} else {
				d = newEngine(t, tc.decode)
				durl = d.URL()
			}
			bs := []routerconfig.BackendConfig{decoder("d0", durl)}
			if tc.prefill != nil {
				bs = append(bs, prefiller("p0", newEngine(t, tc.prefill).URL()))
			}
			h := newHarness(t, tc.cfg, routerconfig.Config{Backends: bs})
			resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","max_tokens":5}`)
			if tc.wantBody != "" {
				if resp.StatusCode != tc.status || string(body) != tc.wantBody {
					t.Errorf("got %d %s\nwant %d %s", resp.StatusCode, body, tc.status, tc.wantBody)
				}
			} else {
				_, _, code, _ := checkOpenAIError(t, resp, body, tc.status)
				if code != tc.wantCode {
					t.Errorf("code %q, want %q", code, tc.wantCode)
				}
				for _, leak := range []string{"10.1.2.3", "Traceback", "127.0.0.1", "html"} {
					if strings.Contains(string(body), leak) {
						t.Errorf("the answer leaks %q: %s", leak, body)
					}
				}
			}
			if tc.noDecode && len(d.generations()) != 0 {
				t.Errorf("the decoder was called; want no decode after the prefill failed")
			}
			h.waitQuiet()
		})
	}
}

func TestNoDecoderAvailableIs503WithRetryAfter(t *testing.T) {
	for _, tc := range []struct {
		name   string
		err    error
		status int
		code   string
	}{
		{"the router has no healthy decoder", router.ErrNoBackend, 503, "no_backend"},
		{"every decoder stayed busy for the queue timeout", router.ErrQueueTimeout, 503, "queue_timeout"},
		{"every decoder is busy and the queue is full", router.ErrQueueFull, 429, "queue_full"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newFront(t, Config{}, stubRouter{err: tc.err}, prometheus.NewRegistry())
			resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi"}`)
			_, _, code, _ := checkOpenAIError(t, resp, body, tc.status)
			if code != tc.code {
				t.Errorf("code %q, want %q", code, tc.code)
			}
			if resp.Header.Get("Retry-After") == "" {
				t.Errorf("no Retry-After header")
			}
			h.waitQuiet()
		})
	}

	t.Run("an ejected decoder is not sent requests; the client gets 503", func(t *testing.T) {
		d := newEngine(t, answer(500, "text/plain", "boom"))
		h := newHarness(t, Config{}, routerconfig.Config{
			Backends: []routerconfig.BackendConfig{decoder("d0", d.URL())},
			Ejection: routerconfig.EjectionConfig{ConsecutiveFailures: 1, BaseBackoff: time.Hour, MaxBackoff: time.Hour},
		})
		if resp, _ := h.post("/v1/completions", `{"model":"m","prompt":"hi"}`); resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("first request: status %d, want 502", resp.StatusCode)
		}
		resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi"}`)
		_, _, code, _ := checkOpenAIError(t, resp, body, http.StatusServiceUnavailable)
		if code != "no_backend" || resp.Header.Get("Retry-After") == "" {
			t.Errorf("code %q Retry-After %q, want no_backend and a Retry-After", code, resp.Header.Get("Retry-After"))
		}
		if n := len(d.generations()); n != 1 {
			t.Errorf("the ejected decoder got %d calls, want only the one that ejected it", n)
		}
		if resp, _ := h.do(http.MethodGet, "/ready", "", nil); resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("/ready = %d with the only decoder ejected, want 503", resp.StatusCode)
		}
		h.waitQuiet()
	})
}

func TestUnknownRoutesAndMethods(t *testing.T) {
	h := aggregated(t, Config{}, newEngine(t, vllmDecode))
	for _, tc := range []struct {
		name, method, path string
		status             int
	}{
		{"an unknown route is 404", http.MethodPost, "/v1/embeddingz", 404},
		{"a path outside the API is 404", http.MethodGet, "/", 404},
		{"GET on completions is 405", http.MethodGet, "/v1/completions", 405},
		{"DELETE on chat completions is 405", http.MethodDelete, "/v1/chat/completions", 405},
		{"POST on /health is 405", http.MethodPost, "/health", 405},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := h.do(tc.method, tc.path, "", nil)
			checkOpenAIError(t, resp, body, tc.status)
		})
	}
}

// fieldWord is the last name in a param path: "messages[1].role" is "role".
func fieldWord(param string) string {
	if i := strings.LastIndexByte(param, '.'); i >= 0 {
		param = param[i+1:]
	}
	if i := strings.IndexByte(param, '['); i >= 0 {
		param = param[:i]
	}
	return param
}
