package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

const (
	testTokenizer = "../../../internal/hftok/testdata/tokenizer.json"
	testTemplate  = "../../../internal/hftok/testdata/tokenizer_config.json"
)

// tokenizerConfig is one prefiller and one decoder, in-process sims tokenizing with
// simTokenizer (empty: the sim's own), behind precise_cache_aware with the test tokenizer
// in the proxy for model sim.
func tokenizerConfig(simTokenizer string) Config {
	c := Config{Listen: "127.0.0.1:0"}
	c.Router.DecodePolicy = routerconfig.PolicyPreciseCacheAware
	c.Router.Health.Interval = -1
	c.Router.KVEvents.Listen = "tcp://127.0.0.1:0" // what precise_cache_aware reads; no engine publishes here
	c.Router.Tokenizers = map[string]routerconfig.TokenizerFiles{"sim": {File: testTokenizer, ChatTemplate: testTemplate}}
	for _, role := range []string{"prefill", "decode"} {
		c.Sims = append(c.Sims, SimConfig{Role: role, Tokenizer: simTokenizer})
	}
	return c
}

func startMain(t *testing.T, cfg Config, logger *zap.Logger) (*Main, error) {
	t.Helper()
	m, err := New(cfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		return nil, err
	}
	t.Cleanup(func() {
		if err := m.Shutdown(context.Background()); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return m, nil
}

func inProxy(t *testing.T, m *Main) float64 {
	t.Helper()
	return testutil.Value(t, m.Registry, "pdproxy_tokenizer_in_proxy", map[string]string{"model": "sim"})
}

func TestStartChecksTheProxysTokenizerAgainstAnEngine(t *testing.T) {
	t.Run("the same file as the engines': the proxy tokenizes the model itself", func(t *testing.T) {
		m, err := startMain(t, tokenizerConfig(testTokenizer), zaptest.NewLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		if v := inProxy(t, m); v != 1 {
			t.Errorf("pdproxy_tokenizer_in_proxy %v, want 1", v)
		}
	})
	t.Run("another tokenizer than the engines': the start is refused, naming the sample", func(t *testing.T) {
		_, err := startMain(t, tokenizerConfig(""), zaptest.NewLogger(t))
		if err == nil {
			t.Fatal("Start accepted a tokenizer the engines do not use")
		}
		for _, want := range []string{"tokenizers.sim", "disagree", `prompt "The capital of France is Paris."`, "first differing at token 0"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Start: %v; want it to say %q", err, want)
			}
		}
	})
}

func TestStartRefusesTokenizerFilesItCannotUse(t *testing.T) {
	dir := t.TempDir()
	notBPE := filepath.Join(dir, "wordpiece.json")
	noTemplate := filepath.Join(dir, "tokenizer_config.json")
	badTemplate := filepath.Join(dir, "chat.jinja")
	for path, data := range map[string]string{
		notBPE:      `{"model":{"type":"WordPiece","vocab":{"a":0}}}`,
		noTemplate:  `{"bos_token":"<s>"}`,
		badTemplate: `{% for m in messages %}{{ m.content }}`,
	} {
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name string
		edit func(c *Config)
		want []string
	}{
		{"a missing tokenizer.json", func(c *Config) {
			c.Router.Tokenizers["sim"] = routerconfig.TokenizerFiles{File: filepath.Join(dir, "none.json")}
		}, []string{"tokenizers.sim.file", "none.json"}},
		{"a model the proxy cannot reproduce", func(c *Config) {
			c.Router.Tokenizers["sim"] = routerconfig.TokenizerFiles{File: notBPE}
		}, []string{"tokenizers.sim.file", "wordpiece.json", "only BPE"}},
		{"a tokenizer_config.json without a template", func(c *Config) {
			c.Router.Tokenizers["sim"] = routerconfig.TokenizerFiles{File: testTokenizer, ChatTemplate: noTemplate}
		}, []string{"tokenizers.sim.chat_template", "no chat_template"}},
		{"a template that does not parse", func(c *Config) {
			c.Router.Tokenizers["sim"] = routerconfig.TokenizerFiles{File: testTokenizer, ChatTemplate: badTemplate}
		}, []string{"tokenizers.sim.chat_template", "chat.jinja"}},
		{"no file", func(c *Config) { c.Router.Tokenizers["sim"] = routerconfig.TokenizerFiles{ChatTemplate: testTemplate} }, []string{"tokenizers.sim.file", "required"}},
		{"nothing that tokenizes requests", func(c *Config) { c.Router.DecodePolicy = "" }, []string{"tokenizers", "precise_cache_aware", "pd_uncached_token_threshold"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tokenizerConfig(testTokenizer)
			tc.edit(&c)
			_, err := startMain(t, c, zaptest.NewLogger(t))
			if err == nil {
				t.Fatal("Start accepted it")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Start: %v; want it to say %q", err, w)
				}
			}
		})
	}
}

// With no engine answering at the start, the proxy starts, routing on the engines'
// /tokenize, and checks its tokenizer at the first engine that answers: agreeing, it
// tokenizes the model itself from then on; disagreeing, it logs why and leaves the model's
// tokenizing to the engines.
func TestWithNoEngineAtTheStartTheTokenizerIsCheckedAtTheFirst(t *testing.T) {
	for _, tc := range []struct {
		name         string
		simTokenizer string
		agree        bool
	}{
		{"an engine of the same file comes up: the proxy tokenizes", testTokenizer, true},
		{"an engine of another tokenizer comes up: the engines keep tokenizing", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			addr := ln.Addr().String()
			ln.Close() // nothing answers there until the engine starts
			c := tokenizerConfig(testTokenizer)
			c.Sims = nil
			c.Router.Backends = []routerconfig.BackendConfig{
				{Name: "p0", URL: "http://" + addr, Role: routerconfig.RolePrefill, Engine: "sim"},
				{Name: "d0", URL: "http://" + addr, Role: routerconfig.RoleDecode, Engine: "sim"},
			}
			core, logs := observer.New(zap.InfoLevel)
			m, err := startMain(t, c, zap.New(core))
			if err != nil {
				t.Fatalf("Start with no engine up: %v", err)
			}
			if v := inProxy(t, m); v != 0 {
				t.Fatalf("pdproxy_tokenizer_in_proxy %v before any engine answered, want 0", v)
			}
			scfg := sim.DefaultConfig()
			scfg.Tokenizer = tc.simTokenizer
			e, err := sim.New(scfg, zaptest.NewLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			ln, err = net.Listen("tcp", addr)
			if err != nil {
				t.Fatalf("listen again on %s: %v", addr, err)
			}
			srv := httptest.NewUnstartedServer(e.Handler())
			srv.Listener.Close()
			srv.Listener = ln
			srv.Start()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- e.Run(ctx) }()
			t.Cleanup(func() {
				srv.Close()
				cancel()
				<-done
				e.CloseIdleConnections()
			})
			want := "tokenizing in the proxy"
			if !tc.agree {
				want = "disagrees with an engine"
			}
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				return logs.FilterMessageSnippet(want).Len() > 0, "no log saying " + want
			})
			if v, w := inProxy(t, m), map[bool]float64{true: 1, false: 0}[tc.agree]; v != w {
				t.Errorf("pdproxy_tokenizer_in_proxy %v, want %v", v, w)
			}
		})
	}
}

