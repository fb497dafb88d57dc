package proxy

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// A session's requests go to one prefiller and one decoder, where least_inflight alone would
// spread them; another session may go elsewhere; the picks are counted.
func TestASessionsRequestsStayOnItsEngines(t *testing.T) {
	ps := []*fakeEngine{newEngine(t, vllmPrefill(`{"remote_block_ids":[1]}`)), newEngine(t, vllmPrefill(`{"remote_block_ids":[1]}`))}
	ds := []*fakeEngine{newEngine(t, vllmDecode), newEngine(t, vllmDecode), newEngine(t, vllmDecode)}
	var bs []routerconfig.BackendConfig
	for i, p := range ps {
		bs = append(bs, prefiller(fmt.Sprintf("p%d", i), p.URL()))
	}
	for i, d := range ds {
		bs = append(bs, decoder(fmt.Sprintf("d%d", i), d.URL()))
	}
	cfg := Config{SessionAffinity: SessionAffinityConfig{Headers: []string{"x-session-id", "X-Claude-Code-Session-Id"}}}
	h := newHarness(t, cfg, routerconfig.Config{Backends: bs, PrefillPolicy: routerconfig.PolicyLeastInflight, DecodePolicy: routerconfig.PolicyRoundRobin})
	const turns = 6
	for i := range turns {
		hdr := http.Header{"X-Claude-Code-Session-Id": {"agent-run-1"}}
		resp, body := h.do(http.MethodPost, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"turn %d","max_tokens":4}`, i), hdr)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("turn %d: %d %s", i, resp.StatusCode, body)
		}
	}
	served := func(es []*fakeEngine) (busy int) {
		for _, e := range es {
			if n := len(e.generations()); n > 0 {
				busy++
				if n != turns {
					t.Errorf("an engine served %d of the session's %d turns", n, turns)
				}
			}
		}
		return busy
	}
	if served(ps) != 1 || served(ds) != 1 {
		t.Fatal("the session's turns went to more than one prefiller or decoder")
	}
	if v := h.value("pdproxy_session_affinity_total", map[string]string{"role": "decode", "outcome": "placed"}); v != turns {
		t.Errorf("session_affinity_total{decode,placed} = %v, want %d (no shared state: every turn is placed by its key)", v, turns)
	}
	// Requests with no session header are routed by the policy as before: round robin
	// reaches every decoder.
	for i := range 6 {
		resp, body := h.do(http.MethodPost, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"free %d","max_tokens":4}`, i), nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	for i, d := range ds {
		if len(d.generations()) == 0 {
			t.Errorf("d%d got no request without a session", i)
		}
	}
}

// A session header that cannot be an id is refused with a 400 naming it, before any engine is
// asked.
func TestASessionHeaderThatIsNoIDIsRefused(t *testing.T) {
	d := newEngine(t, vllmDecode)
	h := aggregated(t, Config{SessionAffinity: SessionAffinityConfig{Headers: []string{"X-Session-ID"}}}, d)
	for name, v := range map[string]string{"too long": strings.Repeat("s", maxSessionKey+1), "not ascii": "sess\u00e3o"} {
		resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`, http.Header{"X-Session-Id": {v}})
		_, _, _, param := checkOpenAIError(t, resp, body, http.StatusBadRequest)
		if param == nil || *param != "X-Session-Id" {
			t.Errorf("%s: param %v, want X-Session-Id", name, param)
		}
	}
	if n := len(d.generations()); n != 0 {
		t.Errorf("the decoder got %d requests", n)
	}
}

func TestSessionAffinitySettingsThatCannotTakeEffectAreRefused(t *testing.T) {
	for name, c := range map[string]SessionAffinityConfig{
		"ttl without headers": {TTL: 1e9},
		"negative ttl":        {Headers: []string{"X-Session-ID"}, TTL: -1},
		"not a header name":   {Headers: []string{"X Session"}},
		"empty header name":   {Headers: []string{""}},
	} {
		if err := (Config{SessionAffinity: c}).Validate(); err == nil || !strings.Contains(err.Error(), "session_affinity") {
			t.Errorf("%s: %v, want an error naming session_affinity", name, err)
		}
	}
}
