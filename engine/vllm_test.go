package engine

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

// kvParams is what a vLLM prefiller returns: fields in no sorted order, a number literal a
// float round trip would rewrite, an integer beyond float64, an escape, characters HTML
// escaping would touch, and a field no vLLM version has. It must reach the decoder byte for byte.
const kvParams = `{"remote_port":5600,"do_remote_prefill":true,"do_remote_decode":false,` +
	`"remote_block_ids":[7,8,9],"remote_engine_id":"engine-p0","remote_request_id":"cmpl-p0-0",` +
	`"remote_host":"10.0.0.7","tp_size":1,"x_future":{"lease_s":30.50,"epoch":123456789012345678901,` +
	`"note":"caf\u00e9 <&>","list":[{"b":1,"a":2}]}}`

// wantPrefillKV is the kv_transfer_params a prefiller must be asked for, as vLLM's
// NixlConnector expects of a prefill: do_remote_decode set (it keeps the KV for a decoder),
// do_remote_prefill unset, and every remote_* field null.
var wantPrefillKV = map[string]any{
	"do_remote_decode": true, "do_remote_prefill": false,
	"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
}

func parseFields(t testing.TB, body string) *Fields {
	t.Helper()
	f, err := ParseFields([]byte(body))
	if err != nil {
		t.Fatalf("parse %s: %v", body, err)
	}
	return f
}

func decodeObject(t *testing.T, b []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil || m == nil {
		t.Fatalf("not a JSON object: %v: %s", err, b)
	}
	return m
}

func sameJSON(t *testing.T, a, b []byte) bool {
	t.Helper()
	var va, vb any
	if json.Unmarshal(a, &va) != nil || json.Unmarshal(b, &vb) != nil {
		return false
	}
	return reflect.DeepEqual(va, vb)
}

const (
	completionBody = `{"model":"m","prompt":"Hello","stream":true,"stream_options":{"include_usage":true},` +
		`"max_tokens":64,"min_tokens":4,"temperature":0.7,"vendor":{"z":[1,{"y":null}],"a":"<b>&"},` +
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil.example"}}`
	chatBody = `{"model":"m","messages":[{"role":"user","content":"Hi"}],"stream":true,` +
		`"stream_options":{"include_usage":false},"max_tokens":32,"max_completion_tokens":32,` +
		`"min_tokens":2,"min_completion_tokens":2,"n":2,"logprobs":true,"top_logprobs":3,"seed":11}`
)

func TestPrefillBody(t *testing.T) {
	for _, tc := range []struct {
		name string
		body string
		api  API
		set  map[string]string // fields the prefill sets, raw JSON
	}{
		{"completions: one token, no stream, the KV kept for a remote decode", completionBody, APICompletions,
			map[string]string{"stream": "false", "max_tokens": "1"}},
		{"chat: max_completion_tokens is 1 as well", chatBody, APIChat,
			map[string]string{"stream": "false", "max_tokens": "1", "max_completion_tokens": "1"}},
		{"a request without the fields still gets them", `{"model":"m","prompt":"p"}`, APICompletions,
			map[string]string{"stream": "false", "max_tokens": "1"}},
		{"responses: max_output_tokens is 1, and the prefiller stores nothing", `{"model":"m","input":"hi","instructions":"be brief","max_output_tokens":50,"stream":true,"store":true,"background":false,"priority":3}`, APIResponses,
			map[string]string{"stream": "false", "max_output_tokens": "1", "store": "false"}},
		{"messages: max_tokens alone, the system prompt and content blocks as they came", `{"model":"m","system":[{"type":"text","text":"be brief"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_tokens":50,"stream":true,"stop_sequences":["x"]}`, APIMessages,
			map[string]string{"stream": "false", "max_tokens": "1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := parseFields(t, tc.body)
			before := bytes.Clone(in.raw)
			out, err := PrefillBody(in, tc.api)
			if err != nil {
				t.Fatalf("PrefillBody: %v", err)
			}
			got := decodeObject(t, out)
			var kv map[string]any
			if err := json.Unmarshal(got["kv_transfer_params"], &kv); err != nil || !reflect.DeepEqual(kv, wantPrefillKV) {
				t.Errorf("kv_transfer_params = %s, want %v", got["kv_transfer_params"], wantPrefillKV)
			}
			for k, v := range tc.set {
				if string(got[k]) != v {
					t.Errorf("%s = %s, want %s", k, got[k], v)
				}
			}
			for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
				if _, ok := got[k]; ok {
					t.Errorf("%s is still there; it must be left out of a prefill", k)
				}
			}
			if _, ok := got["background"]; ok {
				t.Error("background is still there; a prefill runs in the foreground")
			}
			if _, ok := got["max_completion_tokens"]; ok && tc.api != APIChat {
				t.Error("max_completion_tokens is set; only a chat body has it")
			}
			for k, v := range in.All() {
				if _, set := tc.set[k]; set || k == "kv_transfer_params" || k == "stream_options" || k == "min_tokens" || k == "min_completion_tokens" || k == "background" {
					continue
				}
				if !sameJSON(t, got[k], v) {
					t.Errorf("%s = %s, want it unchanged: %s", k, got[k], v)
				}
			}
			if !bytes.Equal(in.raw, before) {
				t.Errorf("PrefillBody changed the client's body: %s", in.raw)
			}
			if bytes.Contains(out, []byte(`\u003c`)) {
				t.Errorf("the body is HTML-escaped: %s", out)
			}
		})
	}
}

