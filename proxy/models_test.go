package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/pdproxy/pdproxy/router"
)

// The client's model name comes back into an answer whatever the reads it arrives in: every
// split of the engine's bytes gives the same renamed answer, and text that only looks like
// the member (inside a string) is left alone.
func TestRenamerPutsTheAliasBackAcrossEverySplit(t *testing.T) {
	for _, tc := range []struct{ name, served, in, want string }{
		{"a JSON answer", "",
			`{"id":"c","model":"llama-3-70b","choices":[{"text":"hi"}]}`,
			`{"id":"c","model":"chat","choices":[{"text":"hi"}]}`},
		{"every event of a stream", "",
			"data: {\"model\":\"llama-3-70b\",\"x\":1}\n\ndata: {\"model\":\"llama-3-70b\",\"x\":2}\n\ndata: [DONE]\n\n",
			"data: {\"model\":\"chat\",\"x\":1}\n\ndata: {\"model\":\"chat\",\"x\":2}\n\ndata: [DONE]\n\n"},
		{"a Responses event, nested", "",
			"event: response.completed\ndata: {\"response\":{\"model\":\"llama-3-70b\"}}\n\n",
			"event: response.completed\ndata: {\"response\":{\"model\":\"chat\"}}\n\n"},
		{"generated text that quotes the member", "",
			`{"model":"llama-3-70b","text":"say \"model\":\"llama-3-70b\" please"}`,
			`{"model":"chat","text":"say \"model\":\"llama-3-70b\" please"}`},
		{"another model, and a prefix of the pattern at the end", "",
			`{"model":"llama-3-8b"} "model":"llama`,
			`{"model":"llama-3-8b"} "model":"llama`},
		// vLLM (Python's json, pydantic) writes these characters raw; Go's encoding/json
		// escapes them. Either spelling is the served model's.
		{"a served name with &, <, >, U+2028 and U+2029, written raw", "a&b<c>\u2028\u2029",
			"data: {\"model\":\"a&b<c>\u2028\u2029\",\"x\":1}\n\ndata: {\"model\":\"a&b<c>\u2028\u2029\"}\n\n",
			"data: {\"model\":\"chat\",\"x\":1}\n\ndata: {\"model\":\"chat\"}\n\n"},
		{"a served name with &, <, >, U+2028 and U+2029, written escaped", "a&b<c>\u2028\u2029",
			`{"model":"a\u0026b\u003cc\u003e\u2028\u2029","text":"\u0026"}`,
			`{"model":"chat","text":"\u0026"}`},
		{"both spellings in one answer, and another model with the same characters", "a&b<c>",
			`{"model":"a&b<c>"} {"model":"a\u0026b\u003cc\u003e"} {"model":"a&b<d>"}`,
			`{"model":"chat"} {"model":"chat"} {"model":"a&b<d>"}`},
		{"an escaped backslash before what looks like an escape", `x\u0026`,
			`{"model":"x\\u0026"} {"model":"x&"}`,
			`{"model":"chat"} {"model":"x&"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for cut := 0; cut <= len(tc.in); cut++ {
				for cut2 := cut; cut2 <= len(tc.in); cut2 += 3 {
					served := tc.served
					if served == "" {
						served = "llama-3-70b"
					}
					r := newRenamer(served, "chat")
					var out strings.Builder
					for _, part := range []string{tc.in[:cut], tc.in[cut:cut2], tc.in[cut2:]} {
						out.Write(r.rewrite([]byte(part)))
					}
					out.Write(r.flush())
					if out.String() != tc.want {
						t.Fatalf("reads split at %d and %d: %q, want %q", cut, cut2, out.String(), tc.want)
					}
				}
			}
		})
	}
}

// An alias for a served name with characters Go's JSON escapes (&, <, >) comes back in the
// answer of a decoder that writes the name raw, as vLLM does, streamed or not, through P/D.
func TestAliasOfANameWithHTMLCharactersIsRenamedBack(t *testing.T) {
	const served = "a&b<c>"
	var asked []string
	var mu sync.Mutex
	d := newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		var req struct {
			Model  string `json:"model"`
			Stream bool   `json:"stream"`
		}
		json.Unmarshal(body, &req)
		mu.Lock()
		asked = append(asked, req.Model)
		mu.Unlock()
		if !req.Stream {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"id":"chatcmpl-d","object":"chat.completion","model":"`+req.Model+`","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}]}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"id":"chatcmpl-d","object":"chat.completion.chunk","model":"`+req.Model+`","choices":[{"index":0,"delta":{"content":"Hello"}}]}`+"\n\n")
		io.WriteString(w, "data: [DONE]\n\n")
	})
	p := newEngine(t, vllmPrefill(prefillerParams))
	pb, db := prefiller("p0", p.URL()), decoder("d0", d.URL())
	pb.Models, db.Models = []string{served}, []string{served}
	h := newHarness(t, Config{ModelAliases: map[string]Alias{"chat": {{Model: served}}}}, router.Config{Backends: []router.BackendConfig{pb, db}})
	for _, stream := range []bool{false, true} {
		resp, got := h.post("/v1/chat/completions", fmt.Sprintf(`{"model":"chat","messages":[{"role":"user","content":"hi"}],"stream":%v}`, stream))
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("stream %v: status %d: %s", stream, resp.StatusCode, got)
		}
		if !strings.Contains(string(got), `"model":"chat"`) || strings.Contains(string(got), served) {
			t.Errorf("stream %v: answer %s, want the alias in place of %s", stream, got, served)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) != 2 || asked[0] != served || asked[1] != served {
		t.Errorf("the decoder was asked for %q, want %s twice", asked, served)
	}
	h.waitQuiet()
}
