package e2e

// Tests in front of engines the proxy takes for vLLM (no explicit
// abort: only a decoder's pull or notify frees a prefiller's hold, else its lease): a bad
// request or a refused decode never pins KV, a cut non-streaming decode is decoded once, a
// repeated explicit abort never reaches a later request with the same X-Request-Id, and only
// a prefiller's exact "kv_transfer_params" is forwarded.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// simDecoderBehind runs a simulated decoder on a port of its own, with wrap in front of its
// handler: a test's fault or recorder on the real engine's path.
func simDecoderBehind(t *testing.T, wrap func(engine http.Handler) http.Handler) *httptest.Server {
	t.Helper()
	cfg := sim.DefaultConfig()
	cfg.Role = "decode"
	cfg.ITL = time.Millisecond
	eng, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	srv := httptest.NewServer(wrap(eng.Handler()))
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim decoder: %v", err)
		}
		eng.CloseIdleConnections()
	})
	return srv
}

// asVLLM makes every in-process engine one the proxy takes for vLLM.
func asVLLM(c *app.Config) {
	for i := range c.Sims {
		c.Sims[i].Engine = "vllm"
	}
}

func TestVLLMBadRequestsAreRefusedBeforeAnyEngineHoldsKV(t *testing.T) {
	// Each of these is a request vLLM's decoder refuses. Let through, it would be prefilled
	// (rewritten to one token) and leave its hold pinned when the decoder refused the decode:
	// on vLLM nobody frees it then.
	s := startStack(t, fastSims, asVLLM)
	long := prompt(1000)
	for _, tc := range []struct {
		name, body, param string
	}{
		{"max_tokens 0", `{"model":"sim","prompt":"` + long + `","max_tokens":0}`, "max_tokens"},
		{"max_tokens -0", `{"model":"sim","prompt":"` + long + `","max_tokens":-0}`, "max_tokens"},
		{"max_tokens 2^24", `{"model":"sim","prompt":"` + long + `","max_tokens":16777216}`, "max_tokens"},
		{"a null in a prompt array", `{"model":"sim","prompt":["` + long + `",null],"max_tokens":5}`, "prompt"},
		{"a sampling field of the wrong type", `{"model":"sim","prompt":"` + long + `","max_tokens":5,"temperature":"hot"}`, "temperature"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := readOpenAIError(t, post(t, context.Background(), s.url+"/v1/completions", tc.body), http.StatusBadRequest)
			if e.Error.Param == nil || *e.Error.Param != tc.param {
				t.Errorf("error param %v, want %q: %s", e.Error.Param, tc.param, e.Error.Message)
			}
			for _, u := range s.allSimURLs() {
				if st := kv(t, u); st.RequestsTotal != 0 || st.HeldRequests != 0 {
					t.Errorf("%s reached an engine: %s", tc.name, jsonString(st))
				}
			}
			if got := testutil.Value(t, s.m.Registry, "pdproxy_backend_requests_total", nil); got != 0 {
				t.Errorf("the proxy sent %v requests to backends", got)
			}
		})
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_held_requests", nil); got != 0 {
		t.Errorf("pdproxy_kv_held_requests = %v", got)
	}
	s.assertQuiet(time.Second)
}

func TestVLLMDecoderRefusingADecodeUnreadGetsTheDrainAndThePrefillerHoldsNothing(t *testing.T) {
	// The only decoder answers 429 without reading the decode (so it never acknowledged it,
	// and never saw the params) when the client sends X-Refuse-Decode; the proxy passes the
	// header to both legs and the prefiller ignores it. The drain that releases the hold
	// carries no client header: the decoder, alive, takes it and pulls the blocks.
	d := simDecoderBehind(t, func(engine http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-Refuse-Decode") == "" {
				engine.ServeHTTP(w, r)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			io.WriteString(w, `{"error":{"message":"too many requests","type":"rate_limit_error","code":"rate_limited"}}`)
		})
	})
	s := startStack(t, fastSims, func(c *app.Config) {
		c.Sims = c.Sims[:1] // the simulated prefiller; the decoder is d
		c.Sims[0].Engine = "vllm"
		c.Router.Backends = []routerconfig.BackendConfig{{Name: "refusing-decode", URL: d.URL, Role: routerconfig.RoleDecode, Engine: "vllm"}}
	})
	p := s.m.SimURLs("prefill")[0]
	body := `{"model":"sim","prompt":"` + prompt(1000) + `","max_tokens":5,"ignore_eos":true}`
	const n = 20
	for i := 0; i < n; i++ {
		readOpenAIError(t, post(t, context.Background(), s.url+"/v1/completions", body, "X-Refuse-Decode", "1"), http.StatusTooManyRequests)
	}
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		st := kv(t, p)
		return st.HeldRequests == 0 && st.BlocksFree == st.BlocksTotal, "prefiller after the last refusal: " + jsonString(st)
	})
	if st := kv(t, p); st.RequestsTotal != n {
		t.Errorf("prefiller served %d prefills, want %d", st.RequestsTotal, n)
	}
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		got := testutil.Value(t, s.m.Registry, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": "released"})
		return got == n, fmt.Sprintf("holds released by the proxy: %v, want %d", got, n)
	})
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_held_requests", nil); got != 0 {
		t.Errorf("pdproxy_kv_held_requests = %v", got)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": "left_to_engine"}); got != 0 {
		t.Errorf("%v holds left pinned until the prefiller's lease", got)
	}
	s.assertQuiet(time.Second)
}

