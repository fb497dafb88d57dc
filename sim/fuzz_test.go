package sim

import (
	"encoding/json"
	"testing"
)

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
		req, err := parseRequest(tokenizer{}, body, chat)
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

func FuzzParseSGLang(f *testing.F) {
	seeds := []string{
		`{"prompt":"x","rid":"r","bootstrap_room":7,"bootstrap_host":"127.0.0.1","bootstrap_port":8998}`,
		`{"prompt":["a","b"],"rid":["r-0000","r-0001"],"bootstrap_room":[1,2],"bootstrap_host":["h","h"],"bootstrap_port":[1,2]}`,
		`{"prompt":["a","b"],"bootstrap_room":1}`,
		`{"prompt":"x","bootstrap_room":9223372036854775807}`,
		`{"prompt":"x","bootstrap_room":9223372036854775808}`,
		`{"prompt":"x","bootstrap_room":-1}`,
		`{"prompt":"x","bootstrap_room":[1,1]}`,
		`{"prompt":"x","rid":""}`,
		`{"prompt":"x","rid":null,"bootstrap_room":null}`,
		`{"prompt":"x","bootstrap_room":1,"bootstrap_port":70000,"bootstrap_host":"h"}`,
		`{"prompt":"x","bootstrap_room":"1"}`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), "prefill")
		f.Add([]byte(s), "decode")
	}
	f.Fuzz(func(t *testing.T, body []byte, role string) {
		b, err := decodeBody(tokenizer{}, body, false)
		if err != nil {
			return
		}
		sg, err := parseSGLang(&b.wireRequest, len(b.prompts), role)
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T %v is not an *apiError", err, err)
			}
			return
		}
		n := len(b.prompts)
		if (sg.rids != nil && len(sg.rids) != n) || (sg.rooms != nil && len(sg.rooms) != n) {
			t.Fatalf("fields %+v for %d prompts from %q", sg, n, body)
		}
		for i, r := range sg.rooms {
			if r >= 1<<63 {
				t.Fatalf("room %d accepted from %q", r, body)
			}
			if l := sg.leg(i); role == "decode" && (l.host == "" || l.port <= 0 || l.port > 65535) {
				t.Fatalf("decode leg %+v without a bootstrap server from %q", l, body)
			}
		}
	})
}

func FuzzMooncakeParams(f *testing.F) {
	for _, s := range []string{
		`{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"xfer-1"}`,
		`{"do_remote_prefill":true,"do_remote_decode":false,"remote_bootstrap_addr":"http://10.0.0.1:8998","remote_engine_id":"e","remote_dp_rank":1,"transfer_id":"xfer-1"}`,
		`{"do_remote_prefill":true,"bootstrap_server_host":"h","bootstrap_server_port":8998}`,
		`{"do_remote_prefill":true,"remote_bootstrap_addr":"http://[::1]:0","transfer_id":"x"}`,
		`{"do_remote_prefill":true,"remote_bootstrap_addr":"p:1","transfer_id":"x"}`,
		`null`, `{}`, `{"do_remote_prefill":true,"do_remote_decode":true,"transfer_id":"x"}`,
	} {
		f.Add([]byte(s), "decode")
		f.Add([]byte(s), "prefill")
	}
	f.Fuzz(func(t *testing.T, raw []byte, role string) {
		var kv *kvTransferParams
		if json.Unmarshal(raw, &kv) != nil {
			return
		}
		e := &Engine{cfg: Config{Protocol: ProtocolMooncake, Role: role}}
		a := &apiRequest{prompts: []int{3}, samples: 1, n: 1, maxTokens: 5}
		err := e.mooncakeRequest(kv, a)
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T %v is not an *apiError", err, err)
			}
			return
		}
		switch a.kind {
		case kindPrefill:
			if role != "prefill" || a.xferID == "" || a.maxTokens != 1 {
				t.Fatalf("accepted prefill %+v on a %s engine from %s", a, role, raw)
			}
		case kindDecode:
			if role != "decode" || a.mc == nil || a.mc.host == "" || a.mc.port <= 0 || a.mc.port > 65535 || a.mc.transferID == "" {
				t.Fatalf("accepted decode %+v on a %s engine from %s", a.mc, role, raw)
			}
		}
	})
}

