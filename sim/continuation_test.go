package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// answerIDs is what a client reads of an answer asked with
// return_token_ids: the prompt's ids, the generated ids, the text, the
// finish reason and the cached prompt tokens (whole answers only).
type answerIDs struct {
	prompt, ids  []uint32
	text, finish string
	cached       int
}

// idsChunk is one choice-carrying object of an answer or a stream chunk.
type idsChunk struct {
	PromptTokenIDs *[]uint32 `json:"prompt_token_ids"`
	Choices        []struct {
		Index   int     `json:"index"`
		Text    *string `json:"text"`
		Message *struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta *struct {
			Content *string `json:"content"`
		} `json:"delta"`
		TokenIDs       *[]uint32 `json:"token_ids"`
		PromptTokenIDs *[]uint32 `json:"prompt_token_ids"`
		FinishReason   *string   `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

// generate posts body (a completions or chat body with return_token_ids)
// and reads its one choice, streamed or not. It fails the test unless the
// prompt ids come exactly once, where vLLM puts them: on the choice for
// completions, at the top level for chat, on a stream's first chunk only.
func generate(t *testing.T, ts *testServer, path, body string) answerIDs {
	t.Helper()
	resp := ts.post(t, context.Background(), path, body, nil)
	raw := readAll(t, resp)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s %s: %d %s", path, body, resp.StatusCode, raw)
	}
	chat := strings.Contains(path, "chat")
	var chunks []idsChunk
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		events := sseEvents(t, raw)
		if len(events) == 0 || events[len(events)-1] != "[DONE]" {
			t.Fatalf("stream does not end with [DONE]: %q", events)
		}
		for _, ev := range events[:len(events)-1] {
			var c idsChunk
			if err := json.Unmarshal([]byte(ev), &c); err != nil {
				t.Fatalf("chunk %q: %v", ev, err)
			}
			chunks = append(chunks, c)
		}
	} else {
		var c idsChunk
		if err := json.Unmarshal(raw, &c); err != nil {
			t.Fatalf("answer %s: %v", raw, err)
		}
		chunks = append(chunks, c)
	}
	var a answerIDs
	promptSeen := 0
	for i, c := range chunks {
		if c.PromptTokenIDs != nil {
			if !chat || i != 0 {
				t.Fatalf("chunk %d of %s carries a top-level prompt_token_ids", i, path)
			}
			a.prompt = *c.PromptTokenIDs
			promptSeen++
		}
		if c.Usage != nil && c.Usage.PromptTokensDetails != nil {
			a.cached = c.Usage.PromptTokensDetails.CachedTokens
		}
		for _, ch := range c.Choices {
			if ch.PromptTokenIDs != nil {
				if chat || i != 0 {
					t.Fatalf("chunk %d of %s carries prompt_token_ids on its choice", i, path)
				}
				a.prompt = *ch.PromptTokenIDs
				promptSeen++
			}
			switch {
			case ch.Text != nil:
				a.text += *ch.Text
			case ch.Message != nil:
				a.text += ch.Message.Content
			case ch.Delta != nil && ch.Delta.Content != nil:
				a.text += *ch.Delta.Content
			}
			isRole := chat && len(chunks) > 1 && i == 0
			if ch.TokenIDs == nil && !isRole {
				t.Fatalf("chunk %d of %s has no token_ids", i, path)
			}
			if ch.TokenIDs != nil {
				a.ids = append(a.ids, *ch.TokenIDs...)
			}
			if ch.FinishReason != nil {
				a.finish = *ch.FinishReason
			}
		}
	}
	if promptSeen != 1 {
		t.Fatalf("%s: prompt_token_ids came %d times, want once", path, promptSeen)
	}
	return a
}

// idPrompt is ids as a JSON token-id prompt.
func idPrompt(ids []uint32) string {
	b, _ := json.Marshal(ids)
	return string(b)
}

// greedyEnd is where a greedy answer of model to prompt first has an EOS
// (min_tokens 0), or -1 if not within n tokens.
func greedyEnd(model string, prompt []uint32, n int) int {
	s := prefixState(model, false, 0, prompt)
	for i := range n {
		id, eos := prefixToken(s)
		if eos {
			return i
		}
		s = foldToken(s, id)
	}
	return -1
}

func TestAContinuationFromEverySplitPointGeneratesTheRestOfTheUnbrokenAnswer(t *testing.T) {
	cfgA, cfgB := fastConfig(), fastConfig()
	cfgA.Seed, cfgB.Seed = 1, 2 // the request-id source's seed plays no part here
	a, b := startServer(t, cfgA), startServer(t, cfgB)
	const maxTokens = 24
	// A prompt whose greedy answer ends on an EOS: the continuations must
	// stop there too.
	var stopping string
	for i := 0; stopping == ""; i++ {
		p := fmt.Sprintf("tell me a story number %d", i)
		if at := greedyEnd("sim", Tokenize(p), maxTokens); at >= 3 {
			stopping = p
		}
	}
	for _, tc := range []struct {
		name, path, body, finish string
		stream                   bool
	}{
		{"completions greedy", "/v1/completions", `{"prompt":"the quick brown fox","max_tokens":24,"temperature":0,"ignore_eos":true,"return_token_ids":true}`, "length", false},
		{"completions greedy streamed", "/v1/completions", `{"prompt":"the quick brown fox","max_tokens":24,"temperature":0,"ignore_eos":true,"return_token_ids":true,"stream":true}`, "length", true},
		{"completions greedy ending on an EOS", "/v1/completions", `{"prompt":"` + stopping + `","max_tokens":24,"temperature":0,"return_token_ids":true}`, "stop", false},
		{"completions seeded", "/v1/completions", `{"prompt":"the quick brown fox","max_tokens":24,"seed":7,"temperature":0.8,"ignore_eos":true,"return_token_ids":true}`, "length", false},
		{"chat greedy", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hello there"}],"max_tokens":24,"temperature":0,"ignore_eos":true,"return_token_ids":true}`, "length", false},
		{"chat greedy streamed", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hello there"}],"max_tokens":24,"temperature":0,"ignore_eos":true,"return_token_ids":true,"stream":true}`, "length", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			whole := generate(t, a, tc.path, tc.body)
			if whole.finish != tc.finish || len(whole.ids) < 3 {
				t.Fatalf("unbroken answer: finish %q, %d ids; want %q", whole.finish, len(whole.ids), tc.finish)
			}
			if tc.finish == "length" && len(whole.ids) != maxTokens {
				t.Fatalf("unbroken answer has %d ids, want %d", len(whole.ids), maxTokens)
			}
			if again := generate(t, b, tc.path, tc.body); fmt.Sprint(again.ids) != fmt.Sprint(whole.ids) || again.text != whole.text {
				t.Fatalf("another engine answers %v %q, want %v %q", again.ids, again.text, whole.ids, whole.text)
			}
			var sampling string
			for _, f := range []string{`"temperature":0,`, `"seed":7,"temperature":0.8,`} {
				if strings.Contains(tc.body, f) {
					sampling = f
				}
			}
			ignoreEOS := strings.Contains(tc.body, `"ignore_eos":true`)
			for m := 1; m < len(whole.ids); m++ {
				prompt := append(append([]uint32{}, whole.prompt...), whole.ids[:m]...)
				body := fmt.Sprintf(`{"prompt":%s,"max_tokens":%d,%s"ignore_eos":%t,"return_token_ids":true,"stream":%t}`,
					idPrompt(prompt), maxTokens-m, sampling, ignoreEOS, tc.stream)
				rest := generate(t, b, "/v1/completions", body)
				if fmt.Sprint(rest.ids) != fmt.Sprint(whole.ids[m:]) {
					t.Fatalf("split at %d: continuation ids %v, want %v", m, rest.ids, whole.ids[m:])
				}
				var head strings.Builder
				for _, id := range whole.ids[:m] {
					head.WriteString(tokenWord(id))
				}
				if want := strings.TrimPrefix(whole.text, head.String()); rest.text != want || rest.finish != whole.finish {
					t.Fatalf("split at %d: continuation %q (%s), want %q (%s)", m, rest.text, rest.finish, want, whole.finish)
				}
				if fmt.Sprint(rest.prompt) != fmt.Sprint(prompt) {
					t.Fatalf("split at %d: prompt_token_ids %v, want the prompt sent %v", m, rest.prompt, prompt)
				}
			}
		})
	}
}

