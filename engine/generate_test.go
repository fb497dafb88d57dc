package engine

import (
	"bytes"
	"encoding/json"
	"testing"
)

// generateBody is a client's body for vLLM's token-in route, POST /inference/v1/generate: the
// prompt as token ids, the output bounded inside sampling_params, and members the proxy does
// not know.
const generateBody = `{"model":"m","token_ids":[1,2,3,4],"stream":true,"stream_options":{"include_usage":true},` +
	`"sampling_params":{"max_tokens":64,"min_tokens":4,"temperature":0.70,"n":1,"logprobs":2,"seed":9},` +
	`"cache_salt":"tenant-a","priority":0,"vendor":{"z":[1,{"y":null}],"a":"<b>&"},` +
	`"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil.example"}}`

// A generate request's prefill and drain are bounded to one token inside its sampling_params,
// as vLLM's GenerateRequest reads it, and keep every other member as the client sent it.
func TestAGenerateRequestIsBoundedToOneTokenInsideItsSamplingParams(t *testing.T) {
	for _, tc := range []struct {
		name    string
		body    string
		drain   bool
		kv      string   // the kv_transfer_params the rewrite carries
		sp      string   // the sampling_params it carries, as JSON
		dropped []string // top-level members left out
	}{
		{"a prefill: max_tokens 1 and no min_tokens in sampling_params, not streamed, the KV kept for a remote decode",
			generateBody, false, "", `{"temperature":0.70,"n":1,"logprobs":2,"seed":9,"max_tokens":1}`, []string{"stream_options"}},
		{"a drain: one token that pulls the held KV, and nothing that multiplies the work",
			generateBody, true, kvParams, `{"temperature":0.70,"seed":9,"max_tokens":1}`, []string{"stream_options"}},
		{"a body without sampling_params gets one that bounds it",
			`{"model":"m","token_ids":[5]}`, false, "", `{"max_tokens":1}`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := parseFields(t, tc.body)
			before := bytes.Clone(in.raw)
			var out []byte
			var err error
			if tc.drain {
				out, err = DrainBody(in, APIGenerate, json.RawMessage(tc.kv))
			} else {
				out, err = PrefillBody(in, APIGenerate)
			}
			if err != nil {
				t.Fatal(err)
			}
			got := decodeObject(t, out)
			if string(got["sampling_params"]) != tc.sp {
				t.Errorf("sampling_params = %s, want %s", got["sampling_params"], tc.sp)
			}
			if string(got["stream"]) != "false" {
				t.Errorf("stream = %s, want false", got["stream"])
			}
			if tc.drain {
				if string(got["kv_transfer_params"]) != tc.kv {
					t.Errorf("kv_transfer_params = %s, want the held params unchanged", got["kv_transfer_params"])
				}
			} else {
				var kv map[string]any
				if json.Unmarshal(got["kv_transfer_params"], &kv) != nil || len(kv) != len(wantPrefillKV) || kv["do_remote_decode"] != true {
					t.Errorf("kv_transfer_params = %s, want %v", got["kv_transfer_params"], wantPrefillKV)
				}
			}
			for _, k := range tc.dropped {
				if _, ok := got[k]; ok {
					t.Errorf("%s is still there", k)
				}
			}
			if _, ok := got["max_tokens"]; ok {
				t.Error("max_tokens set at the top, where vLLM's GenerateRequest has no such member")
			}
			for k, v := range in.All() {
				switch k {
				case "sampling_params", "stream", "stream_options", "kv_transfer_params":
					continue
				}
				if string(got[k]) != string(v) {
					t.Errorf("%s = %s, want the client's %s byte for byte", k, got[k], v)
				}
			}
			if !bytes.Equal(in.raw, before) {
				t.Errorf("the client's body changed: %s", in.raw)
			}
		})
	}
}

// A generate request's decode is the client's body with the prefiller's params, its
// sampling_params and stream untouched.
func TestAGenerateRequestsDecodeKeepsItsSamplingParams(t *testing.T) {
	in := parseFields(t, generateBody)
	out, err := DecodeBody(in, json.RawMessage(kvParams))
	if err != nil {
		t.Fatal(err)
	}
	got := decodeObject(t, out)
	if string(got["kv_transfer_params"]) != kvParams {
		t.Errorf("kv_transfer_params = %s, want the prefiller's", got["kv_transfer_params"])
	}
	want := decodeObject(t, []byte(generateBody))
	for _, k := range []string{"sampling_params", "stream", "stream_options", "token_ids"} {
		if string(got[k]) != string(want[k]) {
			t.Errorf("%s = %s, want %s", k, got[k], want[k])
		}
	}
}

// A sampling_params that is not an object is an error, not a body the engine would refuse
// after the prefiller held KV for it.
func TestAGenerateRequestWhoseSamplingParamsIsNoObjectIsNotRewritten(t *testing.T) {
	if out, err := PrefillBody(parseFields(t, `{"token_ids":[1],"sampling_params":[1]}`), APIGenerate); err == nil {
		t.Fatalf("PrefillBody = %s, want an error", out)
	}
}
