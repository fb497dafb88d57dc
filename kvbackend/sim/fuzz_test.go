package sim

import "testing"

func FuzzParseRequest(f *testing.F) {
	seeds := []string{
		`{"model":"sim","prompt":"hello","max_tokens":4}`,
		`{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"prompt":["one"],"min_tokens":1,"max_tokens":2,"ignore_eos":true}`,
		`{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null}],"max_completion_tokens":3}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`,
		`{"prompt":"x",` + prefillKV + `}`,
		`{"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_host":"127.0.0.1","remote_port":8100,"remote_engine_id":"e","remote_request_id":"r","tp_size":1}}`,
		`{"prompt":"x","kv_transfer_params":null}`,
		`{"prompt":"x","max_tokens":-1}`,
		`{"prompt":["a","b"],"n":2,"best_of":3,` + prefillKV + `}`,
		`{"prompt":[[1,2],[3]],` + prefillKV + `}`,
		`{"prompt":["a","b"],"n":2,"best_of":3,"kv_transfer_params":null}`,
		`{"prompt":["a","b"],"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"h","remote_port":1}}`,
		`{"prompt":"x","prompt_logprobs":1,"echo":true,"logprobs":false,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"h","remote_port":1,"remote_block_ids":[]}}`,
		`{}`, `[]`, `null`, ``, `{"prompt":`, `{"prompt":"a"} trailing`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		req, err := parseRequest(body, chat)
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T %v is not an *apiError", err, err)
			}
			return
		}
		if req.promptTokens < 1 || req.maxTokens < 1 || req.maxTokens > maxTokensLimit || req.minTokens < 0 || req.minTokens > req.maxTokens {
			t.Fatalf("accepted out-of-range request %+v from %q", req, body)
		}
		if req.kind == kindDecode && (len(req.prompts) != 1 || req.samples != 1) {
			t.Fatalf("fan-out of a decode with kv_transfer_params: %+v from %q", req, body)
		}
		if req.samples < req.n || req.n < 1 || req.samples > maxChoices || len(req.prompts) > maxChoices || req.prompts[0] != req.promptTokens {
			t.Fatalf("accepted out-of-range fan-out %+v from %q", req, body)
		}
		if req.crashesDecoder && req.kind != kindDecode {
			t.Fatalf("only a decode crashes its engine: %+v from %q", req, body)
		}
		// No remote_block_ids is a usable decode: nothing to read (vLLM 2026).
		if req.kind == kindDecode && (req.kv == nil || req.kv.RemoteHost == "" || req.kv.RemotePort <= 0) {
			t.Fatalf("decode without a usable prefiller address: %+v", req.kv)
		}
	})
}
