package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// testTokenizer is the small byte-level BPE shipped for tests, with its ChatML template.
const (
	testTokenizer = "../internal/hftok/testdata/tokenizer.json"
	testTemplate  = "../internal/hftok/testdata/tokenizer_config.json"
)

// startCountingSim runs a simulated engine like startSim, counting the POST /tokenize
// calls it answers.
func startCountingSim(t *testing.T, cfg sim.Config, tokenizes *atomic.Int64) (*sim.Engine, string) {
	t.Helper()
	e, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	h := e.Handler()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.URL.Path == "/tokenize" {
			tokenizes.Add(1)
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim: %v", err)
		}
		e.CloseIdleConnections()
	})
	return e, srv.URL
}

// TestPreciseRoutingWithTheProxysTokenizer runs a conversation's two turns through a
// prefiller and two decoders that tokenize with one tokenizer.json and publish their KV
// events, behind precise_cache_aware with the same file in the proxy: the proxy checks its
// tokenizer at the start (its only /tokenize calls), then tokenizes each turn itself, and the
// second turn goes to the decoder that pulled the first, which serves it alone from its cache
// (decode-only, reason cached: the proxy had the tokens and matched them to the decoder's
// blocks) without one /tokenize call.
func TestPreciseRoutingWithTheProxysTokenizer(t *testing.T) {
	var tokenizes atomic.Int64
	base := sim.DefaultConfig()
	base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
	base.Tokenizer = testTokenizer
	pcfg := base
	pcfg.Role = "prefill"
	p, pURL := startCountingSim(t, pcfg, &tokenizes)
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	cfg.Proxy.PDUncachedTokenThreshold = 64
	cfg.Router.DecodePolicy = routerconfig.PolicyPreciseCacheAware
	cfg.Router.Tokenizers = map[string]routerconfig.TokenizerFiles{"sim": {File: testTokenizer, ChatTemplate: testTemplate}}
	cfg.Router.Backends = []routerconfig.BackendConfig{{Name: "p0", URL: pURL, Role: routerconfig.RolePrefill, Engine: "sim"}}
	decoders := map[string]*sim.Engine{}
	for i := range 2 {
		port := freePort(t)
		dcfg := base
		dcfg.Role = "decode"
		dcfg.KVEventsEndpoint = fmt.Sprintf("tcp://*:%d", port)
		d, dURL := startCountingSim(t, dcfg, &tokenizes)
		name := fmt.Sprintf("d%d", i)
		decoders[name] = d
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: name, URL: dURL, Role: routerconfig.RoleDecode, Engine: "sim",
			KVEventsEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port)})
	}
	s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
	if v := testutil.Value(t, s.m.Registry, "pdproxy_tokenizer_in_proxy", map[string]string{"model": "sim"}); v != 1 {
		t.Fatalf("pdproxy_tokenizer_in_proxy %v after the start, want 1: the check did not pass", v)
	}
	checks := tokenizes.Load()
	if checks == 0 {
		t.Fatal("the proxy started without asking an engine's /tokenize to check its tokenizer")
	}

	system := strings.Repeat("You are a helpful assistant. The proxy sends a request to the engine that already holds its prompt. ", 12)
	turn := func(n int) string {
		msgs := []map[string]string{{"role": "system", "content": system}}
		for i := range n {
			msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("What is the capital of France? (%d)", i)})
			if i < n-1 {
				msgs = append(msgs, map[string]string{"role": "assistant", "content": "The capital of France is Paris."})
			}
		}
		b, _ := json.Marshal(map[string]any{"model": "sim", "messages": msgs, "max_tokens": 4})
		return string(b)
	}
	ask := func(body string) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp := post(t, ctx, s.url+"/v1/chat/completions", body)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
	}
	ask(turn(1))
	var first string
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		for _, b := range s.m.Router.Backends() {
			if b.PrefixCache != nil && b.PrefixCache.Blocks != nil && *b.PrefixCache.Blocks > 0 {
				first = b.Name
				return true, ""
			}
		}
		return false, "the proxy knows of no decoder's blocks"
	})
	before := decoders[first].Stats().RequestsTotal
	ask(turn(2))
	if n := tokenizes.Load() - checks; n != 0 {
		t.Errorf("%d /tokenize calls for the two turns, want none: the proxy tokenizes them itself", n)
	}
	if got := decoders[first].Stats().RequestsTotal - before; got != 1 {
		t.Errorf("the decoder holding turn 1 (%s) took %d requests of turn 2, want it", first, got)
	}
	if cached := metricValue(t, s.url, `pdproxy_decode_only_total{reason="cached"}`); cached != 1 {
		t.Errorf("%v requests decode-only by cache, want turn 2: the proxy matched its tokens to the decoder's blocks", cached)
	}
	if n := p.Stats().RequestsTotal; n != 1 {
		t.Errorf("%d prefills, want turn 1's alone", n)
	}
	// Turns at once: each is tokenized into a buffer the proxy hands back once it is served.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			resp, err := http.Post(s.url+"/v1/chat/completions", "application/json", strings.NewReader(turn(3+i%3)))
			if err != nil {
				t.Error(err)
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("status %d: %s", resp.StatusCode, b)
			}
		})
	}
	wg.Wait()
	if n := tokenizes.Load() - checks; n != 0 {
		t.Errorf("%d /tokenize calls for the turns at once, want none", n)
	}
}