func TestDecodeBody(t *testing.T) {
	for _, tc := range []struct {
		name   string
		body   string
		params string // "" means none
	}{
		{"the client's request plus the prefiller's params, byte for byte", completionBody, kvParams},
		{"without params the decoder recomputes: no kv_transfer_params at all", completionBody, ""},
		{"chat fields are all kept", chatBody, kvParams},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := parseFields(t, tc.body)
			before := bytes.Clone(in.raw)
			var params json.RawMessage
			if tc.params != "" {
				params = json.RawMessage(tc.params)
			}
			out, err := DecodeBody(in, params)
			if err != nil {
				t.Fatalf("DecodeBody: %v", err)
			}
			got := decodeObject(t, out)
			kv, has := got["kv_transfer_params"]
			switch {
			case tc.params == "" && has:
				t.Errorf("kv_transfer_params = %s, want none (the client's own never pass)", kv)
			case tc.params != "" && string(kv) != tc.params:
				t.Errorf("kv_transfer_params changed:\n got %s\nwant %s", kv, tc.params)
			}
			for k, v := range in.All() {
				if k == "kv_transfer_params" {
					continue
				}
				if !sameJSON(t, got[k], v) {
					t.Errorf("%s = %s, want the client's %s", k, got[k], v)
				}
			}
			for k := range got {
				if _, ok := in.Field(k); !ok && k != "kv_transfer_params" {
					t.Errorf("%s was added", k)
				}
			}
			if !bytes.Equal(in.raw, before) {
				t.Errorf("DecodeBody changed the client's body")
			}
		})
	}
}

func TestDrainBody(t *testing.T) {
	for _, tc := range []struct {
		name string
		body string
		api  API
	}{
		{"completions: one non-streaming token that pulls the held KV", completionBody, APICompletions},
		{"chat: one token, and nothing that multiplies the work", chatBody, APIChat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := parseFields(t, tc.body)
			out, err := DrainBody(in, tc.api, json.RawMessage(kvParams))
			if err != nil {
				t.Fatalf("DrainBody: %v", err)
			}
			got := decodeObject(t, out)
			if string(got["kv_transfer_params"]) != kvParams {
				t.Errorf("kv_transfer_params = %s, want the held params unchanged", got["kv_transfer_params"])
			}
			want := map[string]string{"stream": "false", "max_tokens": "1", "model": `"m"`}
			if tc.api == APIChat {
				want["max_completion_tokens"] = "1"
			}
			for k, v := range want {
				if string(got[k]) != v {
					t.Errorf("%s = %s, want %s", k, got[k], v)
				}
			}
			for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens", "n", "best_of", "logprobs", "top_logprobs"} {
				if _, ok := got[k]; ok {
					t.Errorf("%s is still there; a drain must not carry it", k)
				}
			}
			if tc.api == APIChat && string(got["seed"]) != "11" {
				t.Errorf("seed = %s, want the client's 11", got["seed"])
			}
		})
	}
}

