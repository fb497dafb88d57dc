package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
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

// TestTheProxyDialsEveryRankOfAnEngineThatBindsPort0 runs a sim of two data parallel
// ranks whose KV event publishers bind port 0, each rank a free port of its own, as vLLM's
// since PR #55844: with kv_events_discover the proxy asks the engine's GET /kv_event_sources
// where they are and hears both ranks' blocks.
func TestTheProxyDialsEveryRankOfAnEngineThatBindsPort0(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.Role = "decode"
	cfg.PrefillTime, cfg.ITL, cfg.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
	cfg.DataParallelSize = 2
	cfg.KVEventsEndpoint, cfg.KVEventsReplayEndpoint = "tcp://*:0", "tcp://*:0"
	_, url := startSim(t, cfg)

	resp, err := http.Get(url + "/kv_event_sources")
	if err != nil {
		t.Fatal(err)
	}
	var sources []struct {
		Rank     int     `json:"data_parallel_rank"`
		Endpoint string  `json:"endpoint"`
		Replay   *string `json:"replay_endpoint"`
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err := json.Unmarshal(b, &sources); err != nil || len(sources) != 2 || sources[0].Endpoint == sources[1].Endpoint || sources[1].Replay == nil {
		t.Fatalf("GET /kv_event_sources: %s (%v); want two ranks, each its own port and a replay endpoint", b, err)
	}

	pcfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	pcfg.Router.DecodePolicy = routerconfig.PolicyPreciseCacheAware
	pcfg.Router.Health.Interval = 100 * time.Millisecond
	pcfg.Router.Backends = []routerconfig.BackendConfig{{Name: "d0", URL: url, Role: routerconfig.RoleDecode, Engine: "sim",
		DataParallelSize: 2, KVEventsDiscover: true}}
	s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), pcfg)

	for rank := range 2 {
		prompt := fmt.Sprintf("rank %d:", rank) + tieredText(fmt.Sprintf("r%d", rank), 100)
		toks, err := s.m.Router.Tokens(context.Background(), router.TokenizeRequest{Model: "sim", Prompt: prompt})
		if err != nil {
			t.Fatal(err)
		}
		// The PUB drops what it sends before the proxy's subscription: the prompt again
		// (its blocks are published when first computed, so a new suffix each time).
		tries := 0
		testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
			tries++
			body, _ := json.Marshal(map[string]any{"model": "sim", "prompt": prompt + tieredText(fmt.Sprintf("x%d", tries), 20), "max_tokens": 1})
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			resp := post(t, ctx, url+"/v1/completions", string(body), sim.HeaderDataParallelRank, strconv.Itoa(rank))
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			n, _ := s.m.Router.CachedTokens("d0", router.Hint{Tokens: toks})
			return n > 0, fmt.Sprintf("the proxy hears none of rank %d's blocks (%d tokens of %d)", rank, n, len(toks))
		})
	}
}
