package proxy

import (
	"net/http"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestDecodeThatCannotConnectIsRetriedOnAnotherDecoder(t *testing.T) {
	p := newEngine(t, vllmPrefill(`{"remote_block_ids":[1,2],"remote_engine_id":"p0"}`))
	d := newEngine(t, vllmDecode)
	h := newHarness(t, Config{}, routerconfig.Config{
		// round_robin makes the dead decoder the first pick half the time; two requests
		// make sure it is picked once.
		DecodePolicy: "round_robin",
		Backends: []routerconfig.BackendConfig{
			prefiller("p0", p.URL()), decoder("dead", closedURL(t)), decoder("d1", d.URL()),
		},
	})
	for i := 0; i < 2; i++ {
		resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3}`)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	if got := h.value("pdproxy_retries_total", map[string]string{"role": "decode", "reason": "connect_error"}); got != 1 {
		t.Fatalf("decode retries = %v, want 1", got)
	}
	if n := len(d.generations()); n != 2 {
		t.Fatalf("the live decoder served %d decodes, want 2", n)
	}
	h.waitQuiet()
}
