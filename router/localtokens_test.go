package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// byteEngine is an engine whose POST /tokenize answers a prompt's bytes as its tokens,
// counting the calls.
type byteEngine struct {
	*httptest.Server
	calls atomic.Int64
}

func newByteEngine(t *testing.T) *byteEngine {
	e := &byteEngine{}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		var body struct{ Prompt string }
		if req.URL.Path != "/tokenize" || json.NewDecoder(req.Body).Decode(&body) != nil {
			http.NotFound(w, req)
			return
		}
		e.calls.Add(1)
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": byteTokens(body.Prompt, 0)})
	}))
	t.Cleanup(e.Close)
	return e
}

func byteTokens(s string, shift uint32) []uint32 {
	out := make([]uint32, len(s))
	for i := range len(s) {
		out[i] = uint32(s[i]) + shift
	}
	return out
}

// byteTokenizer tokenizes prompts as byteEngine does, its ids shifted by shift (a tokenizer
// of another vocabulary when not 0); it renders no chat.
type byteTokenizer struct{ shift uint32 }

func (b byteTokenizer) Tokenize(dst []uint32, prompt string, messages json.RawMessage, max int) ([]uint32, error) {
	if messages != nil {
		return dst, routerconfig.ErrNotLocal
	}
	if len(prompt) > max {
		return dst, routerconfig.ErrTooManyTokens
	}
	return append(dst, byteTokens(prompt, b.shift)...), nil
}

func (byteTokenizer) Chats() bool { return false }

func localConfig(e *byteEngine, shift uint32) routerconfig.Config {
	return routerconfig.Config{
		Backends:        []routerconfig.BackendConfig{{Name: "d0", URL: e.URL, Role: routerconfig.RoleDecode}},
		EngineTokenizer: engineTokenizer{},
		Tokenizers:      map[string]routerconfig.TokenizerFiles{"m": {File: "tokenizer.json"}},
		LocalTokenizers: map[string]routerconfig.LocalTokenizer{"m": byteTokenizer{shift: shift}},
	}
}

func TestTokensComeFromTheProxysTokenizerOnceAnEngineAgreesWithIt(t *testing.T) {
	e := newByteEngine(t)
	r, reg, _ := newTestRouter(t, localConfig(e, 0))
	defer r.CloseIdleConnections()
	ctx := context.Background()
	if _, err := r.Tokens(ctx, TokenizeRequest{Model: "m", Prompt: "before the check"}); err != nil || e.calls.Load() != 1 {
		t.Fatalf("Tokens before the check: %v, %d engine calls; want the engine's answer", err, e.calls.Load())
	}
	if err := r.CheckTokenizers(ctx); err != nil {
		t.Fatalf("CheckTokenizers: %v", err)
	}
	if v := testutil.Value(t, reg, "pdproxy_tokenizer_in_proxy", map[string]string{"model": "m"}); v != 1 {
		t.Errorf("pdproxy_tokenizer_in_proxy %v, want 1", v)
	}
	for _, tc := range []struct {
		name       string
		req        TokenizeRequest
		engineAsks int64
	}{
		{"a prompt of the model: the proxy tokenizes it", TokenizeRequest{Model: "m", Prompt: "hello world"}, 0},
		{"a chat the proxy's tokenizer leaves to the engine", TokenizeRequest{Model: "m", Messages: json.RawMessage(`[{"role":"user","content":"hi"}]`)}, 1},
		{"a model without a tokenizer of its own", TokenizeRequest{Model: "other", Prompt: "hello world"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := e.calls.Load()
			if _, err := r.Tokens(ctx, tc.req); err != nil {
				t.Fatal(err)
			}
			if n := e.calls.Load() - before; n != tc.engineAsks {
				t.Errorf("%d engine calls, want %d", n, tc.engineAsks)
			}
		})
	}
	got, _ := r.Tokens(ctx, TokenizeRequest{Model: "m", Prompt: "hello"})
	if !slices.Equal(got, byteTokens("hello", 0)) {
		t.Errorf("Tokens %v, want the tokenizer's", got)
	}
}

