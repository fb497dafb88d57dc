package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// startSimServer runs a Server on a free loopback port, closed when the test ends.
func startSimServer(t *testing.T, cfg Config) (*Server, *http.Client) {
	t.Helper()
	s, err := Listen(cfg, "127.0.0.1:0", zaptest.NewLogger(t))
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		client.CloseIdleConnections()
	})
	return s, client
}

// cutMark is the last event openStream hands over for a body whose
// connection broke before its end (an unexpected EOF, a reset).
const cutMark = "<connection cut>"

// openStream posts a streamed completion and returns its events as they
// come, then cutMark if the body broke off; the channel closes when the
// body ends.
func openStream(t *testing.T, client *http.Client, url, body string, hdr map[string]string) <-chan string {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	events := make(chan string, 1024)
	go func() {
		defer close(events)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				events <- data
			}
		}
		if sc.Err() != nil {
			events <- cutMark
		}
	}()
	return events
}

// drainEvents reads events to their end.
func drainEvents(t *testing.T, events <-chan string) []string {
	t.Helper()
	var out []string
	deadline := time.After(testutil.Timeout)
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				return out
			}
			out = append(out, ev)
		case <-deadline:
			t.Fatalf("stream did not end; got %d events", len(out))
		}
	}
}

func status(t *testing.T, client *http.Client, method, url, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestDieAfterKillsTheWholeEngineAndRestartBringsBackAnEmptyOne(t *testing.T) {
	cfg := fastConfig()
	cfg.ITL = 5 * time.Millisecond
	s, client := startSimServer(t, cfg)
	warm := `{"prompt":"` + strings.Repeat("hello world ", 20) + `","max_tokens":1}`
	if code, b := status(t, client, http.MethodPost, s.URL()+"/v1/completions", warm); code != http.StatusOK {
		t.Fatalf("warm-up: %d %s", code, b)
	}
	oldID := s.Engine().ID()
	bystander := openStream(t, client, s.URL(), `{"prompt":"hi","max_tokens":100000,"ignore_eos":true,"stream":true}`, nil)
	<-bystander // it streams
	dying := drainEvents(t, openStream(t, client, s.URL(), `{"prompt":"bye","max_tokens":50,"ignore_eos":true,"stream":true}`, map[string]string{HeaderDieAfter: "3"}))
	if len(dying) != 4 || dying[3] != cutMark {
		t.Errorf("the dying stream sent %q, want its 3 tokens and a cut connection", dying)
	}
	testutil.Recv(t, testutil.Timeout, s.Died(), "the engine's death")
	checkCut(t, "a stream open when the engine died", drainEvents(t, bystander))
	if c, err := net.Dial("tcp", s.Addr()); err == nil {
		c.Close()
		t.Error("a dead engine accepted a connection")
	}

	if err := s.Restart(); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	if code, _ := status(t, client, http.MethodGet, s.URL()+"/health", ""); code != http.StatusOK {
		t.Errorf("restarted /health: %d", code)
	}
	if s.Engine().ID() == oldID {
		t.Errorf("the restarted engine kept the engine id %s", oldID)
	}
	_, b := status(t, client, http.MethodPost, s.URL()+"/v1/completions", warm)
	if _, cached := usageCached(t, b); cached != 0 {
		t.Errorf("the restarted engine's cache held %d tokens of the warm prompt, want an empty cache", cached)
	}
}

// checkCut fails the test unless evs broke off mid-answer: tokens, no
// [DONE], no error event, a cut connection.
func checkCut(t *testing.T, what string, evs []string) {
	t.Helper()
	if len(evs) == 0 || evs[len(evs)-1] != cutMark {
		t.Errorf("%s ended cleanly: %d events, the last %q", what, len(evs), evs[max(len(evs)-1, 0):])
		return
	}
	for _, ev := range evs {
		if ev == "[DONE]" || strings.Contains(ev, `"error"`) {
			t.Errorf("%s sent %q before its cut", what, ev)
		}
	}
}

func usageCached(t *testing.T, body string) (int, int) {
	t.Helper()
	var u struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(body), &u); err != nil {
		t.Fatalf("answer %s: %v", body, err)
	}
	return u.Usage.PromptTokens, u.Usage.PromptTokensDetails.CachedTokens
}

func TestDieAfterNeedsAServerToDie(t *testing.T) {
	ts := startServer(t, fastConfig())
	resp := ts.post(t, context.Background(), "/v1/completions", `{"prompt":"hi","max_tokens":3}`, map[string]string{HeaderDieAfter: "1"})
	if b := readAll(t, resp); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("die-after on an engine no Server runs: %d %s, want 400", resp.StatusCode, b)
	}
}

func TestDrainRefusesNewWorkAndCutsWhatOutlivesTheGrace(t *testing.T) {
	cfg := fastConfig()
	cfg.ITL = 5 * time.Millisecond
	s, client := startSimServer(t, cfg)
	short := openStream(t, client, s.URL(), `{"prompt":"hi","max_tokens":20,"ignore_eos":true,"stream":true}`, nil)
	long := openStream(t, client, s.URL(), `{"prompt":"hi","max_tokens":100000,"ignore_eos":true,"stream":true}`, nil)
	<-short
	<-long
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		s.Engine().Drain(3 * time.Second)
	}()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		code, _ := status(t, client, http.MethodGet, s.URL()+"/health", "")
		return code == http.StatusServiceUnavailable, "health still answers " + http.StatusText(code)
	})
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/completions", `{"prompt":"hi","max_tokens":1}`},
		{http.MethodPost, "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`},
		{http.MethodGet, "/v1/models", ""},
	} {
		code, b := status(t, client, tc.method, s.URL()+tc.path, tc.body)
		if code != http.StatusServiceUnavailable || !strings.Contains(b, `"error":"Server is unavailable. Please try again later."`) {
			t.Errorf("%s %s while draining: %d %s, want vLLM's 503", tc.method, tc.path, code, b)
		}
	}
	for _, path := range []string{"/live", "/metrics"} {
		if code, _ := status(t, client, http.MethodGet, s.URL()+path, ""); code != http.StatusOK {
			t.Errorf("GET %s while draining: %d, want 200", path, code)
		}
	}
	if evs := drainEvents(t, short); len(evs) == 0 || evs[len(evs)-1] != "[DONE]" {
		t.Errorf("an in-flight stream that ends within the grace ended with %q, want [DONE]", evs)
	}
	checkCut(t, "a stream outliving the grace", drainEvents(t, long))
	testutil.Recv(t, testutil.Timeout, drained, "Drain's return")
}
