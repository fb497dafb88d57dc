package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"reflect"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// The kv_transfer_params a prefiller must get (vLLM NixlConnector, docs/engines.md#how-a-request-flows).
var wantPrefillKV = map[string]any{
	"do_remote_decode": true, "do_remote_prefill": false,
	"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
}

func TestPDSplitsARequestIntoAPrefillAndADecode(t *testing.T) {
	cases := []struct {
		name  string
		route string
		body  string
		chat  bool
	}{
		{
			name:  "completions: the prefiller computes one token and keeps the KV, the decoder gets the client's request and the prefiller's KV params",
			route: "/v1/completions",
			body: `{"model":"m","prompt":"Hello there","stream":true,"stream_options":{"include_usage":true},` +
				`"max_tokens":50,"min_tokens":5,"temperature":0.25,"vendor_ext":{"b":[1,2],"a":"x"},` +
				`"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil.example"}}`,
		},
		{
			name:  "chat: max_completion_tokens is 1 on the prefill too and min_completion_tokens waits for the decode",
			route: "/v1/chat/completions",
			chat:  true,
			body: `{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],` +
				`"stream":true,"stream_options":{"include_usage":true},"max_tokens":40,"max_completion_tokens":40,` +
				`"min_tokens":2,"min_completion_tokens":2,"top_p":0.9,"vendor_ext":{"nested":{"k":[null,true]}},` +
				`"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil.example"}}`,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newEngine(t, vllmPrefill(prefillerParams))
			d := newEngine(t, vllmDecode)
			h := pd(t, Config{}, p, d)

			resp, _ := h.post(tc.route, tc.body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d, want 200", resp.StatusCode)
			}
			var client map[string]json.RawMessage
			json.Unmarshal([]byte(tc.body), &client)

			pre := p.only(t, "prefiller")
			pf := pre.fields(t)
			if pre.Path != tc.route {
				t.Errorf("prefill went to %s, want %s", pre.Path, tc.route)
			}
			var kv map[string]any
			if err := json.Unmarshal(pf["kv_transfer_params"], &kv); err != nil || !reflect.DeepEqual(kv, wantPrefillKV) {
				t.Errorf("prefill kv_transfer_params = %s, want %v", pf["kv_transfer_params"], wantPrefillKV)
			}
			want := map[string]string{"stream": "false", "max_tokens": "1"}
			if tc.chat {
				want["max_completion_tokens"] = "1"
			}
			for k, v := range want {
				if string(pf[k]) != v {
					t.Errorf("prefill %s = %s, want %s", k, pf[k], v)
				}
			}
			for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
				if v, ok := pf[k]; ok {
					t.Errorf("prefill carries %s = %s; it must be left out", k, v)
				}
			}
			for k, v := range client {
				if _, rewritten := want[k]; rewritten || k == "kv_transfer_params" || k == "stream_options" || k == "min_tokens" || k == "min_completion_tokens" {
					continue
				}
				if !jsonEqual(t, pf[k], v) {
					t.Errorf("prefill %s = %s, want the client's %s", k, pf[k], v)
				}
			}

			dec := d.only(t, "decoder")
			df := dec.fields(t)
			if dec.Path != tc.route {
				t.Errorf("decode went to %s, want %s", dec.Path, tc.route)
			}
			if got := string(df["kv_transfer_params"]); got != prefillerParams {
				t.Errorf("decode kv_transfer_params changed on the way:\n got %s\nwant %s", got, prefillerParams)
			}
			for k, v := range client {
				if k == "kv_transfer_params" {
					continue
				}
				if !jsonEqual(t, df[k], v) {
					t.Errorf("decode %s = %s, want the client's %s", k, df[k], v)
				}
			}
			for k := range df {
				if _, ok := client[k]; !ok {
					t.Errorf("decode carries %s, which the client did not send", k)
				}
			}
			if pid, did := pre.Header.Get("X-Request-Id"), dec.Header.Get("X-Request-Id"); pid == "" || pid != did {
				t.Errorf("X-Request-Id prefill %q, decode %q: want the same, non-empty", pid, did)
			}
			h.waitQuiet()
		})
	}
}