func TestATokenizerThatDisagreesWithTheEngineIsNotUsed(t *testing.T) {
	e := newByteEngine(t)
	r, reg, _ := newTestRouter(t, localConfig(e, 1))
	defer r.CloseIdleConnections()
	err := r.CheckTokenizers(context.Background())
	var mm *TokenizerMismatchError
	if !errors.As(err, &mm) || mm.Model != "m" || mm.Backend != "d0" || mm.At != 0 || mm.Sample.Prompt != CheckSamples[0].Prompt {
		t.Fatalf("CheckTokenizers: %v; want a mismatch of model m at d0 on the first sample, at token 0", err)
	}
	for _, want := range []string{"tokenizers.m", "d0", "disagree", CheckSamples[0].Prompt} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if v := testutil.Value(t, reg, "pdproxy_tokenizer_in_proxy", map[string]string{"model": "m"}); v != 0 {
		t.Errorf("pdproxy_tokenizer_in_proxy %v, want 0", v)
	}
	before := e.calls.Load()
	if got, err := r.Tokens(context.Background(), TokenizeRequest{Model: "m", Prompt: "hi"}); err != nil || !slices.Equal(got, byteTokens("hi", 0)) || e.calls.Load() != before+1 {
		t.Errorf("Tokens = %v, %v with %d engine calls; want the engine's", got, err, e.calls.Load()-before)
	}
}

func TestAReloadMayNotChangeTheTokenizers(t *testing.T) {
	e := newByteEngine(t)
	cfg := localConfig(e, 0)
	r, _, _ := newTestRouter(t, cfg)
	defer r.CloseIdleConnections()
	if err := r.Reload(cfg); err != nil {
		t.Fatalf("a reload of the same tokenizers: %v", err)
	}
	cfg.Tokenizers = map[string]routerconfig.TokenizerFiles{"m": {File: "other.json"}}
	if err := r.Reload(cfg); err == nil || !strings.Contains(err.Error(), "tokenizers are read at start") {
		t.Errorf("Reload = %v, want it refused", err)
	}
}

// A prompt of more tokens than tokenize_max_tokens is no engine's to take whole: the proxy
// tokenizes it no further than that, answers routerconfig.ErrTooManyTokens (the request is scored by its
// text), and asks no engine for its tokens either. A reload changes the limit.
func TestAPromptOfMoreTokensThanTheLimitIsScoredByItsText(t *testing.T) {
	e := newByteEngine(t)
	cfg := localConfig(e, 0)
	cfg.TokenizeMaxTokens = 16
	r, _, _ := newTestRouter(t, cfg)
	defer r.CloseIdleConnections()
	ctx := context.Background()
	if err := r.CheckTokenizers(ctx); err != nil {
		t.Fatalf("CheckTokenizers: %v (its samples are longer than the limit: it has none)", err)
	}
	check := func(prompt string, wantTokens bool) {
		t.Helper()
		before := e.calls.Load()
		got, err := r.Tokens(ctx, TokenizeRequest{Model: "m", Prompt: prompt})
		switch {
		case e.calls.Load() != before:
			t.Errorf("%d bytes: an engine was asked for the tokens", len(prompt))
		case wantTokens && (err != nil || !slices.Equal(got, byteTokens(prompt, 0))):
			t.Errorf("%d bytes: Tokens %v, %v; want the prompt's", len(prompt), got, err)
		case !wantTokens && (!errors.Is(err, routerconfig.ErrTooManyTokens) || got != nil):
			t.Errorf("%d bytes: Tokens %v, %v; want ErrTooManyTokens", len(prompt), got, err)
		}
	}
	check(strings.Repeat("x", 16), true)
	check(strings.Repeat("x", 17), false)
	cfg.TokenizeMaxTokens = 32
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	check(strings.Repeat("x", 17), true)
	check(strings.Repeat("x", 33), false)
}

