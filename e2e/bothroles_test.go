package e2e

import (
	"io"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/sim"
)

// One engine started with kv_role kv_both serves as the prefiller and the decoder of a
// small deployment: `--prefill URL --decode URL` with the same URL. Each role gets a backend
// of its own, named after the role and the address.
func TestOneEngineGivenAsPrefillerAndDecoderServesBothRoles(t *testing.T) {
	engine := startSimEngine(t, func(c *sim.Config) {
		c.Role = "both"
		c.PrefillTime = 2 * time.Millisecond
		c.ITL = time.Millisecond
	})
	cfg, err := app.LoadConfig([]string{"--prefill", engine.URL, "--decode", engine.URL, "--listen", "127.0.0.1:0"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ShutdownTimeout = 2 * time.Second
	s := startConfig(t, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)), cfg)

	addr := engine.Listener.Addr().String()
	if got, want := backendNames(debugBackends(t, s.url)), []string{"decode-" + addr, "prefill-" + addr}; !slices.Equal(got, want) {
		t.Fatalf("/debug/backends names %v, want %v", got, want)
	}
	completionOK(t, s.url)
	// The request went through P/D on the one engine: a prefill, then a decode that pulled
	// the KV from it; nothing is held afterwards.
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
		st := kv(t, engine.URL)
		return st.RequestsTotal == 2 && st.BlocksFree == st.BlocksTotal && st.HeldRequests == 0, jsonString(st)
	})
	for _, role := range []string{"prefill", "decode"} {
		labels := map[string]string{"backend": role + "-" + addr, "role": role, "code": "200"}
		if got := testutil.Value(t, s.m.Registry, "pdproxy_backend_requests_total", labels); got != 1 {
			t.Errorf("pdproxy_backend_requests_total%v = %v, want 1", labels, got)
		}
	}
}