// A completion whose prompt is 8,000,000 spaces (a body within the default 10 MiB limit),
// routed by precise_cache_aware with the proxy's own tokenizer, is tokenized no further than
// tokenize_max_tokens: the request is answered (the engine refuses the prompt, as vLLM does
// one longer than its max_model_len), having cost the proxy some copies of its body, not
// the gigabyte a merge of the one 8 MB word took.
func TestAPromptOfMegabytesCostsTheProxyCopiesOfItsBodyNotAGigabyte(t *testing.T) {
	// engine is a sim that tokenizes with the test tokenizer (the proxy's check of its own
	// against it) and refuses every completion without reading it into memory: what the
	// proxy allocates is its own.
	engine := func() string {
		scfg := sim.DefaultConfig()
		scfg.Tokenizer = testTokenizer
		e, err := sim.New(scfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		h := e.Handler()
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v1/completions" {
				h.ServeHTTP(w, r)
				return
			}
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"the prompt is longer than the maximum model length","type":"BadRequestError","code":400}}`)
		}))
		t.Cleanup(srv.Close)
		return srv.URL
	}
	c := Config{Listen: "127.0.0.1:0"}
	c.Router.PrefillPolicy, c.Router.DecodePolicy = routerconfig.PolicyPreciseCacheAware, routerconfig.PolicyPreciseCacheAware
	c.Router.Health.Interval = -1
	c.Router.KVEvents.Listen = "tcp://127.0.0.1:0"
	c.Router.Tokenizers = map[string]routerconfig.TokenizerFiles{"sim": {File: testTokenizer, ChatTemplate: testTemplate}}
	c.Router.Backends = []routerconfig.BackendConfig{
		{Name: "p0", URL: engine(), Role: routerconfig.RolePrefill, Engine: "sim"},
		{Name: "d0", URL: engine(), Role: routerconfig.RoleDecode, Engine: "sim"},
	}
	m, err := startMain(t, c, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	if v := inProxy(t, m); v != 1 {
		t.Fatalf("pdproxy_tokenizer_in_proxy %v, want 1: the proxy does not tokenize the model", v)
	}
	prompt := strings.Repeat(" ", 8_000_000)

	t.Run("the router's tokens: none, at the cost of 131,072", func(t *testing.T) {
		var toks []uint32
		var err error
		total := allocated(func() {
			toks, err = m.Router.Tokens(context.Background(), router.TokenizeRequest{Model: "sim", Prompt: prompt})
		})
		if !errors.Is(err, routerconfig.ErrTooManyTokens) || toks != nil {
			t.Errorf("Tokens: %d tokens, %v; want ErrTooManyTokens", len(toks), err)
		}
		if total > 8<<20 {
			t.Errorf("tokenizing the prompt allocated %d MiB, want at most 8", total>>20)
		}
	})
	t.Run("the request", func(t *testing.T) {
		body, _ := json.Marshal(map[string]any{"model": "sim", "prompt": prompt, "max_tokens": 4})
		var status int
		var answer []byte
		total := allocated(func() {
			resp, err := http.Post(m.URL()+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			answer, _ = io.ReadAll(resp.Body)
			resp.Body.Close()
			status = resp.StatusCode
		})
		if status != http.StatusBadRequest || !strings.Contains(string(answer), "maximum model length") {
			t.Errorf("status %d, %s; want the engine's refusal", status, answer)
		}
		// The proxy reads the body, decodes the prompt, and writes each leg's edited body
		// (some ten copies in all, with their buffers' growth); tokenizing it merged one
		// word of 8 MB, some 125 copies.
		t.Logf("the request of %d bytes allocated %d MiB", len(body), total>>20)
		if total > 16*int64(len(body)) {
			t.Errorf("the request of %d MiB allocated %d MiB, want at most 16 times its body", len(body)>>20, total>>20)
		}
	})
}

// allocated is what f allocates on the heap, in all.
func allocated(f func()) int64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return int64(after.TotalAlloc - before.TotalAlloc)
}

// testLocalTokenizer is the proxy's tokenizer of model sim: the test tokenizer and template.
func testLocalTokenizer(t testing.TB) routerconfig.LocalTokenizer {
	t.Helper()
	local, err := LoadTokenizers(tokenizerConfig("").Proxy, tokenizerConfig("").Router)
	if err != nil {
		t.Fatal(err)
	}
	return local["sim"]
}

// tokenizingSim is a sim engine tokenizing with the test tokenizer, its /tokenize the truth
// the proxy's tokens are held to.
func tokenizingSim(t testing.TB) *httptest.Server {
	scfg := sim.DefaultConfig()
	scfg.Tokenizer = testTokenizer
	e, err := sim.New(scfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(e.Handler())
	t.Cleanup(srv.Close)
	return srv
}

// engineTokens is the answer of the engine at url's POST /tokenize to body.
func engineTokens(t testing.TB, url string, body any) []uint32 {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+"/tokenize", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	var ans struct {
		Tokens []uint32 `json:"tokens"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(data, &ans) != nil {
		t.Fatalf("/tokenize %s: %d %s", b, resp.StatusCode, data)
	}
	return ans.Tokens
}