func TestPrefillHoldingNoKVSendsTheDecodeWithoutParams(t *testing.T) {
	for _, tc := range []struct{ name, params string }{
		{"kv_transfer_params null: the decoder recomputes the prompt", "null"},
		{"kv_transfer_params absent: the decoder recomputes the prompt", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newEngine(t, vllmPrefill(tc.params))
			d := newEngine(t, vllmDecode)
			h := pd(t, Config{}, p, d)
			resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3}`)
			if resp.StatusCode != http.StatusOK || string(body) != decodeJSONCompletion {
				t.Fatalf("status %d body %s, want 200 with the decoder's answer", resp.StatusCode, body)
			}
			p.only(t, "prefiller")
			if v, ok := d.only(t, "decoder").fields(t)["kv_transfer_params"]; ok {
				t.Errorf("decode carries kv_transfer_params %s; want none", v)
			}
			if n := h.value("pdproxy_fallbacks_total", nil); n != 0 {
				t.Errorf("pdproxy_fallbacks_total = %v, want 0: the prefill did answer", n)
			}
			h.waitQuiet()
		})
	}
}

func TestAggregatedServingSendsTheRequestStraightToADecoder(t *testing.T) {
	for _, tc := range []struct {
		name, route, body string
		dropped           string
	}{
		{name: "completions body reaches the decoder as sent", route: "/v1/completions",
			body: `{"model":"m","prompt":["a","b"],"stream":false,"max_tokens":7,"min_tokens":1,"logprobs":2,"vendor":{"x":[1.5,"y"]}}`},
		{name: "chat body reaches the decoder as sent", route: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":9}`},
		{name: "a client's own kv_transfer_params never reach the decoder", route: "/v1/completions",
			body:    `{"model":"m","prompt":"p","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil.example","remote_port":1}}`,
			dropped: "kv_transfer_params"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newEngine(t, vllmDecode)
			h := aggregated(t, Config{}, d)
			resp, _ := h.post(tc.route, tc.body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d, want 200", resp.StatusCode)
			}
			got := d.only(t, "decoder")
			want := []byte(tc.body)
			if tc.dropped != "" {
				var f map[string]json.RawMessage
				json.Unmarshal(want, &f)
				delete(f, tc.dropped)
				want, _ = json.Marshal(f)
			}
			if !jsonEqual(t, got.Body, want) {
				t.Errorf("decoder got %s\nwant %s", got.Body, want)
			}
			if n := h.value("pdproxy_fallbacks_total", nil); n != 0 {
				t.Errorf("pdproxy_fallbacks_total = %v, want 0: aggregated serving is no fallback", n)
			}
			h.waitQuiet()
		})
	}
}

func TestRequestIDsForTheClientAndForTheEngines(t *testing.T) {
	for _, tc := range []struct {
		name   string
		sent   string
		wantIt bool // the client's id is kept
	}{
		{"the client's X-Request-Id is used", "client-req-42", true},
		{"without X-Request-Id one is generated", "", false},
		{"an X-Request-Id with spaces is replaced by a generated one", "has spaces in it", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newEngine(t, vllmPrefill(prefillerParams))
			d := newEngine(t, vllmDecode)
			h := pd(t, Config{}, p, d)
			hdr := http.Header{}
			if tc.sent != "" {
				hdr.Set("X-Request-Id", tc.sent)
			}
			var engineIDs []string
			for range 2 { // the same client id twice: each request is a new one to the engines
				resp, _ := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, hdr)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d, want 200", resp.StatusCode)
				}
				got := resp.Header.Get("X-Request-Id")
				pre, dec := p.generations(), d.generations()
				pid, did := pre[len(pre)-1].Header.Get("X-Request-Id"), dec[len(dec)-1].Header.Get("X-Request-Id")
				if got == "" || pid == "" || pid != did {
					t.Errorf("X-Request-Id: answer %q, prefill %q, decode %q; want an answer id and one engine id on both calls", got, pid, did)
				}
				if len(pid) != 32 || pid == got {
					t.Errorf("engine id %q, want 32 hex digits of its own (the client's id is %q)", pid, got)
				}
				if c := pre[len(pre)-1].Header.Get("X-Client-Request-Id"); c != got {
					t.Errorf("X-Client-Request-Id %q on the prefill, want the answer's %q", c, got)
				}
				if tc.wantIt && got != tc.sent {
					t.Errorf("X-Request-Id %q, want the client's %q", got, tc.sent)
				}
				if !tc.wantIt && got == tc.sent {
					t.Errorf("X-Request-Id %q was kept; want a generated one", got)
				}
				engineIDs = append(engineIDs, pid)
			}
			if engineIDs[0] == engineIDs[1] {
				t.Errorf("two requests went to the engines as %q both", engineIDs[0])
			}
		})
	}
}