func TestParsePrefillResponse(t *testing.T) {
	for _, tc := range []struct {
		name    string
		body    string
		want    string // "" means nil
		wantErr error  // nil: no error; errAny: some error that is not ErrBadKVParams
	}{
		{name: "an object is returned byte for byte",
			body: `{"id":"cmpl-p","choices":[{"text":"H"}],"kv_transfer_params":` + kvParams + `}`, want: kvParams},
		{name: "spaces around the object are trimmed",
			body: "{\"kv_transfer_params\" :  \n" + `{"a":1}` + "  \n}", want: `{"a":1}`},
		{name: "null means the prefiller holds nothing", body: `{"id":"x","kv_transfer_params":null}`},
		{name: "absent means the prefiller holds nothing", body: `{"id":"x","choices":[]}`},
		{name: "a string is refused", body: `{"kv_transfer_params":"10.0.0.7:5600"}`, wantErr: ErrBadKVParams},
		{name: "an array is refused", body: `{"kv_transfer_params":[1]}`, wantErr: ErrBadKVParams},
		{name: "a number is refused", body: `{"kv_transfer_params":5600}`, wantErr: ErrBadKVParams},
		{name: "true is refused", body: `{"kv_transfer_params":true}`, wantErr: ErrBadKVParams},
		{name: "a body that is not JSON is an error", body: `<html>502 Bad Gateway</html>`, wantErr: errAny},
		{name: "a truncated body is an error", body: `{"kv_transfer_params":{"a":`, wantErr: errAny},
		{name: "an empty body is an error", body: ``, wantErr: errAny},
		{name: "an array body is an error", body: `[{"kv_transfer_params":{}}]`, wantErr: errAny},
		{name: "another case is another field (vLLM reads JSON case-sensitively)",
			body: `{"KV_Transfer_Params":` + kvParams + `}`},
		{name: "the exact field wins over one in another case",
			body: `{"KV_Transfer_Params":{"a":1},"kv_transfer_params":{"b":2}}`, want: `{"b":2}`},
		{name: "empty remote_block_ids mean nothing is held", body: `{"kv_transfer_params":{"remote_block_ids":[],"remote_engine_id":"e"}}`},
		{name: "one empty list per KV cache group means nothing is held", body: `{"kv_transfer_params":{"remote_block_ids":[[],[]]}}`},
		{name: "one group with blocks is a hold", body: `{"kv_transfer_params":{"remote_block_ids":[[],[4]]}}`, want: `{"remote_block_ids":[[],[4]]}`},
		{name: "empty groups spaced out mean nothing is held", body: "{\"kv_transfer_params\":{\"remote_block_ids\":[ [ ] ,\n\t[] ]}}"},
		{name: "a block id written as a string is a hold", body: `{"kv_transfer_params":{"remote_block_ids":[["a"]]}}`, want: `{"remote_block_ids":[["a"]]}`},
		{name: "remote_block_ids that are no list are taken as they are", body: `{"kv_transfer_params":{"remote_block_ids":0}}`, want: `{"remote_block_ids":0}`},
		{name: "2026 fields pass through unchanged",
			body: `{"kv_transfer_params":{"remote_block_ids":[[1,2]],"remote_num_tokens":20,"remote_blocks_expiry_time":null,"transfer_mode":"read","dcp_size":1,"pp_size":1}}`,
			want: `{"remote_block_ids":[[1,2]],"remote_num_tokens":20,"remote_blocks_expiry_time":null,"transfer_mode":"read","dcp_size":1,"pp_size":1}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParsePrefillResponse([]byte(tc.body))
			switch {
			case tc.wantErr == nil && err != nil:
				t.Fatalf("error %v, want none", err)
			case tc.wantErr == errAny && (err == nil || errors.Is(err, ErrBadKVParams)):
				t.Fatalf("error %v, want a parse error", err)
			case tc.wantErr == ErrBadKVParams && !errors.Is(err, ErrBadKVParams):
				t.Fatalf("error %v, want ErrBadKVParams", err)
			}
			if err != nil {
				if got != nil {
					t.Errorf("params %s returned with an error", got)
				}
				return
			}
			if tc.want == "" && got != nil {
				t.Errorf("params %s, want nil", got)
			}
			if tc.want != "" && string(got) != tc.want {
				t.Errorf("params %s, want %s", got, tc.want)
			}
		})
	}
}

var errAny = errors.New("any error but ErrBadKVParams")

// FuzzParsePrefillResponse: whatever a prefiller answers, parsing never panics, and params it
// returns are a JSON object that a decode body can carry.
func FuzzParsePrefillResponse(f *testing.F) {
	for _, seed := range []string{
		`{"kv_transfer_params":` + kvParams + `}`,
		`{"kv_transfer_params":null}`, `{"kv_transfer_params":"x"}`, `{"kv_transfer_params":[]}`,
		`{"kv_transfer_params":{}}`, `{"kv_transfer_params": {"a" : [1, 2]} }`, `{}`, `null`, `[]`, ``,
		`{"kv_transfer_params":{"a":`, `<html>`, "{\"kv_transfer_params\":\"\xff\"}",
		`{"kv_transfer_params":{"a":1},"kv_transfer_params":null}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		params, err := ParsePrefillResponse(body)
		if err != nil {
			if params != nil {
				t.Fatalf("params %q with error %v", params, err)
			}
			return
		}
		if params == nil {
			return
		}
		var obj map[string]json.RawMessage
		if json.Unmarshal(params, &obj) != nil || obj == nil {
			t.Fatalf("params %q from %q are not a JSON object", params, body)
		}
		out, err := DecodeBody(parseFields(t, `{"model":"m"}`), params)
		if err != nil {
			t.Fatalf("DecodeBody with params %q: %v", params, err)
		}
		if got := decodeObject(t, out)["kv_transfer_params"]; !sameJSON(t, got, params) {
			t.Fatalf("params %q came out of DecodeBody as %q", params, got)
		}
	})
}

// benchFields is a typical chat request: a system prompt of a few KiB and a short turn.
func benchFields(b *testing.B) *Fields {
	b.Helper()
	sys, _ := json.Marshal(string(bytes.Repeat([]byte("You are a careful assistant. "), 128)))
	return parseFields(b, `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":`+string(sys)+
		`},{"role":"user","content":"Summarise the text."}],"stream":true,"stream_options":{"include_usage":true},`+
		`"max_tokens":512,"min_tokens":8,"temperature":0.2,"top_p":0.95,"seed":7}`)
}

func BenchmarkPrefillBody(b *testing.B) {
	f := benchFields(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := PrefillBody(f, APIChat); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecodeBody(b *testing.B) {
	f := benchFields(b)
	params := json.RawMessage(kvParams)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeBody(f, params); err != nil {
			b.Fatal(err)
		}
	}
}
