package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// freePort is a loopback port nobody listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startSim runs a simulated engine with cfg on a loopback port until the test ends.
func startSim(t *testing.T, cfg sim.Config) (*sim.Engine, string) {
	t.Helper()
	e, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	srv := httptest.NewServer(e.Handler())
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

// TestConditionalDisaggregationSkipsThePrefillADecoderDoesNotNeed runs a session's two turns
// through a prefiller and a decoder that publishes its KV events: the first turn is
// prefilled remotely and pulled, so the decoder caches it and says so; the second turn
// extends it by a few tokens, which the decoder computes itself (decode-only, reason cached)
// while precise_cache_aware sees the decoder's blocks. With the threshold off, both turns
// are disaggregated.
func TestConditionalDisaggregationSkipsThePrefillADecoderDoesNotNeed(t *testing.T) {
	for _, threshold := range []int{0, 64} {
		t.Run(fmt.Sprintf("pd_uncached_token_threshold %d", threshold), func(t *testing.T) {
			base := sim.DefaultConfig()
			base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
			pcfg := base
			pcfg.Role = "prefill"
			p, pURL := startSim(t, pcfg)
			port := freePort(t)
			dcfg := base
			dcfg.Role = "decode"
			dcfg.KVEventsEndpoint = fmt.Sprintf("tcp://*:%d", port)
			d, dURL := startSim(t, dcfg)

			cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
			cfg.Proxy.PDUncachedTokenThreshold = threshold
			cfg.Router.DecodePolicy = routerconfig.PolicyPreciseCacheAware
			cfg.Router.Backends = []routerconfig.BackendConfig{
				{Name: "p0", URL: pURL, Role: routerconfig.RolePrefill, Engine: "sim"},
				{Name: "d0", URL: dURL, Role: routerconfig.RoleDecode, Engine: "sim", KVEventsEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port)},
			}
			s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)

			system := strings.Repeat("You answer questions about disaggregated serving, briefly and precisely. ", 30)
			turn := func(n int) string {
				msgs := []map[string]string{{"role": "system", "content": system}}
				for i := range n {
					msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("question %d?", i)})
					if i < n-1 {
						msgs = append(msgs, map[string]string{"role": "assistant", "content": fmt.Sprintf("answer %d.", i)})
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
			// The decoder pulled the first turn's blocks and published them.
			testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
				for _, b := range s.m.Router.Backends() {
					if b.Name == "d0" && b.PrefixCache != nil && b.PrefixCache.Blocks != nil && *b.PrefixCache.Blocks > 0 {
						return true, ""
					}
				}
				return false, fmt.Sprintf("the proxy knows of no block on d0: %+v", s.m.Router.Backends())
			})
			ask(turn(2))
			cached := metricValue(t, s.url, `pdproxy_decode_only_total{reason="cached"}`)
			prefills := p.Stats().RequestsTotal
			if threshold == 0 {
				if cached != 0 || prefills != 2 {
					t.Errorf("threshold off: %v decode-only by cache, %d prefills; want 0 and 2", cached, prefills)
				}
				return
			}
			if cached != 1 || prefills != 1 {
				t.Errorf("%v decode-only by cache, %d prefills; want the second turn served by the decoder alone", cached, prefills)
			}
			if st := d.Stats(); st.PrefixCacheHitsTotal == 0 {
				t.Errorf("the decoder computed the second turn without hitting its cache: %+v", st)
			}
		})
	}
}

// metricValue reads one sample of the proxy's /metrics, 0 when absent.
func metricValue(t *testing.T, url, series string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return 0
}
