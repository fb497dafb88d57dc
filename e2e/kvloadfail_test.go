package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
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

// TestADecoderThatCannotLoadTheKVIsReplacedByAFreshPair runs vLLM's NIXL P/D on sims with
// kv_load_failure_policy "fail", vLLM's default since PR #34896: a decoder whose pull of the
// prefiller's blocks fails answers an error rather than computing the prompt itself. The proxy
// prefills the request again and decodes it on the other decoder with the new prefill's
// params, never the failed ones; counts it; and the prefiller holds nothing afterwards.
func TestADecoderThatCannotLoadTheKVIsReplacedByAFreshPair(t *testing.T) {
	base := sim.DefaultConfig()
	base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
	pcfg := base
	pcfg.Role = "prefill"
	p, pURL := startSim(t, pcfg)
	failing := base
	failing.Role, failing.TransferFail = "decode", true
	d0, d0URL := startSim(t, failing)
	good := base
	good.Role = "decode"
	d1, d1URL := startSim(t, good)

	cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
	cfg.Router.Backends = []routerconfig.BackendConfig{
		{Name: "p0", URL: pURL, Role: routerconfig.RolePrefill, Engine: "sim"},
		{Name: "d0", URL: d0URL, Role: routerconfig.RoleDecode, Engine: "sim", Weight: 2}, // the first pick
		{Name: "d1", URL: d1URL, Role: routerconfig.RoleDecode, Engine: "sim"},
	}
	s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)), cfg)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp := post(t, ctx, s.url+"/v1/completions", `{"model":"sim","prompt":"`+strings.Repeat("abcd ", 40)+`","max_tokens":4,"stream":true}`)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		t.Fatalf("status %d: %s; want the whole stream", resp.StatusCode, b)
	}
	if n := metricValue(t, s.url, `pdproxy_retries_total{reason="kv_pull_failed",role="prefill"}`); n != 1 {
		t.Errorf("retries{prefill,kv_pull_failed} = %v, want 1", n)
	}
	if got, want := [3]int{p.Stats().HoldsTotal, d0.Stats().RequestsTotal, d1.Stats().RequestsTotal}, [3]int{2, 1, 1}; got != want {
		t.Errorf("prefills held %d, decodes on d0 %d and d1 %d; want 2, 1, 1: a fresh prefill, its params to the other decoder", got[0], got[1], got[2])
	}
	testutil.WaitFor(t, 10*time.Second, func() (bool, string) {
		st := p.Stats()
		return st.HeldRequests == 0, fmt.Sprintf("the prefiller still holds %d requests' KV: %+v", st.HeldRequests, st)
	})
}