func TestHeadersThatPickAnUpstreamAreNotForwarded(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := pd(t, Config{}, p, d)
	hdr := http.Header{}
	hdr.Set("X-Prefiller-Host-Port", "10.9.9.9:8000")
	hdr.Set("X-Decoder-Host-Port", "10.9.9.9:8001")
	hdr.Set("X-Forwarded-Host", "evil.example")
	hdr.Set("Proxy-Authorization", "Basic c2VjcmV0")
	hdr.Set("Authorization", "Bearer engine-key")
	hdr.Set("X-Tenant", "team-a")
	resp, _ := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, hdr)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d, want 200", resp.StatusCode)
	}
	for who, got := range map[string]received{"prefiller": p.only(t, "prefiller"), "decoder": d.only(t, "decoder")} {
		for _, k := range []string{"X-Prefiller-Host-Port", "X-Decoder-Host-Port", "X-Forwarded-Host", "Proxy-Authorization"} {
			if v := got.Header.Get(k); v != "" {
				t.Errorf("%s got %s: %q; it must not be forwarded", who, k, v)
			}
		}
		for k, v := range map[string]string{"Authorization": "Bearer engine-key", "X-Tenant": "team-a", "Content-Type": "application/json"} {
			if got.Header.Get(k) != v {
				t.Errorf("%s got %s %q, want %q", who, k, got.Header.Get(k), v)
			}
		}
	}
}

func TestHeadersNamedInConnectionAreNotForwarded(t *testing.T) {
	// RFC 9110 section 7.6.1: a header that the client's Connection header names was for the
	// hop to the proxy alone.
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := pd(t, Config{}, p, d)
	hdr := http.Header{}
	hdr.Add("Connection", "X-Hop-Secret, x-trace-hop")
	hdr.Add("Connection", " X-Second-Line ")
	hdr.Set("X-Hop-Secret", "for the proxy")
	hdr.Set("X-Trace-Hop", "1")
	hdr.Set("X-Second-Line", "2")
	hdr.Set("X-Tenant", "team-a")
	resp, _ := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, hdr)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d, want 200", resp.StatusCode)
	}
	for who, got := range map[string]received{"prefiller": p.only(t, "prefiller"), "decoder": d.only(t, "decoder")} {
		for _, k := range []string{"X-Hop-Secret", "X-Trace-Hop", "X-Second-Line"} {
			if v := got.Header.Get(k); v != "" {
				t.Errorf("%s got %s: %q; Connection named it, so it must not be forwarded", who, k, v)
			}
		}
		if got.Header.Get("X-Tenant") != "team-a" {
			t.Errorf("%s lost X-Tenant, which Connection did not name", who)
		}
	}
}

