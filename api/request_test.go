package api

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/pdproxy/pdproxy/engine"
)

// FuzzParseRequest feeds parseRequest arbitrary bodies. It must never panic; a body it accepts
// has a model and turns into prefill and decode bodies that are JSON objects; a body it refuses
// gets a 400 with a message.
func FuzzParseRequest(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","prompt":"hi"}`,
		`{"model":"m","prompt":["a","b"],"stream":true,"stream_options":{"include_usage":true},"max_tokens":5}`,
		`{"model":"m","prompt":[1,2,3]}`,
		`{"model":"m","prompt":[[1,2],[3]]}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3,"min_tokens":1}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`,
		`{"model":"m","messages":[null]}`,
		`{"model":"m","prompt":"hi","kv_transfer_params":{"do_remote_prefill":true}}`,
		`{"model":"m","prompt":"hi","max_tokens":"5"}`,
		`{"model":"m","prompt":"hi","max_tokens":1e400}`,
		`{"model":"m","prompt":"hi","n":-1}`,
		`{"model":"","prompt":"hi"}`,
		`{"model":null,"prompt":"hi"}`,
		`{"model":"m","model":7}`,
		`{"model":"m","prompt":"hi"`,
		`{"model":"m" "prompt":"hi"}`,
		"{\"model\":\"m\",\"prompt\":\"\xff\"}",
		`[]`, `null`, `"s"`, `0`, ``, ` `, `{}`, `{"stream_options":null}`,
	} {
		f.Add([]byte(seed), false)
		f.Add([]byte(seed), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		req, e := parseRequest(body, chat)
		if e != nil {
			if req != nil {
				t.Fatalf("parseRequest returned both a request and an error")
			}
			if e.Status != http.StatusBadRequest || e.Message == "" || e.wire().typ != "invalid_request_error" {
				t.Fatalf("refusal %+v, want a 400 invalid_request_error with a message", e)
			}
			return
		}
		if req.Model == "" {
			t.Fatalf("accepted %q with an empty model", body)
		}
		if (req.API == engine.APIChat) != chat {
			t.Fatalf("api %d, want chat %v", req.API, chat)
		}
		pre, err := engine.PrefillBody(req.Fields, req.API)
		if err != nil {
			t.Fatalf("PrefillBody of accepted %q: %v", body, err)
		}
		dec, err := engine.DecodeBody(req.Fields, json.RawMessage(`{"remote_host":"h"}`))
		if err != nil {
			t.Fatalf("DecodeBody of accepted %q: %v", body, err)
		}
		for _, b := range [][]byte{pre, dec} {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(b, &m); err != nil || m == nil {
				t.Fatalf("backend body %q of accepted %q is not a JSON object: %v", b, body, err)
			}
		}
	})
}

func TestParseRequestKeepsWhatRoutingNeeds(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		chat       bool
		model      string
		stream     bool
		prefix     string
	}{
		{name: "a string prompt is the routing prefix", body: `{"model":"m","prompt":"You are a pirate."}`,
			model: "m", prefix: "You are a pirate."},
		{name: "the first string of a prompt array is the routing prefix", body: `{"model":"m","prompt":["sys","user"],"stream":true}`,
			model: "m", stream: true, prefix: "sys"},
		{name: "a chat's first message is the routing prefix", chat: true,
			body:  `{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"stream":true,"stream_options":{"include_usage":true}}`,
			model: "m", stream: true, prefix: "Be brief."},
		{name: "null optional fields count as absent", body: `{"model":"m","prompt":"p","stream":null,"max_tokens":null,"stream_options":null}`,
			model: "m", prefix: "p"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, e := parseRequest([]byte(tc.body), tc.chat)
			if e != nil {
				t.Fatalf("refused: %v", e)
			}
			if req.Model != tc.model || req.Stream != tc.stream || req.Prefix != tc.prefix {
				t.Errorf("got model %q stream %v prefix %q, want %q %v %q",
					req.Model, req.Stream, req.Prefix, tc.model, tc.stream, tc.prefix)
			}
		})
	}
}
