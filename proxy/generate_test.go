package proxy

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
)

// generateStream is a vLLM decoder's stream on the token-in route: token ids, no text.
var generateStream = []string{
	`data: {"request_id":"generate-tokens-x","choices":[{"index":0,"logprobs":null,"finish_reason":null,"token_ids":[7]}],"usage":null}` + "\n\n",
	`data: {"request_id":"generate-tokens-x","choices":[{"index":0,"logprobs":null,"finish_reason":"length","token_ids":[8]}],"usage":null}` + "\n\n",
	"data: [DONE]\n\n",
}

// generateDecode answers a decode of the token-in route as vLLM does: the stream, or one
// answer.
func generateDecode(w http.ResponseWriter, _ *http.Request, body []byte) {
	var req struct {
		Stream bool `json:"stream"`
	}
	json.Unmarshal(body, &req)
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"request_id":"generate-tokens-x","choices":[{"index":0,"logprobs":null,"finish_reason":"length","token_ids":[7,8]}],"prompt_logprobs":null,"kv_transfer_params":null}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	for _, c := range generateStream {
		io.WriteString(w, c)
		w.(http.Flusher).Flush()
	}
}

// A generate request is prefilled and decoded on the token-in route: the prefiller gets it
// bounded to one token inside sampling_params, not streamed, asked to keep the KV; the decoder
// the client's body with the prefiller's params; the client the decoder's answer as it came.
func TestAGenerateRequestIsPrefilledThenDecodedOnTheTokenInRoute(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(map[bool]string{true: "streamed", false: "one answer"}[stream], func(t *testing.T) {
			p := newEngine(t, vllmPrefill(prefillerParams))
			d := newEngine(t, generateDecode)
			h := pd(t, Config{}, p, d)
			body := `{"model":"m","token_ids":[1,2,3],"sampling_params":{"max_tokens":8,"min_tokens":2,"temperature":0},"stream":` +
				map[bool]string{true: "true", false: "false"}[stream] + `,"cache_salt":"s1"}`
			resp, got := h.post(api.GenerateRoute, body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			want := `{"request_id":"generate-tokens-x","choices":[{"index":0,"logprobs":null,"finish_reason":"length","token_ids":[7,8]}],"prompt_logprobs":null,"kv_transfer_params":null}`
			if stream {
				want = strings.Join(generateStream, "")
			}
			if string(got) != want {
				t.Errorf("the client got\n%s\nwant the decoder's answer as it came\n%s", got, want)
			}
			pre := p.only(t, "prefiller")
			if pre.Path != api.GenerateRoute {
				t.Errorf("prefill went to %s, want %s", pre.Path, api.GenerateRoute)
			}
			pf := pre.fields(t)
			if string(pf["sampling_params"]) != `{"temperature":0,"max_tokens":1}` || string(pf["stream"]) != "false" {
				t.Errorf("prefill sampling_params %s, stream %s: want one token, min_tokens left out, not streamed", pf["sampling_params"], pf["stream"])
			}
			var kv struct {
				DoRemoteDecode bool `json:"do_remote_decode"`
			}
			if json.Unmarshal(pf["kv_transfer_params"], &kv) != nil || !kv.DoRemoteDecode {
				t.Errorf("prefill kv_transfer_params %s, want do_remote_decode", pf["kv_transfer_params"])
			}
			dec := d.only(t, "decoder")
			df := dec.fields(t)
			if dec.Path != api.GenerateRoute || string(df["kv_transfer_params"]) != prefillerParams {
				t.Errorf("decode to %s with kv_transfer_params %s, want %s with the prefiller's", dec.Path, df["kv_transfer_params"], api.GenerateRoute)
			}
			if string(df["sampling_params"]) != `{"max_tokens":8,"min_tokens":2,"temperature":0}` {
				t.Errorf("decode sampling_params %s, want the client's", df["sampling_params"])
			}
			h.waitQuiet()
		})
	}
}

// What P/D cannot serve safely goes to a decoder alone, as a completion does: several samples
// (sampling_params.n, vLLM #38900) and the prompt's logprobs (#50792).
func TestAGenerateRequestThatPDCannotServeSafelyIsDecodedAlone(t *testing.T) {
	for _, tc := range []struct{ name, sampling, reason string }{
		{"two samples", `{"max_tokens":4,"n":2}`, api.DecodeOnlyN},
		{"the prompt's logprobs", `{"max_tokens":4,"prompt_logprobs":1}`, api.DecodeOnlyPromptLogprobs},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newEngine(t, vllmPrefill(prefillerParams))
			d := newEngine(t, generateDecode)
			h := pd(t, Config{}, p, d)
			resp, got := h.post(api.GenerateRoute, `{"model":"m","token_ids":[1,2,3],"sampling_params":`+tc.sampling+`}`)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			if n := len(p.generations()); n != 0 {
				t.Errorf("the prefiller got %d requests, want none", n)
			}
			if _, ok := d.only(t, "decoder").fields(t)["kv_transfer_params"]; ok {
				t.Error("the decoder was sent kv_transfer_params")
			}
			if n := h.value("pdproxy_decode_only_total", map[string]string{"reason": tc.reason}); n != 1 {
				t.Errorf("decode_only{%s} = %v, want 1", tc.reason, n)
			}
			h.waitQuiet()
		})
	}
}