// FuzzTheProxysTokensAreTheEnginesTokens: on any prompt and any conversation of plain
// messages, the proxy's tokenizer (the file, the template rendered by a Jinja engine) gives
// the tokens a sim reading the same file answers on /tokenize (ChatML written out by hand).
func FuzzTheProxysTokensAreTheEnginesTokens(f *testing.F) {
	tok := testLocalTokenizer(f)
	srv := tokenizingSim(f)
	engine := func(t *testing.T, body any) []uint32 { return engineTokens(t, srv.URL, body) }
	for _, s := range []string{"The capital of France is Paris.", "  two  spaces\n\n\tand tabs ", "<|im_start|>inline<|im_end|>", "東京 🙂 naïve", "it's 12345 'LL"} {
		f.Add(s, "a reply\n", "system")
	}
	f.Fuzz(func(t *testing.T, text, reply, role string) {
		if !utf8.ValidString(text) || !utf8.ValidString(reply) || !utf8.ValidString(role) || role == "" || text == "" {
			return
		}
		own, err := tok.Tokenize(nil, text, nil, math.MaxInt)
		if err != nil {
			t.Fatal(err)
		}
		if theirs := engine(t, map[string]any{"prompt": text}); !slices.Equal(own, theirs) {
			t.Fatalf("prompt %q: proxy %v, engine %v", text, own, theirs)
		}
		msgs := []map[string]string{{"role": role, "content": text}, {"role": "assistant", "content": reply}, {"role": "user", "content": text + reply}}
		raw, _ := json.Marshal(msgs)
		own, err = tok.Tokenize(nil, "", raw, math.MaxInt)
		if err != nil {
			t.Fatal(err)
		}
		if theirs := engine(t, map[string]any{"messages": msgs}); !slices.Equal(own, theirs) {
			t.Fatalf("chat %s: proxy %v, engine %v", raw, own, theirs)
		}
	})
}