func TestPrefillRetryAndDecodeOnlyFallback(t *testing.T) {
	busy := answer(http.StatusServiceUnavailable, "application/json", `{"error":"overloaded"}`)
	for _, tc := range []struct {
		name          string
		first, second engineHandler // nil second: a lone prefiller; nil first: its port is closed
		noSecond      bool
		wantRetries   float64
		wantFallbacks float64
		wantKV        bool
	}{
		{name: "a prefiller answering 503 is retried on another, which serves",
			first: busy, second: vllmPrefill(prefillerParams), wantRetries: 1, wantKV: true},
		{name: "a prefiller whose port is closed is retried on another, which serves",
			second: vllmPrefill(prefillerParams), wantRetries: 1, wantKV: true},
		{name: "when every prefiller fails the decoder serves alone",
			first: busy, second: busy, wantRetries: 1, wantFallbacks: 1},
		{name: "a lone failing prefiller counts no retry, only the fallback",
			first: busy, noSecond: true, wantFallbacks: 1},
		{name: "a prefiller answering kv_transfer_params that are not an object is not trusted: the decoder serves alone",
			first: vllmPrefill(`"10.0.0.7:5600"`), noSecond: true, wantFallbacks: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newEngine(t, vllmDecode)
			// The first prefiller weighs more, so the router tries it first.
			firstURL := closedURL(t)
			var first, second *fakeEngine
			if tc.first != nil {
				first = newEngine(t, tc.first)
				firstURL = first.URL()
			}
			bs := []routerconfig.BackendConfig{{Name: "p-first", URL: firstURL, Role: routerconfig.RolePrefill, Weight: 2}}
			if !tc.noSecond {
				second = newEngine(t, tc.second)
				bs = append(bs, prefiller("p-second", second.URL()))
			}
			bs = append(bs, decoder("d0", d.URL()))
			h := newHarness(t, Config{}, routerconfig.Config{Backends: bs})

			resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","max_tokens":5}`)
			if resp.StatusCode != http.StatusOK || string(body) != decodeJSONCompletion {
				t.Fatalf("status %d body %s, want 200 with the decoder's answer", resp.StatusCode, body)
			}
			if first != nil && len(first.generations()) != 1 {
				t.Errorf("first prefiller got %d calls, want 1", len(first.generations()))
			}
			if second != nil && len(second.generations()) != 1 {
				t.Errorf("second prefiller got %d calls, want 1", len(second.generations()))
			}
			kv, hasKV := d.only(t, "decoder").fields(t)["kv_transfer_params"]
			if hasKV != tc.wantKV || (hasKV && string(kv) != prefillerParams) {
				t.Errorf("decode kv_transfer_params = %s (present %v), want present %v", kv, hasKV, tc.wantKV)
			}
			if n := h.value("pdproxy_retries_total", map[string]string{"role": "prefill"}); n != tc.wantRetries {
				t.Errorf(`pdproxy_retries_total{role="prefill"} = %v, want %v`, n, tc.wantRetries)
			}
			if n := h.value("pdproxy_fallbacks_total", nil); n != tc.wantFallbacks {
				t.Errorf("pdproxy_fallbacks_total = %v, want %v", n, tc.wantFallbacks)
			}
			h.waitQuiet()
		})
	}
}

func TestClientLeavingMidStreamCancelsTheDecoder(t *testing.T) {
	for _, tc := range []struct {
		name  string
		route string
		body  string
		pd    bool
	}{
		{name: "completions after a prefill", route: "/v1/completions", pd: true,
			body: `{"model":"m","prompt":"hi","stream":true,"max_tokens":100}`},
		{name: "chat, aggregated", route: "/v1/chat/completions",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			decoderGone := make(chan struct{})
			var d *fakeEngine
			d = newEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
				w.Header().Set("Content-Type", "text/event-stream")
				w.Write([]byte(sseChunks(tc.route == "/v1/chat/completions")[0]))
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
					close(decoderGone)
				case <-d.stop:
				}
			})
			var h *harness
			if tc.pd {
				h = pd(t, Config{}, newEngine(t, vllmPrefill(prefillerParams)), d)
			} else {
				h = aggregated(t, Config{}, d)
			}

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, tc.route, tc.body, nil))
			if err != nil {
				t.Fatalf("request: %v", err)
			}
			ev, err := readEvent(bufio.NewReader(resp.Body))
			if err != nil {
				t.Fatalf("first event: %v (%q)", err, ev)
			}
			cancel()
			resp.Body.Close()

			closedWithin(t, decoderGone, "the decoder's request to be cancelled")
			h.waitQuiet()
			if n := h.value("pdproxy_aborts_total", map[string]string{"stage": "decoding"}); n != 1 {
				t.Errorf(`pdproxy_aborts_total{stage="decoding"} = %v, want 1`, n)
			}
			// The request is counted as its handler returns, a moment after the table let it go.
			eventually(t, `pdproxy_requests_total{code="499"} to count the request`, func() bool {
				return h.value("pdproxy_requests_total", map[string]string{"route": tc.route, "code": "499"}) == 1
			})
		})
	}
}