func TestVLLMCancelledNonStreamingRequestIsDecodedOnce(t *testing.T) {
	// A whole-JSON decode answers only at its end: the hold passes to the decoder when it
	// acknowledges the decode (100 Continue), not with the answer. A client that leaves mid-
	// decode then leaves nothing to release, so no drain goes to the other decoder with
	// params whose blocks were pulled already.
	s := startStack(t, fastSims, asVLLM, func(c *app.Config) {
		c.Sims = append(c.Sims, c.Sims[1]) // two decoders
		c.Sims[1].ITL = 10 * time.Millisecond
		c.Sims[2].ITL = 10 * time.Millisecond
	})
	p, ds := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")
	if len(ds) != 2 {
		t.Fatalf("decoders %v, want 2", ds)
	}
	sum := func(f func(sim.KVStats) int) int {
		n := 0
		for _, u := range ds {
			n += f(kv(t, u))
		}
		return n
	}
	body := `{"model":"sim","prompt":"` + prompt(100) + `","max_tokens":200,"ignore_eos":true}`
	const n = 20
	for i := 0; i < n; i++ {
		ctx, cancel := context.WithCancel(context.Background())
		done := inBackground(t, ctx, s.url+"/v1/completions", body, "X-Request-Id", fmt.Sprintf("cut-%d", i))
		// Mid-decode: a decoder runs it and has pulled the blocks (the prefiller was told).
		testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
			running, held := sum(func(st sim.KVStats) int { return st.RunningRequests }), kv(t, p).HeldRequests
			return running == 1 && held == 0, fmt.Sprintf("request %d: %d decoding, prefiller holds %d", i, running, held)
		})
		cancel()
		testutil.Recv(t, 2*time.Second, done, "request %d's client to return", i)
		testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
			running := sum(func(st sim.KVStats) int { return st.RunningRequests + st.WaitingRequests })
			return running == 0, fmt.Sprintf("after cutting request %d: %d requests still on the decoders", i, running)
		})
	}
	if got := kv(t, p).RequestsTotal; got != n {
		t.Errorf("prefills %d, want %d", got, n)
	}
	if got := sum(func(st sim.KVStats) int { return st.RequestsTotal }); got != n {
		t.Errorf("decodes %d, want %d: a cut decode was sent again as a drain", got, n)
	}
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		st := kv(t, p)
		return st.HeldRequests == 0 && st.BlocksFree == st.BlocksTotal, "prefiller: " + jsonString(st)
	})
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", map[string]string{"reason": "drained"}); got != 0 {
		t.Errorf("%v drains after decodes the decoders had taken", got)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_release_failures_total", nil); got != 0 {
		t.Errorf("%v releases failed (a drain answered kv_transfer_failed?)", got)
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": "handed_over"}); got != n {
		t.Errorf("holds handed over to a decoder: %v, want %d", got, n)
	}
	s.assertQuiet(time.Second)
}

