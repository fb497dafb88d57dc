package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// The requests a proxy sends decode-only: several choices, served by one
// engine without kv_transfer_params, as a vLLM server serves them.

// choiceCase is a request with several choices and what its answer must
// hold: choice index i is the sample of child rids[i] (prompt-major).
type choiceCase struct {
	name, path, body string
	rids             []string // the shown choices' request ids, in index order
	children         int      // engine requests it runs, hidden best_of ones included
	blocks           int      // KV blocks they take together
	promptTokens     int      // every prompt once
}

// choiceCases are each asked with max_tokens 2 and ignore_eos, under
// X-Request-Id "multi".
func choiceCases() []choiceCase {
	long := strings.Repeat("abcd", 40) // 40 tokens: 3 blocks
	id := func(i, k int) string { return childID("multi", i, k) }
	return []choiceCase{
		{"completions n=3", "/v1/completions", `{"prompt":"` + long + `","n":3}`,
			[]string{id(0, 0), id(0, 1), id(0, 2)}, 3, 9, 40},
		{"completions n=2 with kv_transfer_params null", "/v1/completions", `{"prompt":"hi","n":2,"kv_transfer_params":null}`,
			[]string{id(0, 0), id(0, 1)}, 2, 2, 1},
		{"completions best_of=3 runs 3 and shows n=2", "/v1/completions", `{"prompt":"hi","n":2,"best_of":3}`,
			[]string{id(0, 0), id(0, 1)}, 3, 3, 1},
		{"completions best_of=2 alone shows one", "/v1/completions", `{"prompt":"hi","best_of":2}`,
			[]string{id(0, 0)}, 2, 2, 1},
		{"two prompts", "/v1/completions", `{"prompt":["` + long + `","hi"]}`,
			[]string{id(0, 0), id(1, 0)}, 2, 4, 41},
		{"two token-id prompts with n=2 are numbered prompt-major", "/v1/completions", `{"prompt":[[1,2,3],[4,5,6,7,8,9,10,11,12,13,14,15,16,17]],"n":2}`,
			[]string{id(0, 0), id(0, 1), id(1, 0), id(1, 1)}, 4, 4, 17},
		// The chat template adds 10 tokens: 4 blocks.
		{"chat n=2", "/v1/chat/completions", `{"messages":[{"role":"user","content":"` + long + `"}],"n":2}`,
			[]string{id(0, 0), id(0, 1)}, 2, 8, 50},
	}
}

// withOptions adds max_tokens 2, ignore_eos and extra to a case's body.
func withOptions(body, extra string) string {
	return strings.TrimSuffix(body, "}") + `,"max_tokens":2,"ignore_eos":true` + extra + `}`
}

func TestRequestWithoutKVParamsAnswersEveryChoiceInOneJSONAnswer(t *testing.T) {
	for _, tt := range choiceCases() {
		t.Run(tt.name, func(t *testing.T) {
			ts := startServer(t, noCacheConfig())
			resp := ts.post(t, context.Background(), tt.path, withOptions(tt.body, ""), map[string]string{"X-Request-Id": "multi"})
			raw := readAll(t, resp)
			var ans struct {
				Choices []struct {
					Index   int     `json:"index"`
					Text    *string `json:"text"`
					Message *struct {
						Role    string `json:"role"`
						Content string `json:"content"`
					} `json:"message"`
					FinishReason string `json:"finish_reason"`
				} `json:"choices"`
				Usage usage           `json:"usage"`
				KV    json.RawMessage `json:"kv_transfer_params"`
			}
			if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &ans) != nil {
				t.Fatalf("status %d: %s", resp.StatusCode, raw)
			}
			if len(ans.Choices) != len(tt.rids) {
				t.Fatalf("%d choices, want %d: %s", len(ans.Choices), len(tt.rids), raw)
			}
			for i, c := range ans.Choices {
				text := ""
				switch {
				case c.Text != nil:
					text = *c.Text
				case c.Message != nil && c.Message.Role == "assistant":
					text = c.Message.Content
				}
				if c.Index != i || text != expectedText(0, tt.rids[i], 2) || c.FinishReason != "length" {
					t.Errorf("choice %d = %+v %q, want index %d with the text of %s, finish length", i, c, text, i, tt.rids[i])
				}
			}
			want := usage{PromptTokens: tt.promptTokens, CompletionTokens: 2 * len(tt.rids), TotalTokens: tt.promptTokens + 2*len(tt.rids)}
			if ans.Usage != want || string(ans.KV) != "null" {
				t.Errorf("usage %+v, kv_transfer_params %s; want %+v and null", ans.Usage, ans.KV, want)
			}
			s := ts.waitKV(t, "every child freed its blocks", allFree)
			if s.RequestsTotal != tt.children || s.AbortedTotal != 0 || s.DoubleFreeAttemptsTotal != 0 {
				t.Errorf("/debug/kv = %+v, want %d requests run and nothing aborted", s, tt.children)
			}
		})
	}
}

