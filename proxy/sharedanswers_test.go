package proxy

import (
	"net/http"
	"testing"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// The check script's answer to a request that is let in, with one session and no binding, as
// Redis sends it (an integer, an empty string, an integer, a list of one empty list), and the
// same with the integer 1 sent as the string "1".
const (
	allowedAnswer = "*4\r\n:1\r\n$0\r\n\r\n:0\r\n"
	garbledAnswer = "*4\r\n$1\r\n1\r\n$0\r\n\r\n:0\r\n"
)

func TestARedisAnswerOfTheWrongTypesIsARedisErrorAndTheReplicaDecidesAlone(t *testing.T) {
	srv := redistest.Start(t)
	rw := srv.Rewrite(t, allowedAnswer, garbledAnswer, "evalsha")
	d := newEngine(t, vllmDecode)
	cfg := Config{
		Limits:          LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 100, Burst: 100}},
		SessionAffinity: SessionAffinityConfig{Headers: []string{"X-Session-ID"}},
	}
	h, storeReg := sharedReplica(t, rw.Addr(), cfg, d)
	const n = 10
	hdr := bearer("k")
	hdr.Set("X-Session-ID", "agent-1")
	for i := range n {
		if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, hdr); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d, under the replica's own limit, with Redis answering strings for integers: %d %s", i, resp.StatusCode, body)
		}
	}
	if got := len(d.generations()); got != n {
		t.Errorf("the engine got %d generation calls, want %d", got, n)
	}
	if rw.Rewrites() == 0 {
		t.Fatalf("no answer was garbled: the test proves nothing")
	}
	// Each request: one error counted, at most one round trip (none while the replica
	// backs off after the first), never a second check for the session's bindings.
	if got := testutil.Value(t, storeReg, "pdproxy_shared_state_errors_total", map[string]string{"op": "check"}); got != n {
		t.Errorf("shared_state_errors_total{op=check} = %v after %d requests, want %d", got, n, n)
	}
	if got := rw.Commands(); got > n {
		t.Errorf("%d checks went to Redis for %d requests, want at most one each", got, n)
	}
	if v := h.value("pdproxy_limit_rejected_total", nil); v != 0 {
		t.Errorf("limit_rejected_total = %v, want 0: a request never fails because Redis did", v)
	}
	h.waitQuiet()
}

func TestWithRedisDownASessionsRequestCountsOneCheckError(t *testing.T) {
	srv := redistest.Start(t)
	rw := srv.Rewrite(t, "", "", "evalsha")
	d := newEngine(t, vllmDecode)
	cfg := Config{
		Limits:          LimitsConfig{PerKey: KeyLimits{RequestsPerSecond: 100, Burst: 100}},
		SessionAffinity: SessionAffinityConfig{Headers: []string{"X-Session-ID"}},
	}
	h, storeReg := sharedReplica(t, rw.Addr(), cfg, d)
	if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, bearer("k")); resp.StatusCode != http.StatusOK {
		t.Fatalf("a request with Redis up: %d %s", resp.StatusCode, body)
	}
	srv.Stop()
	before := testutil.Value(t, storeReg, "pdproxy_shared_state_errors_total", map[string]string{"op": "check"})
	sent := rw.Commands()
	const n = 8
	for i := range n {
		hdr := bearer("k")
		hdr.Set("X-Session-ID", "agent-1")
		if resp, body := h.do(http.MethodPost, "/v1/completions", plainCompletion, hdr); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d with Redis stopped: %d %s", i, resp.StatusCode, body)
		}
	}
	if got := testutil.Value(t, storeReg, "pdproxy_shared_state_errors_total", map[string]string{"op": "check"}) - before; got != n {
		t.Errorf("shared_state_errors_total{op=check} rose by %v for %d requests with a session, want %d", got, n, n)
	}
	if got := rw.Commands() - sent; got > n {
		t.Errorf("%d checks were sent for %d requests with Redis stopped, want at most one each", got, n)
	}
	h.waitQuiet()
}