func FuzzParseResponses(f *testing.F) {
	for _, s := range []string{
		`{"model":"sim","input":"hello","max_output_tokens":4}`,
		`{"input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]}],"instructions":"be brief","stream":true}`,
		`{"input":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}],"previous_response_id":"resp_x"}`,
		`{"input":"x","max_output_tokens":1,"stream":false,` + prefillKV + `}`,
		`{"input":"x","background":true,"store":true,"priority":-3}`,
		`{"input":[{"type":"function_call"}]}`, `{"input":[]}`, `{"input":5}`, `{}`, `null`, ``, `{"input":"a"} trailing`,
	} {
		f.Add([]byte(s))
	}
	store := newResponseStore(2)
	store.put("resp_x", storedResponse{obj: &responseObject{}, history: []wireMessage{textMessage("user", "earlier")}})
	f.Fuzz(func(t *testing.T, body []byte) {
		b, err := decodeResponses(body)
		if err == nil {
			err = b.render(tokenizer{}, store)
		}
		var req *apiRequest
		if err == nil {
			req, err = b.validate(false)
		}
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T %v is not an *apiError", err, err)
			}
			return
		}
		if req.resp == nil || req.promptTokens < 1 || req.maxTokens < 1 || len(req.prompts) != 1 || req.samples != 1 {
			t.Fatalf("accepted %+v from %q", req, body)
		}
	})
}

func FuzzPoolingBodies(f *testing.F) {
	parsers := []poolParser{parseEmbeddings, parsePooling, parseScore, parseRerank, parseDetokenize}
	for _, s := range []string{
		`{"input":"hello"}`, `{"input":["a","b"],"encoding_format":"base64","dimensions":4}`, `{"input":[[1,2],[3]]}`,
		`{"text_1":"a","text_2":["b","c"]}`, `{"text_1":["a","b"],"text_2":["c"]}`,
		`{"query":"q","documents":["a",{"text":"b"}],"top_n":1}`, `{"tokens":[1,2,3,70000]}`,
		`{}`, `null`, ``, `{"input":"a"} trailing`,
	} {
		for i := range parsers {
			f.Add([]byte(s), uint8(i))
		}
	}
	e, err := New(fastConfig(), nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body []byte, which uint8) {
		job, err := parsers[int(which)%len(parsers)](e, nil, body)
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T %v is not an *apiError", err, err)
			}
			return
		}
		if job.tokens < 0 {
			t.Fatalf("negative cost from %q", body)
		}
		if _, err := json.Marshal(job.answer("id", "sim")); err != nil {
			t.Fatalf("answer of %q does not encode: %v", body, err)
		}
	})
}

func FuzzDecodeMessages(f *testing.F) {
	seeds := []string{
		`{"model":"sim","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"sim","max_tokens":4,"system":[{"type":"text","text":"x-anthropic-billing-header: 1"},{"type":"text","text":"s"}],"messages":[{"role":"ctx","content":"hi"}]}`,
		`{"model":"sim","max_tokens":4,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"n","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r"}]}]}]}`,
		`{"model":"sim","max_tokens":4,"messages":[{"role":"system","content":[{"type":"text","text":"s"}]}],"tool_choice":{"type":"tool","name":"n"},"tools":[{"name":"n","input_schema":{}}]}`,
		`{"model":"sim","max_tokens":4,"messages":[{"role":"user","content":"x"}],` + prefillKV + `}`,
		`{"model":"sim","max_tokens":4,"messages":[{"role":"user","content":[]}],"stop_sequences":["a"],"temperature":0,"seed":3,"ignore_eos":true}`,
		`{"model":"sim","max_tokens":0,"messages":[]}`, `{"model":"sim","messages":[{"role":"user","content":[{"type":"image"}]}]}`,
		`{"model":"","max_tokens":1}`, `{"model":"sim","max_tokens":1,"messages":[{"role":"user","content":[{"type":"tool_result","content":7}]}]}`,
		`{}`, `[]`, `null`, ``, `{"messages":`, `{"model":"sim"} trailing`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, count bool) {
		w, tokens, err := decodeMessages(tokenizer{}, body, count)
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T %v is not an *apiError", err, err)
			}
			return
		}
		if len(tokens) < 1 || w.Model == nil || *w.Model == "" || !count && (w.MaxTokens == nil || *w.MaxTokens < 1) {
			t.Fatalf("accepted %q: %d tokens, %+v", body, len(tokens), w)
		}
		if count {
			return
		}
		wb, err := decodeMessagesBody(tokenizer{}, body)
		if err != nil {
			t.Fatalf("decodeMessages took %q, decodeMessagesBody refused it: %v", body, err)
		}
		req, err := wb.validate(false)
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T %v is not an *apiError", err, err)
			}
			return
		}
		if !req.anthropic || req.n != 1 || req.samples != 1 || len(req.prompts) != 1 || req.promptTokens != len(tokens) || req.maxTokens != *w.MaxTokens {
			t.Fatalf("request %+v from %q", req, body)
		}
	})
}
