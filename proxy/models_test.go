package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

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
	h := newHarness(t, Config{ModelAliases: map[string]Alias{"chat": {{Model: served}}}}, routerconfig.Config{Backends: []routerconfig.BackendConfig{pb, db}})
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