// SGLang has no token-in route: a generate request whose decoder is an SGLang engine is
// answered 404, and neither engine hears of it.
func TestAGenerateRequestForSGLangEnginesIsANotFound(t *testing.T) {
	p := newEngine(t, sglangLeg(generateDecode))
	d := newEngine(t, sglangLeg(generateDecode))
	h := newHarness(t, Config{}, sglangBackends(p, d, false))
	resp, body := h.post(api.GenerateRoute, `{"model":"m","token_ids":[1,2,3],"sampling_params":{"max_tokens":4}}`)
	checkOpenAIError(t, resp, body, http.StatusNotFound)
	if n := len(p.generations()) + len(d.generations()); n != 0 {
		t.Errorf("the engines got %d requests, want none", n)
	}
	h.waitQuiet()
}

// Bodies the token-in route refuses before any engine hears of them, naming the member.
func TestAGenerateRequestThatNoEngineWouldTakeIsRefused(t *testing.T) {
	for _, tc := range []struct{ name, body, param string }{
		{"no token_ids", `{"model":"m","sampling_params":{}}`, "token_ids"},
		{"empty token_ids", `{"model":"m","token_ids":[],"sampling_params":{}}`, "token_ids"},
		{"a negative token id", `{"model":"m","token_ids":[1,-1],"sampling_params":{}}`, "token_ids"},
		{"a token id past 2^32", `{"model":"m","token_ids":[4294967296],"sampling_params":{}}`, "token_ids"},
		{"text for token_ids", `{"model":"m","token_ids":"hello","sampling_params":{}}`, "token_ids"},
		{"no sampling_params", `{"model":"m","token_ids":[1]}`, "sampling_params"},
		{"sampling_params not an object", `{"model":"m","token_ids":[1],"sampling_params":[1]}`, "sampling_params"},
		{"max_tokens 0", `{"model":"m","token_ids":[1],"sampling_params":{"max_tokens":0}}`, "sampling_params.max_tokens"},
		{"a temperature as a string", `{"model":"m","token_ids":[1],"sampling_params":{"temperature":"0.5"}}`, "sampling_params.temperature"},
		{"stop as a number", `{"model":"m","token_ids":[1],"sampling_params":{"stop":5}}`, "sampling_params.stop"},
		{"no model", `{"token_ids":[1],"sampling_params":{}}`, "model"},
		{"stream_options not an object", `{"model":"m","token_ids":[1],"sampling_params":{},"stream_options":1}`, "stream_options"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, e := api.ParseGenerate([]byte(tc.body))
			if e == nil || e.Status != http.StatusBadRequest || e.Param != tc.param {
				t.Fatalf("api.ParseGenerate = %+v, want a 400 naming %s", e, tc.param)
			}
		})
	}
}

// FuzzParseGenerateRequest feeds api.ParseGenerate arbitrary bodies. It must never panic; a
// body it accepts has a model and tokens and turns into prefill, drain and decode bodies that
// are JSON objects, the prefill's and the drain's bounded to one token in sampling_params; a
// body it refuses gets a 400 with a message.
func FuzzParseGenerateRequest(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","token_ids":[1,2,3],"sampling_params":{"max_tokens":5}}`,
		`{"model":"m","token_ids":[1],"sampling_params":{"n":2,"min_tokens":1},"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m","token_ids":[1],"sampling_params":{},"kv_transfer_params":{"do_remote_prefill":true},"features":{}}`,
		`{"model":"m","token_ids":[1],"sampling_params":null}`,
		`{"model":"m","token_ids":[-1],"sampling_params":{}}`,
		`{"model":"m","token_ids":[1],"sampling_params":{"max_tokens":"5"}}`,
		`{"model":"m","token_ids":[1],"sampling_params":{"sampling_params":{}}}`,
		`{"model":"m","token_ids":[1e3],"sampling_params":{}}`,
		`[]`, `null`, `{}`, ``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, e := api.ParseGenerate(body)
		if e != nil {
			if req != nil || e.Status != http.StatusBadRequest || e.Message == "" {
				t.Fatalf("refusal %+v (request %v), want a 400 with a message and no request", e, req != nil)
			}
			return
		}
		if req.Model == "" || len(req.Tokens) == 0 || req.API != engine.APIGenerate {
			t.Fatalf("accepted %q with model %q, %d tokens, api %d", body, req.Model, len(req.Tokens), req.API)
		}
		pre, err := engine.PrefillBody(req.Fields, req.API)
		if err != nil {
			t.Fatalf("PrefillBody of accepted %q: %v", body, err)
		}
		drain, err := engine.DrainBody(req.Fields, req.API, json.RawMessage(`{"remote_host":"h"}`))
		if err != nil {
			t.Fatalf("DrainBody of accepted %q: %v", body, err)
		}
		dec, err := engine.DecodeBody(req.Fields, json.RawMessage(`{"remote_host":"h"}`))
		if err != nil {
			t.Fatalf("DecodeBody of accepted %q: %v", body, err)
		}
		for _, b := range [][]byte{pre, drain, dec} {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(b, &m); err != nil || m == nil {
				t.Fatalf("backend body %q of accepted %q is not a JSON object: %v", b, body, err)
			}
		}
		for _, b := range [][]byte{pre, drain} {
			var m struct {
				SP struct {
					MaxTokens json.RawMessage `json:"max_tokens"`
				} `json:"sampling_params"`
			}
			if json.Unmarshal(b, &m) != nil || string(m.SP.MaxTokens) != "1" {
				t.Fatalf("one-token body %q of accepted %q is not bounded to one token", b, body)
			}
		}
	})
}
