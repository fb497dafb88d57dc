package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sharedstate"
	"github.com/pdproxy/pdproxy/sim"
)

// sessionFleet is a P/D fleet of simulated vLLM engines, each an HTTP server of its own,
// and proxy replicas in front of all of them routing round robin, with session affinity on
// X-Session-ID.
type sessionFleet struct {
	prefillers, decoders []*sim.Server
	replicas             []*stack
}

func startSessionFleet(t *testing.T, replicas int, redisAddr string) *sessionFleet {
	t.Helper()
	return startFleet(t, replicas, redisAddr, routerconfig.PolicyRoundRobin, []string{"X-Session-ID"})
}

// startFleet starts 2 prefillers, 3 decoders and replicas proxies on policy, with session
// affinity on the headers given (none: off) and, with redisAddr, a shared state. Where the
// policy reads KV events, every engine publishes them and every replica dials them.
func startFleet(t *testing.T, replicas int, redisAddr, policy string, sessionHeaders []string) *sessionFleet {
	t.Helper()
	base := sim.DefaultConfig()
	base.PrefillTime, base.ITL, base.KVHeartbeatInterval = time.Millisecond, time.Millisecond, 0
	logger := zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel))
	f := &sessionFleet{}
	var backends []routerconfig.BackendConfig
	caps, _ := routerconfig.CapsOf(policy)
	for i := range 5 {
		c := base
		c.Role = "prefill"
		if i >= 2 {
			c.Role = "decode"
		}
		events := ""
		if caps.NeedsKVEvents {
			port := freePort(t)
			c.KVEventsEndpoint, events = fmt.Sprintf("tcp://*:%d", port), fmt.Sprintf("tcp://127.0.0.1:%d", port)
		}
		s, err := sim.Listen(c, "127.0.0.1:0", logger)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		if i < 2 {
			f.prefillers = append(f.prefillers, s)
			backends = append(backends, routerconfig.BackendConfig{Name: fmt.Sprintf("p%d", i), URL: s.URL(), Role: routerconfig.RolePrefill, Engine: "vllm", KVEventsEndpoint: events})
		} else {
			f.decoders = append(f.decoders, s)
			backends = append(backends, routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i-2), URL: s.URL(), Role: routerconfig.RoleDecode, Engine: "vllm", KVEventsEndpoint: events})
		}
	}
	budget := sharedstate.MaxTimeout
	for range replicas {
		cfg := app.Config{Listen: "127.0.0.1:0", ShutdownTimeout: 2 * time.Second}
		cfg.Router.Backends = backends
		cfg.Router.PrefillPolicy, cfg.Router.DecodePolicy = policy, policy
		cfg.Router.Health = routerconfig.HealthConfig{Interval: 20 * time.Millisecond, Timeout: time.Second, HealthyThreshold: 1, UnhealthyThreshold: 1}
		cfg.Router.ScrapeInterval = 20 * time.Millisecond // where the policy weighs the engines' load
		if len(sessionHeaders) > 0 {
			cfg.Proxy.SessionAffinity = proxy.SessionAffinityConfig{Headers: sessionHeaders}
		}
		if redisAddr != "" {
			cfg.SharedState = sharedstate.Config{Redis: sharedstate.RedisConfig{Addr: redisAddr, Timeout: &budget}}
		}
		f.replicas = append(f.replicas, startConfig(t, logger, cfg))
	}
	return f
}

// turn sends one turn of session to replica r and answers which prefiller and decoder served
// it (the engine whose count of requests moved).
func (f *sessionFleet) turn(t *testing.T, r int, session string, n int) (prefiller, decoder int) {
	t.Helper()
	return f.send(t, r, fmt.Sprintf(`{"model":"sim","prompt":"session %s, turn %d","max_tokens":2}`, session, n), "X-Session-ID", session)
}

// send posts a completion of body to replica r, with the header given if any, and answers
// which prefiller and decoder served it.
func (f *sessionFleet) send(t *testing.T, r int, body string, header ...string) (prefiller, decoder int) {
	t.Helper()
	return f.sendTo(t, r, "/v1/completions", body, header...)
}