func TestClientLeavingDuringPrefillCancelsThePrefillAndSendsNoDecode(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	prefillGone := make(chan struct{})
	var p *fakeEngine
	p = newEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		cancel() // the client leaves while the prefill runs
		select {
		case <-r.Context().Done():
			close(prefillGone)
		case <-p.stop:
		}
	})
	d := newEngine(t, vllmDecode)
	h := pd(t, Config{}, p, d)

	resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("the request was answered %d; want it cut by the client", resp.StatusCode)
	}
	closedWithin(t, prefillGone, "the prefiller's request to be cancelled")
	h.waitQuiet()
	if g := d.generations(); len(g) != 0 {
		t.Errorf("the decoder got %d calls after the client left during the prefill; want none", len(g))
	}
	if n := h.value("pdproxy_aborts_total", map[string]string{"stage": "prefilling"}); n != 1 {
		t.Errorf(`pdproxy_aborts_total{stage="prefilling"} = %v, want 1`, n)
	}
}

func TestRequestsPDCannotServeSafelyGoDecodeOnly(t *testing.T) {
	const chat = "/v1/chat/completions"
	for _, tc := range []struct {
		name, route, body string
		reason            string // "" means the request is prefilled as usual
	}{
		{name: "n > 1 (the prefiller would hold one set of blocks per sample, vLLM #38900)",
			body: `{"model":"m","prompt":"hi","n":2}`, reason: "n"},
		{name: "best_of > 1", body: `{"model":"m","prompt":"hi","best_of":3}`, reason: "n"},
		{name: "a chat with n > 1", route: chat, body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"n":4}`, reason: "n"},
		{name: "two prompts in one completion (only the first's params come back, vLLM #54707)",
			body: `{"model":"m","prompt":["a","b"]}`, reason: "prompt_array"},
		{name: "two token-id prompts", body: `{"model":"m","prompt":[[1,2],[3]]}`, reason: "prompt_array"},
		{name: "prompt_logprobs (a decoder handed params crashes, vLLM #50792)",
			body: `{"model":"m","prompt":"hi","prompt_logprobs":1}`, reason: "prompt_logprobs"},
		{name: "echo with logprobs", body: `{"model":"m","prompt":"hi","echo":true,"logprobs":1}`, reason: "prompt_logprobs"},
		{name: "n = 1 is prefilled", body: `{"model":"m","prompt":"hi","n":1}`},
		{name: "one prompt in an array is prefilled", body: `{"model":"m","prompt":["a"]}`},
		{name: "one prompt of token ids is prefilled", body: `{"model":"m","prompt":[1,2,3]}`},
		{name: "echo without logprobs is prefilled", body: `{"model":"m","prompt":"hi","echo":true}`},
		{name: "logprobs without echo is prefilled", body: `{"model":"m","prompt":"hi","logprobs":2}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			route := tc.route
			if route == "" {
				route = "/v1/completions"
			}
			p := newEngine(t, vllmPrefill(prefillerParams))
			d := newEngine(t, vllmDecode)
			h := pd(t, Config{}, p, d)
			resp, body := h.post(route, tc.body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d (%s), want 200", resp.StatusCode, body)
			}
			prefills := len(p.generations())
			_, withKV := d.only(t, "decoder").fields(t)["kv_transfer_params"]
			if tc.reason == "" {
				if prefills != 1 || !withKV {
					t.Errorf("%d prefills, decode with params %v; want the request prefilled", prefills, withKV)
				}
				if n := h.value("pdproxy_decode_only_total", nil); n != 0 {
					t.Errorf("pdproxy_decode_only_total = %v, want 0", n)
				}
				return
			}
			if prefills != 0 || withKV {
				t.Errorf("%d prefills, decode with params %v; want no prefill and a decode without params", prefills, withKV)
			}
			if n := h.value("pdproxy_decode_only_total", map[string]string{"reason": tc.reason}); n != 1 {
				t.Errorf(`pdproxy_decode_only_total{reason=%q} = %v, want 1`, tc.reason, n)
			}
			if !jsonEqual(t, d.only(t, "decoder").Body, []byte(tc.body)) {
				t.Errorf("decoder got %s, want the client's body as sent", d.only(t, "decoder").Body)
			}
			h.waitQuiet()
		})
	}
}