func TestAnotherModelOrSeedGivesAnotherGreedyOrSeededAnswer(t *testing.T) {
	cfg := fastConfig()
	cfg.Model = "sim,other"
	ts := startServer(t, cfg)
	body := func(fields string) string {
		return `{"prompt":"the quick brown fox","max_tokens":8,"ignore_eos":true,"return_token_ids":true,` + fields + `}`
	}
	greedy := generate(t, ts, "/v1/completions", body(`"temperature":0`))
	for _, tc := range []struct{ name, fields string }{
		{"another model", `"temperature":0,"model":"other"`},
		{"a seed", `"seed":1`},
		{"another seed", `"seed":2`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := generate(t, ts, "/v1/completions", body(tc.fields)); fmt.Sprint(got.ids) == fmt.Sprint(greedy.ids) {
				t.Errorf("%s answers the greedy ids %v", tc.name, got.ids)
			}
		})
	}
	t.Run("greedy ignores the seed", func(t *testing.T) {
		if got := generate(t, ts, "/v1/completions", body(`"temperature":0,"seed":99`)); fmt.Sprint(got.ids) != fmt.Sprint(greedy.ids) {
			t.Errorf("greedy with a seed answers %v, want %v", got.ids, greedy.ids)
		}
	})
}

func TestTokenIDFieldsAppearOnlyWithReturnTokenIDs(t *testing.T) {
	ts := startServer(t, fastConfig())
	for _, tc := range []struct{ name, path, body string }{
		{"completions", "/v1/completions", `{"prompt":"hi","max_tokens":3}`},
		{"completions streamed", "/v1/completions", `{"prompt":"hi","max_tokens":3,"stream":true}`},
		{"chat", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"return_token_ids":false}`},
		{"chat streamed", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if b := readAll(t, ts.post(t, context.Background(), tc.path, tc.body, nil)); strings.Contains(string(b), "token_ids") {
				t.Errorf("answer without return_token_ids carries token ids: %s", b)
			}
		})
	}
}

func TestReturnTokenIDsGivesAChatThePromptItsTemplateRendered(t *testing.T) {
	ts := startServer(t, fastConfig())
	msgs := []ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: "hello there"}}
	for _, stream := range []bool{false, true} {
		got := generate(t, ts, "/v1/chat/completions", fmt.Sprintf(`{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello there"}],"max_tokens":4,"ignore_eos":true,"return_token_ids":true,"stream":%t}`, stream))
		if want := TokenizeChat(msgs, true); fmt.Sprint(got.prompt) != fmt.Sprint(want) {
			t.Errorf("stream %t: prompt_token_ids %v, want the rendered chat's %v", stream, got.prompt, want)
		}
		if len(got.ids) != 4 {
			t.Errorf("stream %t: token_ids %v, want 4", stream, got.ids)
		}
		var text strings.Builder
		for _, id := range got.ids {
			text.WriteString(tokenWord(id))
		}
		if got.text != text.String() {
			t.Errorf("stream %t: text %q is not the text of its token_ids %q", stream, got.text, text.String())
		}
	}
}

func TestTokenIDPrompts(t *testing.T) {
	ts := startServer(t, fastConfig())
	long := make([]uint32, 40) // two full blocks and a part
	for i := range long {
		long[i] = uint32(100 + i)
	}
	t.Run("a token-id prompt is cached like any prompt", func(t *testing.T) {
		body := `{"prompt":` + idPrompt(long) + `,"max_tokens":2,"temperature":0,"return_token_ids":true}`
		first, second := generate(t, ts, "/v1/completions", body), generate(t, ts, "/v1/completions", body)
		if first.cached != 0 || second.cached != 32 {
			t.Errorf("cached_tokens %d then %d, want 0 then 32", first.cached, second.cached)
		}
		if fmt.Sprint(first.prompt) != fmt.Sprint(long) {
			t.Errorf("prompt_token_ids %v, want the ids sent", first.prompt)
		}
	})
	t.Run("a list of token-id lists is one prompt each", func(t *testing.T) {
		resp := ts.post(t, context.Background(), "/v1/completions", `{"prompt":[[5,6,7],[8,9]],"max_tokens":2,"temperature":0,"return_token_ids":true}`, nil)
		var c idsChunk
		if err := json.Unmarshal(readAll(t, resp), &c); err != nil || len(c.Choices) != 2 {
			t.Fatalf("answer %+v, %v: want two choices", c, err)
		}
		for i, want := range []string{"[5 6 7]", "[8 9]"} {
			if ch := c.Choices[i]; ch.PromptTokenIDs == nil || fmt.Sprint(*ch.PromptTokenIDs) != want || ch.TokenIDs == nil || len(*ch.TokenIDs) != 2 {
				t.Errorf("choice %d: prompt_token_ids %v, token_ids %v; want %s and two ids", i, ch.PromptTokenIDs, ch.TokenIDs, want)
			}
		}
	})
	t.Run("an id past the vocabulary is a 400", func(t *testing.T) {
		resp := ts.post(t, context.Background(), "/v1/completions", fmt.Sprintf(`{"prompt":[5,%d],"max_tokens":2}`, vocabSize), nil)
		if b := readAll(t, resp); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("status %d %s, want 400", resp.StatusCode, b)
		}
	})
}