// sendTo is send to the route at path.
func (f *sessionFleet) sendTo(t *testing.T, r int, path, body string, header ...string) (prefiller, decoder int) {
	t.Helper()
	count := func(ss []*sim.Server) []int {
		var out []int
		for _, s := range ss {
			out = append(out, s.Engine().Stats().RequestsTotal)
		}
		return out
	}
	which := func(ss []*sim.Server, before []int) int {
		got := -1
		for i, n := range count(ss) {
			if n != before[i] {
				if got >= 0 {
					t.Fatalf("%s ran on two engines of a role", body)
				}
				got = i
			}
		}
		if got < 0 {
			t.Fatalf("%s ran on no engine", body)
		}
		return got
	}
	bp, bd := count(f.prefillers), count(f.decoders)
	resp := post(t, context.Background(), f.replicas[r].url+path, body, header...)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s on replica %d: %d %s", body, r, resp.StatusCode, b)
	}
	return which(f.prefillers, bp), which(f.decoders, bd)
}

// Three replicas, each rotating round robin on its own, and a client alternating replicas turn
// by turn: every turn of a session reaches the same prefiller and the same decoder, with no
// state shared; sessions spread over the engines.
func TestASessionsTurnsGoToOneEngineWhicheverReplicaTheyReach(t *testing.T) {
	f := startSessionFleet(t, 3, "")
	decodersUsed := map[int]bool{}
	for s := range 6 {
		session := fmt.Sprintf("conversation-%d", s)
		p0, d0 := f.turn(t, s%3, session, 0)
		for n := 1; n < 6; n++ {
			if p, d := f.turn(t, (s+n)%3, session, n); p != p0 || d != d0 {
				t.Fatalf("session %s: turn 0 on p%d/d%d, turn %d on p%d/d%d (replica %d)", session, p0, d0, n, p, d, (s+n)%3)
			}
		}
		decodersUsed[d0] = true
	}
	if len(decodersUsed) < 2 {
		t.Errorf("6 sessions all went to one decoder of 3")
	}
}

// With shared_state, a session that had to leave its decoder (killed) stays on the decoder it
// moved to, on every replica, when the first comes back: its KV is there now. Without shared
// state the key would place it back on the first.
func TestASessionThatMovedStaysWhereItMovedOnEveryReplica(t *testing.T) {
	srv := redistest.Start(t)
	f := startSessionFleet(t, 3, srv.Addr())
	const session = "agent-run-7"
	_, first := f.turn(t, 0, session, 0)
	f.decoders[first].Kill()
	for i, r := range f.replicas {
		testutil.Eventually(t, testutil.Timeout, func() bool { return !viewBackend(t, r.url, fmt.Sprintf("d%d", first)).Healthy },
			"replica %d to see d%d down", i, first)
	}
	_, moved := f.turn(t, 1, session, 1)
	if moved == first {
		t.Fatalf("the session's turn went to its killed decoder d%d", first)
	}
	if err := f.decoders[first].Restart(); err != nil {
		t.Fatal(err)
	}
	for i, r := range f.replicas {
		testutil.Eventually(t, testutil.Timeout, func() bool { return viewBackend(t, r.url, fmt.Sprintf("d%d", first)).Healthy },
			"replica %d to see d%d up again", i, first)
	}
	for n := 2; n < 8; n++ {
		if _, d := f.turn(t, n%3, session, n); d != moved {
			t.Fatalf("turn %d on replica %d went to d%d, want d%d where the session moved", n, n%3, d, moved)
		}
	}
	kept := 0.0
	for _, r := range f.replicas {
		kept += testutil.Value(t, r.m.Registry, "pdproxy_session_affinity_total", map[string]string{"role": "decode", "outcome": "kept"})
		if v := testutil.Value(t, r.m.Registry, "pdproxy_shared_state_errors_total", nil); v != 0 {
			t.Errorf("a replica counted %v shared state errors", v)
		}
	}
	if kept < 6 {
		t.Errorf("pdproxy_session_affinity_total{decode,kept} = %v over the replicas, want at least 6", kept)
	}
}