func TestVLLMRepeatedAbortNeverReachesALaterRequestWithTheSameID(t *testing.T) {
	// The proxy aborts a prefill cut short on the engine, and once more 250 ms later (the
	// first may overtake the request). The engines must not know both requests by the
	// client's X-Request-Id: the repeat would then abort the second one.
	s := startStack(t, fastSims, func(c *app.Config) { c.Sims[1].ITL = 10 * time.Millisecond })
	p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
	const id = "reused-id"

	// A: the prefill is done and its KV held, its answer stalled; the client leaves then.
	ctx, cancel := context.WithCancel(context.Background())
	done := inBackground(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(200)+`","max_tokens":5}`,
		"X-Request-Id", id, "X-Sim-Stall", "600ms")
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
		st := kv(t, p)
		return st.HeldRequests == 1, "A not prefilled: " + jsonString(st)
	})
	cancel()
	testutil.Recv(t, 2*time.Second, done, "A's client to return")
	// A's first abort freed its hold, and the proxy is done with A: the id is free again.
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
		st := kv(t, p)
		_, inTable := s.m.Table.State(id)
		return st.AbortedTotal == 1 && st.HeldRequests == 0 && !inTable, fmt.Sprintf("A in the table %v, prefiller %s", inTable, jsonString(st))
	})

	// B, same id, at once: its answer is stalled too, so its prefill is held on the prefiller
	// while A's abort is repeated, and its decode runs 40 tokens at 10 ms after that.
	resp := post(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"`+prompt(200)+`","max_tokens":40,"ignore_eos":true}`,
		"X-Request-Id", id, "X-Sim-Stall", "600ms")
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("B: %d %v: %s", resp.StatusCode, err, b)
	}
	var c completion
	if err := json.Unmarshal(b, &c); err != nil || c.Usage == nil || c.Usage.CompletionTokens != 40 {
		t.Fatalf("B answered %s, want 40 tokens", b)
	}
	if got := resp.Header.Get("X-Request-Id"); got != id {
		t.Errorf("B's answer carries X-Request-Id %q, want the client's %q", got, id)
	}
	if st := kv(t, p); st.AbortedTotal != 1 {
		t.Errorf("prefiller aborted %d requests, want 1 (A's): %s", st.AbortedTotal, jsonString(st))
	}
	if st := kv(t, d); st.AbortedTotal != 0 {
		t.Errorf("decoder aborted %d requests, want 0: %s", st.AbortedTotal, jsonString(st))
	}
	s.assertQuiet(time.Second)
}

func TestVLLMOnlyAPrefillersExactKVTransferParamsAreForwarded(t *testing.T) {
	// vLLM reads exactly "kv_transfer_params": a prefiller's "KV_Transfer_Params" is another
	// field, and the prefiller held nothing for the decoder to pull. Were it forwarded, the
	// decoder would try to pull blocks from remote_port 1 and fail the request.
	pre := newBrokenEngine(t, func(w http.ResponseWriter, r *http.Request, _ string) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"cmpl-p","object":"text_completion","model":"sim","choices":[{"index":0,"text":"H","finish_reason":"length"}],`+
			`"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},`+
			`"KV_Transfer_Params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"elsewhere","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":1,"tp_size":1}}`)
	})
	var (
		mu     sync.Mutex
		decode [][]byte
	)
	d := simDecoderBehind(t, func(engine http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/completions") {
				b, err := io.ReadAll(r.Body)
				if err != nil {
					return
				}
				mu.Lock()
				decode = append(decode, b)
				mu.Unlock()
				r.Body = io.NopCloser(bytes.NewReader(b))
			}
			engine.ServeHTTP(w, r)
		})
	})
	s := startStack(t, func(c *app.Config) {
		c.Sims = nil
		c.Router.Backends = []routerconfig.BackendConfig{
			{Name: "odd-prefill", URL: pre.URL, Role: routerconfig.RolePrefill, Engine: "vllm"},
			{Name: "sim-decode", URL: d.URL, Role: routerconfig.RoleDecode, Engine: "vllm"},
		}
	})
	resp := post(t, context.Background(), s.url+"/v1/completions", `{"model":"sim","prompt":"hello there","max_tokens":4,"ignore_eos":true}`)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	var c completion
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Errorf("status %d %v: %s", resp.StatusCode, err, b)
	} else if err := json.Unmarshal(b, &c); err != nil || c.Usage == nil || c.Usage.CompletionTokens != 4 {
		t.Errorf("answer %s, want 4 tokens the decoder computed", b)
	}
	if got := pre.calls.Load(); got != 1 {
		t.Errorf("prefiller called %d times, want 1", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(decode) != 1 {
		t.Fatalf("decoder got %d completion calls, want 1", len(decode))
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(decode[0], &fields); err != nil {
		t.Fatalf("decode body: %v: %s", err, decode[0])
	}
	for k, v := range fields {
		if strings.EqualFold(k, "kv_transfer_params") {
			t.Errorf("the decode carries %q: %s", k, v)
		}
	}
	if got := testutil.Value(t, s.m.Registry, "pdproxy_kv_releases_total", nil); got != 0 {
		t.Errorf("the proxy recorded %v holds for a prefill that held nothing", got)
	}
	pre.idle(t)
	s.assertQuiet(time.Second)
}
