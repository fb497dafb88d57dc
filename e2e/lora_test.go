package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// leg is one completion an engine was sent: the model it named and what of
// kv_transfer_params it carried.
type leg struct {
	model string
	// prefill: do_remote_decode (a prefill leg); pull: remote_block_ids (a decode leg that
	// pulls a prefiller's KV).
	prefill, pull bool
}

// legRecorder keeps the completions that reached one engine.
type legRecorder struct {
	mu   sync.Mutex
	legs []leg
}

func (lr *legRecorder) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/completions" || r.URL.Path == "/v1/chat/completions" {
			b, _ := io.ReadAll(r.Body)
			r.Body = io.NopCloser(bytes.NewReader(b))
			var body struct {
				Model string `json:"model"`
				KV    *struct {
					DoRemoteDecode bool            `json:"do_remote_decode"`
					RemoteBlockIDs json.RawMessage `json:"remote_block_ids"`
				} `json:"kv_transfer_params"`
			}
			_ = json.Unmarshal(b, &body)
			l := leg{model: body.Model}
			if body.KV != nil {
				l.prefill = body.KV.DoRemoteDecode
				l.pull = len(body.KV.RemoteBlockIDs) > 0 && string(body.KV.RemoteBlockIDs) != "null"
			}
			lr.mu.Lock()
			lr.legs = append(lr.legs, l)
			lr.mu.Unlock()
		}
		h.ServeHTTP(w, r)
	})
}

func (lr *legRecorder) all() []leg {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	return slices.Clone(lr.legs)
}

// startRecordedSim runs a simulated engine with cfg behind a legRecorder until the test ends.
func startRecordedSim(t *testing.T, cfg sim.Config) (*sim.Engine, string, *legRecorder) {
	t.Helper()
	e, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	lr := &legRecorder{}
	srv := httptest.NewServer(lr.wrap(e.Handler()))
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim: %v", err)
		}
		e.CloseIdleConnections()
	})
	return e, srv.URL, lr
}

// An adapter's request under P/D is prefilled and decoded only by engines that serve the
// adapter, whichever engine the cost rule would find cheaper; both legs name it, and the
// decoder caches the pulled blocks under it (vLLM keys every block of an adapter's request
// by the adapter's name), as its own answer and its KV events say.
func TestAnAdaptersRequestUnderPDGoesOnlyToEnginesServingItAndIsCachedUnderIt(t *testing.T) {
	base := sim.DefaultConfig()
	base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	cfg.Router.PrefillPolicy, cfg.Router.DecodePolicy = routerconfig.PolicyPreciseCacheAware, routerconfig.PolicyPreciseCacheAware
	cfg.Router.Health.Interval = 100 * time.Millisecond
	// p0 and d0 serve adapter ad beside the base model; p1 and d1 the base model alone.
	recorders := map[string]*legRecorder{}
	urls := map[string]string{}
	for _, e := range []struct {
		name    string
		role    routerconfig.Role
		adapter bool
	}{{"p0", routerconfig.RolePrefill, true}, {"p1", routerconfig.RolePrefill, false}, {"d0", routerconfig.RoleDecode, true}, {"d1", routerconfig.RoleDecode, false}} {
		c := base
		c.Role = string(e.role)
		if e.adapter {
			c.LoRAModules = "ad=/adapters/ad"
		}
		port := freePort(t)
		c.KVEventsEndpoint = fmt.Sprintf("tcp://*:%d", port)
		_, url, lr := startRecordedSim(t, c)
		recorders[e.name], urls[e.name] = lr, url
		cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: e.name, URL: url, Role: e.role, Engine: "sim",
			KVEventsEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port)})
	}
	s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
	// The publishers drop what they send before the proxy's subscriptions arrive: warm each
	// engine until the proxy hears it, and until every engine has listed its models.
	warm := 0
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		warm++ // a new prompt each time: a cached one publishes nothing
		heard := true
		for name, url := range urls {
			completeAs(t, url, identity{model: "sim"}, fmt.Sprintf("warm%d", warm)+tieredText("w", 8))
			heard = heard && blocksOn(s, name, "gpu") > 0
		}
		for _, b := range s.m.Router.Backends() {
			heard = heard && b.Models != nil
		}
		return heard && s.m.Router.Adapter("ad"), fmt.Sprintf("the proxy hears no KV event of every engine, or knows no adapter: %+v", s.m.Router.Backends())
	})
	for _, lr := range recorders {
		lr.mu.Lock()
		lr.legs = nil
		lr.mu.Unlock()
	}

	// Eight prompts nobody caches, of equal cost everywhere: were p1 and d1 candidates, the
	// cost rule would spread the prompts over both engines of each pool.
	const prompts = 8
	prompt := func(i int) string {
		return fmt.Sprintf("adapter prompt %d:", i) + tieredText(fmt.Sprintf("a%d", i), 100)
	}
	for i := range prompts {
		completeAs(t, s.url, identity{model: "ad"}, prompt(i))
	}
	for name, want := range map[string]leg{"p0": {model: "ad", prefill: true}, "d0": {model: "ad", pull: true}} {
		legs := recorders[name].all()
		if len(legs) != prompts {
			t.Errorf("%s got %d legs, want %d: %+v", name, len(legs), prompts, legs)
		}
		for _, l := range legs {
			if l != want {
				t.Errorf("%s got leg %+v, want %+v", name, l, want)
			}
		}
	}
	for _, name := range []string{"p1", "d1"} {
		if legs := recorders[name].all(); len(legs) != 0 {
			t.Errorf("%s, which does not serve ad, got legs %+v", name, legs)
		}
	}

	// The decoder pulled the first prompt's blocks and cached them under the adapter: the
	// adapter's request reuses them, the base model's does not, and the proxy's index, told
	// by d0's events, sees them under the adapter only.
	toks, err := s.m.Router.Tokens(context.Background(), router.TokenizeRequest{Model: "ad", Prompt: prompt(0)})
	if err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		n, _ := s.m.Router.CachedTokens("d0", router.Hint{Tokens: toks, LoRA: "ad"})
		return n >= len(toks)-16, fmt.Sprintf("the proxy sees %d of the prompt's %d tokens on d0 under ad", n, len(toks))
	})
	if n, _ := s.m.Router.CachedTokens("d0", router.Hint{Tokens: toks}); n != 0 {
		t.Errorf("the proxy sees %d of the prompt's tokens on d0 under the base model, want 0", n)
	}
	tokens, cached := completeAs(t, urls["d0"], identity{model: "sim"}, prompt(0))
	t.Logf("d0 reuses %d of the prompt's %d tokens as the base model", cached, tokens)
	if cached != 0 {
		t.Errorf("d0 served the base model's request of the prompt with %d of its %d tokens cached, want 0", cached, tokens)
	}
	tokens, cached = completeAs(t, urls["d0"], identity{model: "ad"}, prompt(0))
	t.Logf("d0 reuses %d of the prompt's %d tokens as ad", cached, tokens)
	if cached < tokens-16 {
		t.Errorf("d0 served the adapter's request of the prompt with %d of its %d tokens cached, want all but the last block's", cached, tokens)
	}
	if d := metricSum(t, s.url, "pdproxy_kv_events_dropped_total{"); d != 0 {
		t.Errorf("%v KV events dropped, want none", d)
	}
}
