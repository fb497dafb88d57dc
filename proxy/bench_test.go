package proxy

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
)

// Bodies as clients send them: a completion, and a chat with a system prompt and a few turns.
var (
	benchCompletion = []byte(`{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"The quick brown fox jumps over the lazy dog. ` +
		strings.Repeat("Tell me more about it. ", 8) + `","max_tokens":128,"temperature":0.7,"top_p":0.95,"stream":true,` +
		`"stream_options":{"include_usage":true},"seed":7}`)
	benchChat = []byte(`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[` +
		`{"role":"system","content":"You are a helpful assistant. ` + strings.Repeat("Answer briefly and precisely. ", 10) + `"},` +
		`{"role":"user","content":"What is disaggregated prefill?"},` +
		`{"role":"assistant","content":"Prefill and decode run on different engines; the KV cache moves between them."},` +
		`{"role":"user","content":"Why does it help? \u00e9\u00e8 <b>bold</b> & more"}],` +
		`"max_completion_tokens":256,"temperature":0.2,"stream":true,"stream_options":{"include_usage":true},"tools":null}`)
	// benchKVParams is a prefiller's answer params, passed on to the decoder as they came.
	benchKVParams = json.RawMessage(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4,5,6,7,8],` +
		`"remote_engine_id":"a7c2e0f4-prefill-0","remote_request_id":"cmpl-0123456789abcdef","remote_host":"10.0.0.7","remote_port":5600,"tp_size":1}`)
)

// BenchmarkRewrite is the request work of one P/D request before any byte goes out: parse and
// validate the client's body, build the prefill body, build the decode body with the params.
func BenchmarkRewrite(b *testing.B) {
	for _, bc := range []struct {
		name string
		body []byte
		chat bool
	}{
		{"completion", benchCompletion, false},
		{"chat", benchChat, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(bc.body)))
			for b.Loop() {
				parse := api.ParseCompletions
				if bc.chat {
					parse = api.ParseChat
				}
				req, e := parse(bc.body)
				if e != nil {
					b.Fatal(e)
				}
				if _, err := engine.PrefillBody(req.Fields, req.API); err != nil {
					b.Fatal(err)
				}
				if _, err := engine.DecodeBody(req.Fields, benchKVParams); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
