package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// TestABurstSharingOnePreambleSpreadsOverTheEngines sends a burst of chats that all start with
// one long system prompt (an agent's preamble), each with a question of its own, at once, to
// four simulated engines that share their compute as vLLM does: the engine that caches the
// preamble first would make every request of the burst queue behind the others there, so the
// burst spreads, under both cache-aware policies at their defaults: no engine gets more than
// twice the mean.
func TestABurstSharingOnePreambleSpreadsOverTheEngines(t *testing.T) {
	const engines, burst = 4, 24
	rng := rand.New(rand.NewPCG(3, 4))
	words := func(n int) string {
		var b strings.Builder
		for i := range n {
			if i > 0 {
				b.WriteByte(' ')
			}
			for range 3 {
				b.WriteByte(byte('a' + rng.IntN(26)))
			}
		}
		return b.String()
	}
	preamble := words(1000) // 1,000 tokens of the sim's tokenizer
	questions := make([]string, burst)
	for i := range questions {
		questions[i] = words(40)
	}
	for _, policy := range []string{routerconfig.PolicyCacheAware, routerconfig.PolicyPreciseCacheAware} {
		t.Run(policy, func(t *testing.T) {
			cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
			cfg.Router.DecodePolicy = policy
			// The engines' rate, as an operator who knows them sets it: the proxy learns
			// it only from prefills that ended, and none has when the burst arrives.
			cfg.Router.CacheAware.PrefillTokensPerSecond = 2000
			var sims []*sim.Engine
			for i := range engines {
				sc := sim.DefaultConfig()
				// A preamble takes the engine half a second: the burst arrives while it is
				// computed, however slow the machine running the test.
				sc.PrefillTime, sc.PrefillPerToken, sc.ITL, sc.KVHeartbeatInterval = 2*time.Millisecond, 500*time.Microsecond, time.Millisecond, 0
				sc.MaxNumBatchedTokens = 2048
				port := freePort(t)
				sc.KVEventsEndpoint = fmt.Sprintf("tcp://*:%d", port)
				e, url := startSim(t, sc)
				sims = append(sims, e)
				cfg.Router.Backends = append(cfg.Router.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: url, Role: routerconfig.RoleDecode,
					Engine: "sim", KVEventsEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port)})
			}
			s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)
			var wg sync.WaitGroup
			for i := range burst {
				wg.Go(func() {
					body, _ := json.Marshal(map[string]any{"model": "sim", "max_tokens": 2, "stream": true, "messages": []map[string]string{
						{"role": "system", "content": preamble}, {"role": "user", "content": questions[i]}}})
					resp, err := http.Post(s.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
					if err != nil {
						t.Errorf("request %d: %v", i, err)
						return
					}
					defer resp.Body.Close()
					out, err := io.ReadAll(resp.Body)
					if err != nil || resp.StatusCode != http.StatusOK || !bytes.Contains(out, []byte("data: [DONE]")) {
						t.Errorf("request %d: status %d, %v: %.200s", i, resp.StatusCode, err, out)
					}
				})
			}
			wg.Wait()
			var per []int
			for _, e := range sims {
				per = append(per, e.Stats().RequestsTotal)
			}
			if total := per[0] + per[1] + per[2] + per[3]; total != burst {
				t.Fatalf("the engines served %d requests, want %d", total, burst)
			}
			if most := slices.Max(per); most > 2*burst/engines {
				t.Errorf("requests per engine %v: one engine got %d, over twice the mean of %d", per, most, burst/engines)
			}
			s.assertQuiet(5 * time.Second)
		})
	}
}
