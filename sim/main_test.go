package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

func TestMain(m *testing.M) {
	// zmq4 v0.17.0's PUB socket starts a writer goroutine that its Close
	// never stops (socket.Close does not close the socket's writer, whose
	// run waits on a condition only that Close signals): one parked
	// goroutine per closed PUB socket, the sim's KV event publisher's and
	// the tests' own. Everything else must end.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// Nor does any socket's reader of a connection stop when a message arrives as the
		// socket closes: qreader.listen then waits for ever to hand it to a Recv that no
		// longer comes (zmq4 v0.17.0 sends on its channel without watching its context).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*qreader).listen"))
}

// testServer is an engine with its scheduler running and an httptest server
// in front of it, torn down when the test ends.
type testServer struct {
	e      *Engine
	srv    *httptest.Server
	client *http.Client
}

func fastConfig() Config {
	cfg := DefaultConfig()
	cfg.PrefillTime = time.Millisecond
	cfg.ITL = time.Millisecond
	cfg.KVBlocks = 64
	return cfg
}

func startServer(t *testing.T, cfg Config) *testServer {
	t.Helper()
	e, err := New(cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	ts := &testServer{e: e, srv: httptest.NewServer(e.Handler()), client: &http.Client{Transport: &http.Transport{}}}
	t.Cleanup(func() {
		ts.srv.Close() // waits for in-flight handlers, so none outlives the engine
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		ts.client.CloseIdleConnections()
	})
	return ts
}

// post sends body to path with headers and returns the response; the caller closes it.
func (ts *testServer) post(t *testing.T, ctx context.Context, path, body string, hdr map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := ts.client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	return resp
}

func (ts *testServer) get(t *testing.T, path string) []byte {
	t.Helper()
	resp, err := ts.client.Get(ts.srv.URL + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: status %d, %v", path, resp.StatusCode, err)
	}
	return b
}

func (ts *testServer) kv(t *testing.T) KVStats {
	t.Helper()
	var s KVStats
	if err := json.Unmarshal(ts.get(t, "/debug/kv"), &s); err != nil {
		t.Fatalf("decode /debug/kv: %v", err)
	}
	return s
}

// waitKV polls /debug/kv until cond holds, failing after a generous deadline.
// Only the deadline is wall-clock; the assertion is on state.
func (ts *testServer) waitKV(t *testing.T, what string, cond func(KVStats) bool) KVStats {
	t.Helper()
	var s KVStats
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		s = ts.kv(t)
		return cond(s), fmt.Sprintf("%s: not reached, /debug/kv = %+v", what, s)
	})
	return s
}

func allFree(s KVStats) bool {
	return s.BlocksFree == s.BlocksTotal && s.HeldRequests == 0 && s.RunningRequests == 0 && s.WaitingRequests == 0
}

func readAll(t *testing.T, resp *http.Response) []byte {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return b
}

// sseEvents splits an SSE body into its data payloads; the event lines of
// a Responses API stream are skipped (its events carry their type).
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "event: ") {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("SSE line without data: %q", line)
		}
		out = append(out, data)
	}
	return out
}

