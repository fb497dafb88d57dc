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
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
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

// sseEvents splits an SSE body into its data payloads.
func sseEvents(t *testing.T, body []byte) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
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

// streamText joins the token texts of a completions or chat stream and
// returns the finish reason; it fails the test on an error event.
func streamText(t *testing.T, events []string) (text, finish string) {
	t.Helper()
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