// Messages the template would see otherwise than the engine does are left to the engine.
func TestChatsOfMoreThanPlainMessagesAreTheEnginesToTokenize(t *testing.T) {
	tok := testLocalTokenizer(t)
	for _, msgs := range []string{
		`[{"role":"user","content":[{"type":"text","text":"hi"}]}]`,
		`[{"role":"user","content":null}]`,
		`[{"role":"assistant","content":"","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]}]`,
		`[{"role":"user","content":"hi","name":"bob"}]`,
		`[]`,
		`{"role":"user"}`,
	} {
		t.Run(msgs, func(t *testing.T) {
			if _, err := tok.Tokenize(nil, "", json.RawMessage(msgs), math.MaxInt); err != routerconfig.ErrNotLocal {
				t.Errorf("Tokenize: %v, want ErrNotLocal", err)
			}
		})
	}
}

// The proxy renders each chat into a buffer it reuses and tokenizes into the caller's: chats
// tokenized at once, and one after another into the buffers of chats before them, each get
// the engine's tokens for their own messages.
func TestChatsTokenizedIntoReusedBuffersAreTheirOwn(t *testing.T) {
	tok := testLocalTokenizer(t)
	srv := tokenizingSim(t)
	type chat struct {
		raw  json.RawMessage
		want []uint32
	}
	var chats []chat
	for s := range 3 {
		// System prompts long enough for the tokenizer to cache, and questions of every length.
		system := strings.Repeat(fmt.Sprintf("System prompt %d: answer briefly and cite nothing. ", s), 4+4*s)
		for q := range 6 {
			msgs := []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": strings.Repeat(fmt.Sprintf("question %d of %d? ", q, s), 1+q*q)}}
			raw, _ := json.Marshal(msgs)
			chats = append(chats, chat{raw, engineTokens(t, srv.URL, map[string]any{"messages": msgs})})
		}
	}
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var free [][]uint32 // the buffers of chats tokenized before
			for i := range 60 {
				var got [2][]uint32
				var of [2]chat
				for k := range got {
					of[k] = chats[(i*5+g*7+k*11)%len(chats)]
					var dst []uint32
					if len(free) > 0 {
						dst, free = free[len(free)-1][:0], free[:len(free)-1]
					}
					var err error
					if got[k], err = tok.Tokenize(dst, "", of[k].raw, math.MaxInt); err != nil {
						t.Error(err)
						return
					}
				}
				for k := range got {
					if !slices.Equal(got[k], of[k].want) {
						t.Errorf("chat %s: %d tokens, want the engine's %d", of[k].raw, len(got[k]), len(of[k].want))
						return
					}
					free = append(free, got[k])
				}
			}
		}()
	}
	wg.Wait()
}