func TestTokenizeMaxTokensFromYAML(t *testing.T) {
	for _, tc := range []struct {
		doc  string
		want int
		bad  bool
	}{
		{"tokenize_max_tokens: 262144\n", 262144, false},
		{"tokenizer: engine\n", routerconfig.DefaultTokenizeMaxTokens, false},
		{"tokenize_max_tokens: -1\n", 0, true},
	} {
		var c routerconfig.Config
		if err := yaml.Unmarshal([]byte(tc.doc), &c); err != nil {
			t.Fatal(err)
		}
		c.Backends = backendsCfg(routerconfig.RoleDecode, "d", 1, 0)
		err := c.Validate()
		if tc.bad {
			if err == nil || !strings.Contains(err.Error(), "tokenize_max_tokens") {
				t.Errorf("%q: Validate = %v, want tokenize_max_tokens refused", tc.doc, err)
			}
			continue
		}
		if err != nil || c.TokenizeMaxTokens != tc.want {
			t.Errorf("%q: Validate = %v, tokenize_max_tokens %d; want %d", tc.doc, err, c.TokenizeMaxTokens, tc.want)
		}
	}
}

func TestTokenizersFromYAML(t *testing.T) {
	var c routerconfig.Config
	doc := "tokenizers:\n  llama-3-8b: {file: /m/tokenizer.json, chat_template: /m/tokenizer_config.json}\n  qwen: {chat_template: /q/chat.jinja}\n"
	if err := yaml.Unmarshal([]byte(doc), &c); err != nil {
		t.Fatal(err)
	}
	if want := (routerconfig.TokenizerFiles{File: "/m/tokenizer.json", ChatTemplate: "/m/tokenizer_config.json"}); c.Tokenizers["llama-3-8b"] != want {
		t.Errorf("tokenizers.llama-3-8b = %+v, want %+v", c.Tokenizers["llama-3-8b"], want)
	}
	c.Backends = backendsCfg(routerconfig.RoleDecode, "d", 1, 0)
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "tokenizers.qwen.file") {
		t.Errorf("Validate = %v, want tokenizers.qwen.file refused", err)
	}
}

// Tokens handed back with ReturnTokens are tokenized into again: each request, however
// many run at once, gets its own prompt's tokens, never another's or a part of one.
func TestReturnedTokensServeTheNextRequestAlone(t *testing.T) {
	e := newByteEngine(t)
	r, _, _ := newTestRouter(t, localConfig(e, 0))
	defer r.CloseIdleConnections()
	ctx := context.Background()
	if err := r.CheckTokenizers(ctx); err != nil {
		t.Fatalf("CheckTokenizers: %v", err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 {
				// Three requests in flight at once, of lengths that shrink and grow, so that a
				// buffer handed back long is reused short.
				var prompts [3]string
				var got [3][]uint32
				for k := range prompts {
					prompts[k] = strings.Repeat(fmt.Sprintf("g%d-%d-%d ", g, i, k), 1+(i*7+g+k*5)%13)
					var err error
					if got[k], err = r.Tokens(ctx, TokenizeRequest{Model: "m", Prompt: prompts[k]}); err != nil {
						t.Error(err)
						return
					}
				}
				for k, p := range prompts {
					if want := byteTokens(p, 0); !slices.Equal(got[k], want) {
						t.Errorf("Tokens(%q) = %v, want %v", p, got[k], want)
						return
					}
					r.ReturnTokens(got[k])
				}
			}
		}()
	}
	wg.Wait()
	checks := int64(0)
	for _, s := range CheckSamples {
		if s.Messages == nil {
			checks++ // byteTokenizer renders no chat: the check asks the prompts alone
		}
	}
	if n := e.calls.Load(); n != checks {
		t.Errorf("%d engine /tokenize calls, want the check's %d alone", n, checks)
	}
}