// streamText joins the token texts of a completions, chat or Responses API
// stream and returns the finish reason; it fails the test on an error
// event, and on a stream that does not end as its API's do.
func streamText(t *testing.T, events []string) (text, finish string) {
	t.Helper()
	if len(events) > 0 && strings.Contains(events[0], `"type":"response.created"`) {
		return responsesStreamText(t, events)
	}
	if len(events) > 0 && strings.Contains(events[0], `"type":"message_start"`) {
		return messagesStreamText(t, events)
	}
	if len(events) == 0 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("stream does not end with [DONE]: %q", events)
	}
	for _, ev := range events[:len(events)-1] {
		var c struct {
			Choices []struct {
				Text  *string `json:"text"`
				Delta struct {
					Content *string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Error *apiError `json:"error"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("chunk %q: %v", ev, err)
		}
		if c.Error != nil {
			t.Fatalf("stream error event: %q", ev)
		}
		for _, ch := range c.Choices {
			if ch.Text != nil {
				text += *ch.Text
			}
			if ch.Delta.Content != nil {
				text += *ch.Delta.Content
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
	}
	return text, finish
}

// expectedText is what the token source yields for rid's first n tokens.
func expectedText(seed int64, rid string, n int) string {
	h := ridHash(seed, rid)
	var b strings.Builder
	for i := range n {
		b.WriteString(tokenText(h, i))
	}
	return b.String()
}

// responsesStreamText is streamText of a Responses API stream: the deltas'
// text, and "length" when the response ended incomplete for its
// max_output_tokens, "stop" when it completed. It fails the test unless
// the last event is response.completed or response.incomplete carrying the
// same text, and on a [DONE], which the Responses API never sends.
func responsesStreamText(t *testing.T, events []string) (text, finish string) {
	t.Helper()
	for i, ev := range events {
		var e struct {
			Type     string `json:"type"`
			Delta    string `json:"delta"`
			Response *struct {
				Status            string `json:"status"`
				IncompleteDetails *struct {
					Reason string `json:"reason"`
				} `json:"incomplete_details"`
				Output []struct {
					Content []struct {
						Text string `json:"text"`
					} `json:"content"`
				} `json:"output"`
			} `json:"response"`
		}
		if err := json.Unmarshal([]byte(ev), &e); err != nil {
			t.Fatalf("event %d %q: %v", i, ev, err)
		}
		switch e.Type {
		case "error":
			t.Fatalf("stream error event: %q", ev)
		case "response.output_text.delta":
			text += e.Delta
		case "response.completed", "response.incomplete":
			if i != len(events)-1 {
				t.Fatalf("%s is event %d of %d: %q", e.Type, i, len(events), events)
			}
			if len(e.Response.Output) != 1 || len(e.Response.Output[0].Content) != 1 || e.Response.Output[0].Content[0].Text != text {
				t.Errorf("%s carries %s, want the streamed text %q", e.Type, ev, text)
			}
			finish = "stop"
			if d := e.Response.IncompleteDetails; d != nil && d.Reason == "max_output_tokens" {
				finish = "length"
			}
			return text, finish
		}
	}
	t.Fatalf("Responses API stream does not end with response.completed or response.incomplete: %q", events)
	return "", ""
}

// answerText is the text of a whole answer, of any API.
func answerText(t *testing.T, body []byte) string {
	t.Helper()
	var c struct {
		Choices []struct {
			Text    *string `json:"text"`
			Message *struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Output []struct {
			Content []struct {
				Text string `json:"text"`
			} `json:"content"`
		} `json:"output"`
		// A Messages answer's.
		Type    string `json:"type"`
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
	}
	if err := json.Unmarshal(body, &c); err != nil {
		t.Fatalf("answer %s: %v", body, err)
	}
	switch {
	case c.Type == "message" && len(c.Content) == 1:
		return c.Content[0].Text
	case len(c.Output) == 1 && len(c.Output[0].Content) == 1:
		return c.Output[0].Content[0].Text
	case len(c.Choices) == 1 && c.Choices[0].Text != nil:
		return *c.Choices[0].Text
	case len(c.Choices) == 1 && c.Choices[0].Message != nil:
		return c.Choices[0].Message.Content
	}
	t.Fatalf("answer %s has no one text", body)
	return ""
}

// usageTokens is a whole answer's prompt and completion tokens, of any API
// (the Responses API names them input and output tokens).
func usageTokens(t *testing.T, body []byte) (prompt, completion int) {
	t.Helper()
	var u struct {
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
			InputTokens      int `json:"input_tokens"`
			OutputTokens     int `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &u); err != nil {
		t.Fatalf("answer %s: %v", body, err)
	}
	return u.Usage.PromptTokens + u.Usage.InputTokens, u.Usage.CompletionTokens + u.Usage.OutputTokens
}
