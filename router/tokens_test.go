package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// engineTokenizer is a Tokenizer as cmd/proxy's calls an engine: a POST /tokenize through
// the client it is given. engine's own is not imported here: the router does not know it.
type engineTokenizer struct{}

func (engineTokenizer) Tokenize(ctx context.Context, client *http.Client, baseURL, model, prompt string, messages json.RawMessage) ([]uint32, error) {
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/tokenize", strings.NewReader(string(body)))
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("answered %d", resp.StatusCode)
	}
	var out struct{ Tokens []uint32 }
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, err
	}
	return out.Tokens, nil
}

// tokenizeEngine is an engine's POST /tokenize that says who asked it.
type tokenizeEngine struct {
	*httptest.Server
	mu    sync.Mutex
	auths []string
	hang  bool
}

func newTokenizeEngine(t *testing.T, hang bool) *tokenizeEngine {
	e := &tokenizeEngine{hang: hang}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/tokenize" || req.Method != http.MethodPost {
			http.NotFound(w, req)
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		e.mu.Lock()
		e.auths = append(e.auths, req.Header.Get("Authorization"))
		e.mu.Unlock()
		if e.hang {
			<-req.Context().Done()
			return
		}
		io.WriteString(w, `{"count":3,"max_model_len":4096,"tokens":[101,7592,102]}`)
	}))
	t.Cleanup(e.Close)
	return e
}

func (e *tokenizeEngine) calls() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.auths...)
}

func TestTokensAskTheLeastLoadedBackendWithItsOwnKey(t *testing.T) {
	busy, idle := newTokenizeEngine(t, false), newTokenizeEngine(t, false)
	r, _, _ := newTestRouter(t, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			{Name: "p0", URL: busy.URL, Role: routerconfig.RolePrefill, APIKey: "busy-key"},
			{Name: "d0", URL: idle.URL + "/", Role: routerconfig.RoleDecode, APIKey: "idle-key"},
		},
		EngineTokenizer: engineTokenizer{},
	})
	defer r.CloseIdleConnections()
	backendByName(t, r, "p0").st.inflight.Store(3)
	got, err := r.Tokens(context.Background(), TokenizeRequest{Model: "m", Prompt: "hello"})
	if err != nil || fmt.Sprint(got) != "[101 7592 102]" {
		t.Fatalf("Tokens = %v, %v; want [101 7592 102]", got, err)
	}
	if c := busy.calls(); len(c) != 0 {
		t.Errorf("the busy prefiller was asked %d times, want none", len(c))
	}
	if c := idle.calls(); len(c) != 1 || c[0] != "Bearer idle-key" {
		t.Errorf("the idle decoder was asked with %q, want once with its own key", c)
	}
}

func TestTokensGiveUpAfterTokenizeTimeout(t *testing.T) {
	e := newTokenizeEngine(t, true)
	r, _, _ := newTestRouter(t, routerconfig.Config{
		Backends:        []routerconfig.BackendConfig{{Name: "d0", URL: e.URL, Role: routerconfig.RoleDecode}},
		TokenizeTimeout: 50 * time.Millisecond,
		EngineTokenizer: engineTokenizer{},
	})
	defer r.CloseIdleConnections()
	start := time.Now()
	_, err := r.Tokens(context.Background(), TokenizeRequest{Prompt: "x"})
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "tokenize at d0") {
		t.Errorf("Tokens = %v, want the deadline, at d0", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Tokens took %v", d)
	}
}

func TestTokensWithNoBackendAvailable(t *testing.T) {
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0), EngineTokenizer: engineTokenizer{}})
	backendByName(t, r, "d0").st.up.Store(false)
	if _, err := r.Tokens(context.Background(), TokenizeRequest{Prompt: "x"}); !errors.Is(err, ErrNoTokenizer) {
		t.Errorf("Tokens = %v, want ErrNoTokenizer", err)
	}
}

func TestTokensWithoutATokenizerAskNoEngine(t *testing.T) {
	e := newTokenizeEngine(t, false)
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "d0", URL: e.URL, Role: routerconfig.RoleDecode}}})
	defer r.CloseIdleConnections()
	if _, err := r.Tokens(context.Background(), TokenizeRequest{Prompt: "x"}); !errors.Is(err, ErrNoTokenizer) {
		t.Errorf("Tokens = %v, want ErrNoTokenizer", err)
	}
	if c := e.calls(); len(c) != 0 {
		t.Errorf("the engine was asked %d times, want none", len(c))
	}
}
