package proxy

import (
	"bufio"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// greedy is a fake vLLM engine that decodes greedily: each token's id is a function of every id
// before it (the prompt's, then those generated), so a continuation from any point generates
// what an unbroken run would. It serves return_token_ids as vLLM does (a choice's token_ids;
// the prompt's ids on the completion choice, or at the top of a chat chunk, in the first chunk
// only). A request whose prompt is text dies after dieAfter tokens (0: never): its connection
// closes mid-stream, as a crashed engine's does. A prompt of ids (a continuation) never dies.
type greedy struct {
	dieAfter int
	// delay is the time between two tokens; draining, when set and true, makes the engine's
	// health check answer 503, as an engine shutting down does, while it goes on streaming.
	delay    time.Duration
	draining *atomic.Bool
}

func greedyNext(ids []uint32) uint32 {
	h := fnv.New64a()
	for _, id := range ids {
		fmt.Fprintf(h, "%d,", id)
	}
	return uint32(1000 + h.Sum64()%9000)
}

func greedyText(id uint32) string { return fmt.Sprintf(" w%d", id) }

// greedyPrompt is the ids of a text: one per byte.
func greedyPrompt(s string) []uint32 {
	out := make([]uint32, 0, len(s))
	for i := 0; i < len(s); i++ {
		out = append(out, uint32(s[i]))
	}
	return out
}

func (g greedy) handler() engineHandler {
	return func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.Method != http.MethodPost {
			if r.URL.Path == "/health" && (g.draining == nil || !g.draining.Load()) {
				return
			}
			http.Error(w, "not here", http.StatusServiceUnavailable)
			return
		}
		chat := strings.HasSuffix(r.URL.Path, "/chat/completions")
		var req struct {
			Prompt         json.RawMessage `json:"prompt"`
			Messages       []struct{ Role, Content string }
			MaxTokens      *int `json:"max_tokens"`
			MaxCompletion  *int `json:"max_completion_tokens"`
			ReturnTokenIDs bool `json:"return_token_ids"`
			StreamOptions  *struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		if err := json.Unmarshal(body, &req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var prompt []uint32
		text := true
		if chat {
			var sb strings.Builder
			for _, m := range req.Messages {
				sb.WriteString(m.Role + ":" + m.Content + "\n")
			}
			prompt = greedyPrompt(sb.String())
		} else if json.Unmarshal(req.Prompt, &prompt) == nil {
			text = false
		} else {
			var s string
			json.Unmarshal(req.Prompt, &s)
			prompt = greedyPrompt(s)
		}
		limit := 16
		if req.MaxTokens != nil {
			limit = *req.MaxTokens
		}
		if req.MaxCompletion != nil {
			limit = *req.MaxCompletion
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		id, object := "cmpl-g", "text_completion"
		if chat {
			id, object = "chatcmpl-g", "chat.completion.chunk"
		}
		ids := append([]uint32(nil), prompt...)
		write := func(v map[string]any) {
			b, _ := json.Marshal(v)
			fmt.Fprintf(w, "data: %s\n\n", b)
			fl.Flush()
		}
		if chat {
			first := map[string]any{"id": id, "object": object, "created": 1, "model": "m",
				"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}, "finish_reason": nil}}}
			if req.ReturnTokenIDs {
				first["prompt_token_ids"] = prompt
			}
			write(first)
		}
		for i := 0; i < limit; i++ {
			if text && g.dieAfter > 0 && i == g.dieAfter {
				hj, ok := w.(http.Hijacker)
				if ok {
					if conn, _, err := hj.Hijack(); err == nil {
						conn.Close()
					}
				}
				return
			}
			if g.delay > 0 {
				select {
				case <-time.After(g.delay):
				case <-r.Context().Done():
					return
				}
			}
			tok := greedyNext(ids)
			ids = append(ids, tok)
			var finish any
			if i == limit-1 {
				finish = "length"
			}
			choice := map[string]any{"index": 0, "finish_reason": finish}
			if chat {
				choice["delta"] = map[string]any{"content": greedyText(tok)}
			} else {
				choice["text"] = greedyText(tok)
			}
			if req.ReturnTokenIDs {
				choice["token_ids"] = []uint32{tok}
				if !chat && i == 0 {
					choice["prompt_token_ids"] = prompt
				}
			}
			write(map[string]any{"id": id, "object": object, "created": 1, "model": "m", "choices": []any{choice}})
		}
		if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
			write(map[string]any{"id": id, "object": object, "created": 1, "model": "m", "choices": []any{},
				"usage": map[string]any{"prompt_tokens": len(prompt), "completion_tokens": limit, "total_tokens": len(prompt) + limit}})
		}
		io.WriteString(w, "data: [DONE]\n\n")
		fl.Flush()
	}
}

// streamed is a stream as a client reads it: its events' JSON, in order, and whether it ended
// with [DONE].
type streamed struct {
	events []map[string]json.RawMessage
	done   bool
	raw    string
}

func readStream(t *testing.T, body io.Reader) streamed {
	t.Helper()
	var s streamed
	br := bufio.NewReader(body)
	for {
		ev, err := readEvent(br)
		s.raw += ev
		if line := strings.TrimSpace(ev); strings.HasPrefix(line, "data:") {
			payload := strings.TrimSpace(strings.TrimPrefix(line, "data:"))
			if payload == "[DONE]" {
				s.done = true
			} else {
				var m map[string]json.RawMessage
				if jerr := json.Unmarshal([]byte(payload), &m); jerr != nil {
					t.Fatalf("event %q is not JSON: %v", payload, jerr)
				}
				s.events = append(s.events, m)
			}
		}
		if err != nil {
			return s
		}
	}
}

// text is the stream's answer text; chat says where it is.
func (s streamed) text(t *testing.T, chat bool) string {
	t.Helper()
	var sb strings.Builder
	for _, ev := range s.events {
		var choices []struct {
			Text  string `json:"text"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
		}
		json.Unmarshal(ev["choices"], &choices)
		for _, c := range choices {
			if chat {
				sb.WriteString(c.Delta.Content)
			} else {
				sb.WriteString(c.Text)
			}
		}
	}
	return sb.String()
}

// wantGreedy is the text an unbroken greedy run gives.
func wantGreedy(prompt []uint32, n int) string {
	ids := append([]uint32(nil), prompt...)
	var sb strings.Builder
	for i := 0; i < n; i++ {
		tok := greedyNext(ids)
		ids = append(ids, tok)
		sb.WriteString(greedyText(tok))
	}
	return sb.String()
}

func TestAStreamWhoseDecoderDiesGoesOnElsewhereTokenExact(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		chat             bool
		prompt           []uint32
	}{
		{"completions", "/v1/completions", `{"model":"m","prompt":"hello there","max_tokens":12,"stream":true,"temperature":0,"stream_options":{"include_usage":true}}`,
			false, greedyPrompt("hello there")},
		{"chat", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":12,"stream":true,"temperature":0,"stream_options":{"include_usage":true}}`,
			true, greedyPrompt("user:hi\n")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d0, d1 := newEngine(t, greedy{dieAfter: 5}.handler()), newEngine(t, greedy{dieAfter: 5}.handler())
			h := aggregated(t, Config{MigrationLimit: 1}, d0, d1)
			resp, err := http.DefaultClient.Do(h.request(t.Context(), http.MethodPost, tc.path, tc.body, nil))
			if err != nil {
				t.Fatal(err)
			}
			s := readStream(t, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || !s.done {
				t.Fatalf("status %d, [DONE] %v: the client must read one whole stream\n%s", resp.StatusCode, s.done, s.raw)
			}
			if got, want := s.text(t, tc.chat), wantGreedy(tc.prompt, 12); got != want {
				t.Fatalf("text %q, want the unbroken run's %q\n%s", got, want, s.raw)
			}
			ids, finishes := map[string]bool{}, 0
			for _, ev := range s.events {
				ids[string(ev["id"])] = true
				if _, ok := ev["prompt_token_ids"]; ok {
					t.Errorf("an event carries prompt_token_ids the client did not ask for: %s", s.raw)
				}
				if tc.chat && string(ev["object"]) != `"chat.completion.chunk"` {
					t.Errorf("a chat stream's event is a %s", ev["object"])
				}
				var choices []map[string]json.RawMessage
				json.Unmarshal(ev["choices"], &choices)
				for _, c := range choices {
					if _, ok := c["token_ids"]; ok {
						t.Errorf("a choice carries token_ids the client did not ask for")
					}
					if fr := c["finish_reason"]; fr != nil && string(fr) != "null" {
						finishes++
					}
				}
				if u, ok := ev["usage"]; ok {
					var usage struct{ PromptTokens, CompletionTokens int }
					json.Unmarshal(u, &usage)
					var raw struct {
						P int `json:"prompt_tokens"`
						C int `json:"completion_tokens"`
					}
					json.Unmarshal(u, &raw)
					if raw.P != len(tc.prompt) || raw.C != 12 {
						t.Errorf("usage %s, want the client's prompt (%d) and the 12 tokens it got", u, len(tc.prompt))
					}
				}
			}
			if len(ids) != 1 || finishes != 1 {
				t.Errorf("%d ids and %d finish reasons, want one of each\n%s", len(ids), finishes, s.raw)
			}
			if n := h.value("pdproxy_migrations_total", map[string]string{"reason": "decoder_failed", "outcome": "migrated"}); n != 1 {
				t.Errorf("migrations{decoder_failed,migrated} = %v, want 1", n)
			}
			if n := h.value("pdproxy_migration_tokens_replayed_total", nil); n != 5 {
				t.Errorf("tokens replayed = %v, want the 5 the client had", n)
			}
			// The continuation went to the other decoder, as a completions prompt of ids.
			var cont []received
			for _, d := range []*fakeEngine{d0, d1} {
				for _, g := range d.generations() {
					if g.Path == "/v1/completions" && strings.Contains(string(g.Body), `"prompt":[`) {
						cont = append(cont, g)
					}
				}
			}
			if len(cont) != 1 {
				t.Fatalf("%d continuations, want 1", len(cont))
			}
			f := cont[0].fields(t)
			if string(f["max_tokens"]) != "7" || string(f["return_token_ids"]) != "true" {
				t.Errorf("continuation max_tokens %s return_token_ids %s, want 7 and true", f["max_tokens"], f["return_token_ids"])
			}
			h.waitQuiet()
		})
	}
}

// A stream that cannot go on exactly fails as it would without migration: an error event and
// no [DONE], counted by why.
func TestAStreamThatCannotGoOnExactlyFailsWithAnErrorEvent(t *testing.T) {
	d0, d1 := newEngine(t, greedy{dieAfter: 3}.handler()), newEngine(t, greedy{dieAfter: 3}.handler())
	h := aggregated(t, Config{MigrationLimit: 2}, d0, d1)
	for _, tc := range []struct{ body, reason string }{
		{`{"model":"m","prompt":"a","max_tokens":8,"stream":true,"logprobs":2}`, "logprobs"},
		{`{"model":"m","prompt":"a","max_tokens":8,"stream":true,"stop":["x"]}`, "stop"},
		{`{"model":"m","prompt":"a","max_tokens":8,"stream":true,"response_format":{"type":"json_object"}}`, "guided_decoding"},
		{`{"model":"m","prompt":"a","max_tokens":8,"stream":true,"frequency_penalty":0.5}`, "penalties"},
	} {
		t.Run(tc.reason, func(t *testing.T) {
			resp, err := http.DefaultClient.Do(h.request(t.Context(), http.MethodPost, "/v1/completions", tc.body, nil))
			if err != nil {
				t.Fatal(err)
			}
			s := readStream(t, resp.Body)
			resp.Body.Close()
			if s.done || len(s.events) == 0 || s.events[len(s.events)-1]["error"] == nil {
				t.Fatalf("the stream must end in an error event, without [DONE]\n%s", s.raw)
			}
			if n := h.value("pdproxy_migrations_refused_total", map[string]string{"reason": tc.reason}); n != 1 {
				t.Errorf("refused{%s} = %v, want 1", tc.reason, n)
			}
			for _, d := range []*fakeEngine{d0, d1} {
				for _, g := range d.generations() {
					if strings.Contains(string(g.Body), "return_token_ids") {
						t.Errorf("a stream that cannot migrate was asked for token ids: %s", g.Body)
					}
				}
			}
		})
	}
	h.waitQuiet()
}

// A stream moves at most migration_limit times, and never back to a decoder it left: past
// that it fails with an error event.
func TestAStreamMovesAtMostItsLimit(t *testing.T) {
	var ds []*fakeEngine
	var bs []routerconfig.BackendConfig
	for i := range 3 {
		// Every decoder dies, continuations too.
		d := newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
			greedy{dieAfter: 2}.handler()(w, r, []byte(strings.Replace(string(body), `"prompt":[`, `"prompt":"x","ids":[`, 1)))
		})
		ds = append(ds, d)
		bs = append(bs, decoder(fmt.Sprintf("d%d", i), d.URL()))
	}
	h := newHarness(t, Config{MigrationLimit: 1}, routerconfig.Config{Backends: bs})
	resp, err := http.DefaultClient.Do(h.request(t.Context(), http.MethodPost, "/v1/completions",
		`{"model":"m","prompt":"a","max_tokens":8,"stream":true}`, nil))
	if err != nil {
		t.Fatal(err)
	}
	s := readStream(t, resp.Body)
	resp.Body.Close()
	if s.done || s.events[len(s.events)-1]["error"] == nil {
		t.Fatalf("want an error event and no [DONE]\n%s", s.raw)
	}
	calls := 0
	for _, d := range ds {
		calls += len(d.generations())
	}
	if calls != 2 {
		t.Errorf("%d decodes, want 2: the first and one continuation", calls)
	}
	if n := h.value("pdproxy_migrations_total", map[string]string{"reason": "decoder_failed", "outcome": "limit_reached"}); n != 1 {
		t.Errorf("migrations{limit_reached} = %v, want 1", n)
	}
	h.waitQuiet()
}

// A decoder that starts draining (its health check answers 503) has its streams moved before
// they end: each goes on on another decoder, token-exact, and the draining one's call is cut.
func TestAStreamLeavesADrainingDecoderBeforeItEnds(t *testing.T) {
	var draining [2]atomic.Bool
	d0 := newEngine(t, greedy{delay: 20 * time.Millisecond, draining: &draining[0]}.handler())
	d1 := newEngine(t, greedy{delay: 20 * time.Millisecond, draining: &draining[1]}.handler())
	h := newHarness(t, Config{MigrationLimit: 1}, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{decoder("d0", d0.URL()), decoder("d1", d1.URL())},
		Health:   routerconfig.HealthConfig{Interval: 10 * time.Millisecond, Timeout: time.Second, UnhealthyThreshold: 1, HealthyThreshold: 1},
	})
	resp, err := http.DefaultClient.Do(h.request(t.Context(), http.MethodPost, "/v1/completions",
		`{"model":"m","prompt":"drain me","max_tokens":40,"stream":true,"temperature":0}`, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	first, err := readEvent(br)
	if err != nil {
		t.Fatalf("first event: %v", err)
	}
	// The stream is under way on one decoder: that one starts draining.
	victim := d0
	if len(d1.generations()) == 1 {
		victim = d1
		draining[1].Store(true)
	} else {
		draining[0].Store(true)
	}
	rest := readStream(t, br)
	s := readStream(t, strings.NewReader(first+rest.raw))
	if !s.done {
		t.Fatalf("the stream did not end whole\n%s", s.raw)
	}
	if got, want := s.text(t, false), wantGreedy(greedyPrompt("drain me"), 40); got != want {
		t.Fatalf("text %q, want the unbroken run's %q", got, want)
	}
	if n := h.value("pdproxy_migrations_total", map[string]string{"reason": "drained", "outcome": "migrated"}); n != 1 {
		t.Errorf("migrations{drained,migrated} = %v, want 1", n)
	}
	if n := len(victim.generations()); n != 1 {
		t.Errorf("the draining decoder got %d generations, want only the first", n)
	}
	h.waitQuiet()
}

// A moved stream's trace has a span per attempt under the request's: the first ended as
// migrated, the second served, each with the decode it made.
func TestTraceOfAMovedStreamHasASpanPerAttempt(t *testing.T) {
	rcv := testutil.NewOTLPHTTPReceiver(t)
	d0, d1 := newEngine(t, greedy{dieAfter: 4}.handler()), newEngine(t, greedy{dieAfter: 4}.handler())
	h := newHarnessLogged(t, Config{MigrationLimit: 1}, routerconfig.Config{Backends: []routerconfig.BackendConfig{decoder("d0", d0.URL()), decoder("d1", d1.URL())}},
		lifecycle.Config{}, nil, tracedBy(t, rcv))
	tp, traceID, _ := clientTrace()
	resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hello","max_tokens":9,"stream":true,"temperature":0}`,
		http.Header{"Traceparent": {tp}})
	if resp.StatusCode != http.StatusOK || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	tree := waitTrace(t, rcv, traceID, map[string]int{"POST /v1/completions": 1, pdflow.SpanAttempt: 2, pdflow.SpanDecode: 2})
	srv := tree.one(t, "POST /v1/completions")
	byNumber := map[string]testutil.Span{}
	for _, a := range tree[pdflow.SpanAttempt] {
		childOf(t, a, srv, nil)
		byNumber[a.Attrs["pdproxy.attempt"]] = a
	}
	if got := byNumber["0"].Attrs["pdproxy.attempt.outcome"]; got != "migrated" {
		t.Errorf("attempt 0 ended %q, want migrated", got)
	}
	if got := byNumber["1"].Attrs["pdproxy.attempt.outcome"]; got != "served" {
		t.Errorf("attempt 1 ended %q, want served", got)
	}
	parents := map[string]bool{}
	for _, d := range tree[pdflow.SpanDecode] {
		parents[d.ParentID] = true
	}
	if !parents[byNumber["0"].SpanID] || !parents[byNumber["1"].SpanID] {
		t.Errorf("the decode spans' parents are %v, want one under each attempt", parents)
	}
	h.waitQuiet()
}