// noCacheConfig is fastConfig without prefix caching: these tests count
// each choice's blocks as its own, where with caching the choices of one
// prompt share its full blocks.
func noCacheConfig() Config {
	cfg := fastConfig()
	noPrefixCache(&cfg)
	return cfg
}

func noPrefixCache(cfg *Config) { cfg.DisablePrefixCache = true }

// steppedServer is an engine whose tokens come only when the test advances
// its clock an hour: the first at admission, the next one per advance.
func steppedServer(t *testing.T) (*testServer, *fakeClock) {
	t.Helper()
	clock := newFakeClock()
	cfg := noCacheConfig()
	cfg.Clock, cfg.PrefillTime, cfg.ITL = clock, 0, time.Hour
	return startServer(t, cfg), clock
}

// streamChunk is what these tests read of a stream's chunk.
type streamChunk struct {
	Choices []struct {
		Index int     `json:"index"`
		Text  *string `json:"text"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage    `json:"usage"`
	Error *apiError `json:"error"`
}

// nextEvent reads one SSE event's data.
func nextEvent(t *testing.T, r *bufio.Reader) string {
	t.Helper()
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("stream ended without [DONE]: %q, %v", line, err)
		}
		if line = strings.TrimRight(line, "\n"); line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("SSE line without data: %q", line)
		}
		return data
	}
}

// choiceStream collects a stream's choices by index.
type choiceStream struct {
	text    map[int]string
	finish  map[int]string
	tokens  map[int]int // token chunks (role chunks not counted)
	roles   map[int]bool
	usage   *usage
	done    int // [DONE] events
	ordered []string
}

// read consumes one event; it reports whether it was [DONE].
func (s *choiceStream) read(t *testing.T, r *bufio.Reader) bool {
	t.Helper()
	data := nextEvent(t, r)
	s.ordered = append(s.ordered, data)
	if data == "[DONE]" {
		s.done++
		return true
	}
	var c streamChunk
	if err := json.Unmarshal([]byte(data), &c); err != nil || c.Error != nil {
		t.Fatalf("chunk %q: %v", data, err)
	}
	if c.Usage != nil {
		s.usage = c.Usage
	}
	for _, ch := range c.Choices {
		if ch.Delta != nil && ch.Delta.Role == "assistant" {
			s.roles[ch.Index] = true
			continue
		}
		text := ""
		if ch.Text != nil {
			text = *ch.Text
		}
		if ch.Delta != nil && ch.Delta.Content != nil {
			text = *ch.Delta.Content
		}
		s.text[ch.Index] += text
		s.tokens[ch.Index]++
		if ch.FinishReason != nil {
			if s.finish[ch.Index] != "" {
				t.Errorf("choice %d finished twice: %q", ch.Index, s.ordered)
			}
			s.finish[ch.Index] = *ch.FinishReason
		}
	}
	return false
}

func newChoiceStream() *choiceStream {
	return &choiceStream{text: map[int]string{}, finish: map[int]string{}, tokens: map[int]int{}, roles: map[int]bool{}}
}

func TestRequestWithoutKVParamsStreamsEveryChoiceInterleavedWithOneDone(t *testing.T) {
	for _, tt := range choiceCases() {
		t.Run(tt.name, func(t *testing.T) {
			ts, clock := steppedServer(t)
			resp := ts.post(t, context.Background(), tt.path, withOptions(tt.body, `,"stream":true,"stream_options":{"include_usage":true}`),
				map[string]string{"X-Request-Id": "multi"})
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, readAll(t, resp))
			}
			r := bufio.NewReader(resp.Body)
			s := newChoiceStream()
			// Every choice's first token comes before any choice's second:
			// the choices run side by side, in blocks of their own.
			for len(s.tokens) < len(tt.rids) {
				if s.read(t, r) {
					t.Fatalf("[DONE] before every choice began: %q", s.ordered)
				}
			}
			for i, n := range s.tokens {
				if n != 1 || s.finish[i] != "" {
					t.Fatalf("choice %d has %d chunks, finish %q before the clock moved: %q", i, n, s.finish[i], s.ordered)
				}
			}
			st := ts.waitKV(t, "every child running", func(s KVStats) bool { return s.RunningRequests == tt.children })
			if st.BlocksInUse != tt.blocks {
				t.Errorf("/debug/kv = %+v, want %d blocks in use by %d requests", st, tt.blocks, tt.children)
			}
			clock.Advance(time.Hour)
			for !s.read(t, r) {
			}
			if rest := readAll(t, resp); len(strings.TrimSpace(string(rest))) != 0 {
				t.Errorf("events after [DONE]: %q", rest)
			}

			for i, rid := range tt.rids {
				if s.text[i] != expectedText(0, rid, 2) || s.finish[i] != "length" || s.tokens[i] != 2 {
					t.Errorf("choice %d: %q in %d chunks, finish %q; want the 2 tokens of %s, finish length", i, s.text[i], s.tokens[i], s.finish[i], rid)
				}
				if strings.HasPrefix(tt.path, "/v1/chat") != s.roles[i] {
					t.Errorf("choice %d: role chunk %v, want one for chat only", i, s.roles[i])
				}
			}
			if len(s.tokens) != len(tt.rids) {
				t.Errorf("chunks for indices %v, want 0..%d", s.tokens, len(tt.rids)-1)
			}
			want := usage{PromptTokens: tt.promptTokens, CompletionTokens: 2 * len(tt.rids), TotalTokens: tt.promptTokens + 2*len(tt.rids)}
			if s.usage == nil || *s.usage != want || s.done != 1 {
				t.Errorf("usage %+v and %d [DONE], want %+v and one", s.usage, s.done, want)
			}
			st = ts.waitKV(t, "every child freed its blocks", allFree)
			if st.RequestsTotal != tt.children || st.AbortedTotal != 0 || st.DoubleFreeAttemptsTotal != 0 {
				t.Errorf("/debug/kv = %+v, want %d requests run and nothing aborted", st, tt.children)
			}
		})
	}
}

func TestClientGoneAbortsEveryChoiceAndFreesEveryBlock(t *testing.T) {
	long := strings.Repeat("abcd", 40) // 40 tokens: 3 blocks
	tests := []struct {
		name, path, body string
		hdr              map[string]string
		children         int
		blocks           int // each child's
		// firstLine: the client reads one line of the stream before leaving
		firstLine bool
	}{
		{"completions stream of two prompts with n=2", "/v1/completions",
			`{"prompt":["` + long + `","` + long + `"],"n":2,"stream":true}`, nil, 4, 3, true},
		{"chat stream with n=3", "/v1/chat/completions",
			`{"messages":[{"role":"user","content":"` + long + `"}],"n":3,"stream":true}`, nil, 3, 4, true}, // the template's tokens: 4 blocks
		{"completions stream with best_of", "/v1/completions",
			`{"prompt":"` + long + `","n":1,"best_of":3,"stream":true}`, nil, 3, 3, true},
		{"whole answer with n=3, client gone before it", "/v1/completions",
			`{"prompt":"` + long + `","n":3}`, nil, 3, 3, false},
		{"stream cut by the engine after 2 events (X-Sim-Close-After)", "/v1/completions",
			`{"prompt":"` + long + `","n":3,"stream":true}`, map[string]string{HeaderCloseAfter: "2"}, 3, 3, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts, _ := steppedServer(t) // the clock never moves: nobody finishes
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				resp, err := ts.do(ctx, tt.path, strings.TrimSuffix(tt.body, "}")+`,"max_tokens":100,"ignore_eos":true}`, tt.hdr)
				if err != nil {
					done <- err
					return
				}
				defer resp.Body.Close()
				if tt.firstLine {
					if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
						done <- err
						return
					}
				}
				<-ctx.Done()
				done <- nil
			}()
			if tt.hdr == nil {
				s := ts.waitKV(t, "every child running", func(s KVStats) bool { return s.RunningRequests == tt.children })
				if s.BlocksInUse != tt.blocks*tt.children {
					t.Errorf("/debug/kv = %+v, want %d blocks in use", s, tt.blocks*tt.children)
				}
				cancel()
			} // else the engine cuts the stream once every child has its first token
			s := ts.waitKV(t, "every block free after the client left", func(s KVStats) bool {
				return s.AbortedTotal == tt.children && s.BlocksFree == s.BlocksTotal && s.RunningRequests == 0 && s.WaitingRequests == 0
			})
			if s.RequestsTotal != tt.children || s.DoubleFreeAttemptsTotal != 0 || s.HeldRequests != 0 {
				t.Errorf("/debug/kv = %+v, want %d requests, nothing held, no double free", s, tt.children)
			}
			cancel()
			if err := <-done; err != nil && ctx.Err() == nil {
				t.Errorf("client: %v", err)
			}
		})
	}
}

func TestAbortRequestOfOneChoiceEndsThatChoiceOnly(t *testing.T) {
	ts, clock := steppedServer(t)
	resp := ts.post(t, context.Background(), "/v1/completions", `{"prompt":"hi","n":2,"max_tokens":2,"ignore_eos":true,"stream":true}`,
		map[string]string{"X-Request-Id": "multi"})
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	s := newChoiceStream()
	for len(s.tokens) < 2 {
		s.read(t, r)
	}
	abort := ts.post(t, context.Background(), "/abort_request", `{"rid":"`+childID("multi", 0, 1)+`"}`, nil)
	if b := readAll(t, abort); abort.StatusCode != http.StatusOK {
		t.Fatalf("abort_request: %d %s", abort.StatusCode, b)
	}
	ts.waitKV(t, "choice 1 aborted", func(s KVStats) bool { return s.AbortedTotal == 1 })
	clock.Advance(time.Hour)
	for !s.read(t, r) {
	}
	if s.finish[0] != "length" || s.finish[1] != "abort" || s.text[0] != expectedText(0, "multi", 2) {
		t.Errorf("finish reasons %v, texts %v: want choice 0 whole and choice 1 aborted", s.finish, s.text)
	}
	ts.waitKV(t, "all free", allFree)
}

func TestPromptLogprobsWithoutKVParamsAreServedAndCrashNothing_Issue50792(t *testing.T) {
	tests := []struct {
		name, path, body string
		choices          int
	}{
		{"prompt_logprobs", "/v1/completions", `{"prompt":"hello","prompt_logprobs":1}`, 1},
		{"prompt_logprobs with kv_transfer_params null", "/v1/completions", `{"prompt":"hello","prompt_logprobs":0,"kv_transfer_params":null}`, 1},
		{"echo with logprobs", "/v1/completions", `{"prompt":"hello","echo":true,"logprobs":1,"kv_transfer_params":null}`, 1},
		{"chat echo with logprobs", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hello"}],"echo":true,"logprobs":true,"top_logprobs":1}`, 1},
		{"prompt_logprobs with n=2 and two prompts", "/v1/completions", `{"prompt":["hello","world"],"n":2,"prompt_logprobs":1,"echo":true,"logprobs":1}`, 4},
	}
	for _, tt := range tests {
		for _, stream := range []bool{false, true} {
			name := tt.name
			if stream {
				name += ", streaming"
			}
			t.Run(name, func(t *testing.T) {
				ts := startServer(t, fastConfig())
				// A request running beside it, which a crash would kill.
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				bystander := ts.post(t, ctx, "/v1/completions", `{"prompt":"busy","max_tokens":1000000,"ignore_eos":true,"stream":true}`, nil)
				defer bystander.Body.Close()
				br := bufio.NewReader(bystander.Body)
				if line, err := br.ReadString('\n'); err != nil || !strings.Contains(line, " tok") {
					t.Fatalf("bystander's first line %q, %v", line, err)
				}

				extra := ""
				if stream {
					extra = `,"stream":true`
				}
				resp := ts.post(t, context.Background(), tt.path, withOptions(tt.body, extra), nil)
				body := readAll(t, resp)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %s", resp.StatusCode, body)
				}
				got := 0
				if stream {
					text, finish := streamText(t, sseEvents(t, body))
					if finish != "length" || text == "" {
						t.Errorf("stream %s: text %q, finish %q", body, text, finish)
					}
					got = strings.Count(string(body), `"finish_reason":"length"`)
				} else {
					var ans fanOutAnswer
					if err := json.Unmarshal(body, &ans); err != nil {
						t.Fatalf("answer %s: %v", body, err)
					}
					got = len(ans.Choices)
				}
				if got != tt.choices {
					t.Errorf("%d choices, want %d: %s", got, tt.choices, body)
				}
				// A crash would have ended the bystander before the answer came.
				if s := ts.kv(t); s.RunningRequests != 1 || s.EngineCrashesTotal != 0 {
					t.Errorf("/debug/kv = %+v, want the bystander still running and no crash", s)
				}
				cancel()
				if s := ts.waitKV(t, "all free", allFree); s.EngineCrashesTotal != 0 || s.DoubleFreeAttemptsTotal != 0 {
					t.Errorf("/debug/kv = %+v, want no crash", s)
				}
			})
		}
	}
}
