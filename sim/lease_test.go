package sim

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// leaseConfig is a scripted engine with the default lease (30s).
func leaseConfig() Config {
	cfg := scriptedConfig()
	cfg.KVHoldTimeout = 0 // the default
	return cfg
}

func TestLeaseExpiresWithoutHeartbeat_PR41383(t *testing.T) {
	if got := DefaultConfig().KVHoldTimeout; got != 30*time.Second {
		t.Fatalf("default lease %v, want vLLM's kv_lease_duration 30s", got)
	}
	p := newScripted(t, leaseConfig(), newFakeClock())
	p.holdPrefill(t, "r1")
	p.clock.Advance(30*time.Second - time.Nanosecond)
	p.stepNow()
	checkStats(t, "just before the lease ends", p.Stats(), KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1})
	p.clock.Advance(time.Nanosecond)
	p.stepNow()
	checkStats(t, "when the lease ends", p.Stats(), KVStats{BlocksFree: 16, ExpiredTotal: 1})

	srv := httptest.NewServer(p.Handler()) // no Run: /metrics and /debug/kv read a snapshot
	defer srv.Close()
	ts := &testServer{e: p.Engine, srv: srv, client: &http.Client{Transport: &http.Transport{}}}
	defer ts.client.CloseIdleConnections()
	metrics := string(ts.get(t, "/metrics"))
	for _, want := range []string{`vllm:nixl_num_kv_expired_reqs_total{model_name="sim"} 1`, `pdproxy_sim_kv_hold_expired_total{model_name="sim"} 1`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s:\n%s", want, metrics)
		}
	}
	if s := ts.kv(t); s.ExpiredTotal != 1 {
		t.Errorf("/debug/kv expired_total = %d, want 1", s.ExpiredTotal)
	}
}

func TestHeartbeatRenewsTheLeaseToNowPlusLease_PR41383(t *testing.T) {
	held := KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1}
	tests := []struct {
		name   string
		script func(p *scripted)
		want   KVStats
	}{
		{
			name: "a heartbeat at 20s keeps the blocks past 30s",
			script: func(p *scripted) {
				p.clock.Advance(20 * time.Second)
				p.heartbeat([]string{"r1"})
				p.stepNow()
				p.clock.Advance(29 * time.Second) // 49s after the prefill
				p.stepNow()
			},
			want: KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1, HeartbeatsTotal: 1},
		},
		{
			name: "the renewed lease ends a lease after the last heartbeat",
			script: func(p *scripted) {
				p.clock.Advance(20 * time.Second)
				p.heartbeat([]string{"r1"})
				p.stepNow()
				p.clock.Advance(30 * time.Second)
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, ExpiredTotal: 1, HeartbeatsTotal: 1},
		},
		{
			name: "a heartbeat in the step where the lease ends saves it",
			script: func(p *scripted) {
				p.clock.Advance(30 * time.Second)
				p.heartbeat([]string{"r1"})
				p.stepNow()
			},
			want: KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1, HeartbeatsTotal: 1},
		},
		{
			name: "a heartbeat for an unknown request is a counted no-op",
			script: func(p *scripted) {
				p.heartbeat([]string{"nobody", "r1"})
				p.stepNow()
			},
			want: KVStats{BlocksFree: 14, BlocksHeld: 2, HeldRequests: 1, HeartbeatsTotal: 1, LateEventsTotal: 1},
		},
		{
			name: "a heartbeat after the expiry is late and frees nothing twice",
			script: func(p *scripted) {
				p.clock.Advance(30 * time.Second)
				p.stepNow()
				p.heartbeat([]string{"r1"})
				p.heartbeat([]string{"r1"})
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, ExpiredTotal: 1, LateEventsTotal: 2},
		},
		{
			name: "a heartbeat racing the decoder's notify is late, not a crash",
			script: func(p *scripted) {
				p.finishedSending("r1")
				p.heartbeat([]string{"r1"})
				p.stepNow()
			},
			want: KVStats{BlocksFree: 16, LateEventsTotal: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newScripted(t, leaseConfig(), newFakeClock())
			p.holdPrefill(t, "r1")
			checkStats(t, "held", p.Stats(), held)
			tt.script(p)
			checkStats(t, tt.name, p.Stats(), tt.want)
		})
	}
}

func TestHeartbeatEndpoint_PR41383(t *testing.T) {
	p := startServer(t, fastConfig())
	tests := []struct {
		name, body string
		status     int
		late       int
	}{
		{"unknown request ids are accepted and counted late", `{"engine_id":"` + p.e.ID() + `","request_ids":["gone-1","gone-2"]}`, http.StatusOK, 2},
		{"no engine id is this engine", `{"request_ids":["gone-3"]}`, http.StatusOK, 3},
		{"another engine's id is a 404", `{"engine_id":"sim-prefill-other","request_ids":["x"]}`, http.StatusNotFound, 3},
		{"no request ids is a 400", `{"engine_id":"` + p.e.ID() + `","request_ids":[]}`, http.StatusBadRequest, 3},
		{"not JSON is a 400", `beat`, http.StatusBadRequest, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := p.post(t, context.Background(), "/kv/heartbeat", tt.body, nil)
			body := readAll(t, resp)
			if resp.StatusCode != tt.status {
				t.Fatalf("status %d, body %s; want %d", resp.StatusCode, body, tt.status)
			}
			if tt.status != http.StatusOK {
				decodeError(t, body)
			}
			p.waitKV(t, "heartbeats applied", func(s KVStats) bool { return s.LateEventsTotal == tt.late })
		})
	}
	if s := p.kv(t); s.HeartbeatsTotal != 0 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("/debug/kv = %+v, want no renewal and no double free", s)
	}
}

// pdPair is a prefiller and a decoder on loopback sharing one fake clock, so
// that a test moves time for both. Nothing takes time by itself: prefills
// and pulls are instant, and the decoder's ITL is an hour of fake time, so
// a decoding request keeps its running slot until the test ends it.
type pdPair struct {
	p, d  *testServer
	clock *fakeClock
}

func startPDPair(t *testing.T, mutateD func(*Config)) *pdPair {
	t.Helper()
	return startPDPairWith(t, nil, mutateD)
}

// startPDPairWith is startPDPair with both engines' configs changed by mutate first.
func startPDPairWith(t *testing.T, mutate, mutateD func(*Config)) *pdPair {
	t.Helper()
	clock := newFakeClock()
	pc := fastConfig()
	pc.Clock, pc.PrefillTime, pc.ITL = clock, 0, 0
	if mutate != nil {
		mutate(&pc)
	}
	dc := pc
	dc.ITL = time.Hour
	if mutateD != nil {
		mutateD(&dc)
	}
	return &pdPair{p: startServer(t, pc), d: startServer(t, dc), clock: clock}
}

// occupy starts a streaming aggregated request on ts that holds a running
// slot until the returned cancel is called.
func occupy(t *testing.T, ts *testServer, rid string) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	resp := ts.post(t, ctx, "/v1/completions", `{"prompt":"busy","max_tokens":1000,"ignore_eos":true,"stream":true}`, map[string]string{"X-Request-Id": rid})
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.Contains(line, " tok") {
		t.Fatalf("blocker's first line %q, %v", line, err)
	}
	return func() {
		cancel()
		resp.Body.Close()
	}
}

// decodeInBackground posts a decode to ts and returns its status and body
// on the channel once it ends.
type decodeResult struct {
	status int
	body   string
}

func decodeInBackground(t *testing.T, ctx context.Context, ts *testServer, rid, body string) <-chan decodeResult {
	t.Helper()
	done := make(chan decodeResult, 1)
	go func() {
		resp, err := ts.do(ctx, "/v1/completions", body, map[string]string{"X-Request-Id": rid})
		if err != nil {
			done <- decodeResult{status: -1, body: err.Error()}
			return
		}
		// Not readAll: t.Fatal belongs to the test's own goroutine.
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			b = append(b, "\nread error: "+err.Error()...)
		}
		done <- decodeResult{status: resp.StatusCode, body: string(b)}
	}()
	return done
}

func TestQueuedDecoderHeartbeatsKeepThePrefillersBlocksPastTheLease_PR41383(t *testing.T) {
	pd := startPDPair(t, func(c *Config) { c.MaxRunning = 1 })
	stopBlocker := occupy(t, pd.d, "blocker")
	defer stopBlocker()
	kv := pd.p.prefill(t, "queued", strings.Repeat("abcd", 40))
	done := decodeInBackground(t, context.Background(), pd.d, "queued",
		`{"prompt":"`+strings.Repeat("abcd", 40)+`","max_tokens":1,"ignore_eos":true,"kv_transfer_params":`+kv+`}`)
	pd.d.waitKV(t, "decode queued behind the blocker", func(s KVStats) bool { return s.WaitingRequests == 1 })

	// Eight heartbeat rounds: 40s of fake time, past the 30s lease.
	for round := 1; round <= 8; round++ {
		pd.clock.Advance(5 * time.Second)
		pd.p.waitKV(t, "heartbeat applied", func(s KVStats) bool { return s.HeartbeatsTotal == round })
	}
	if s := pd.p.kv(t); s.HeldRequests != 1 || s.ExpiredTotal != 0 {
		t.Fatalf("after 40s of heartbeats P /debug/kv = %+v, want the hold alive", s)
	}

	stopBlocker() // the decode gets the slot, pulls, notifies
	res := testutil.Recv(t, testutil.Timeout, done, "the decode")
	if res.status != http.StatusOK || !strings.Contains(res.body, `"finish_reason":"length"`) {
		t.Fatalf("decode: %d %s", res.status, res.body)
	}
	s := pd.p.waitKV(t, "P frees on the notify", allFree)
	if s.ExpiredTotal != 0 || s.LateEventsTotal != 0 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("P /debug/kv = %+v, want no expiry, late event or double free", s)
	}
	// D counts a heartbeat once P has answered it, a moment after P applied it.
	pd.d.waitKV(t, "D to count its 8 heartbeats", func(s KVStats) bool { return s.HeartbeatsSentTotal == 8 })
}

func TestHeartbeatsOffLetTheLeaseExpireUnderAQueuedDecoder_PR41383(t *testing.T) {
	pd := startPDPair(t, func(c *Config) { c.MaxRunning, c.KVHeartbeatInterval = 1, 0 })
	stopBlocker := occupy(t, pd.d, "blocker")
	defer stopBlocker()
	kv := pd.p.prefill(t, "queued", "hello")
	done := decodeInBackground(t, context.Background(), pd.d, "queued", `{"prompt":"hello","max_tokens":1,"kv_transfer_params":`+kv+`}`)
	pd.d.waitKV(t, "decode queued behind the blocker", func(s KVStats) bool { return s.WaitingRequests == 1 })
	pd.clock.Advance(30 * time.Second)
	pd.p.waitKV(t, "the lease expires", func(s KVStats) bool { return s.ExpiredTotal == 1 && allFree(s) })

	stopBlocker()
	// Race R4: the read comes after the lease, and fails rather than
	// decoding from blocks that may have been reused.
	if res := testutil.Recv(t, testutil.Timeout, done, "the decode"); res.status != http.StatusInternalServerError || !strings.Contains(res.body, "kv_transfer_failed") {
		t.Fatalf("decode after the lease: %d %s, want a 500 kv_transfer_failed", res.status, res.body)
	}
	if s := pd.p.kv(t); s.HeartbeatsTotal != 0 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("P /debug/kv = %+v", s)
	}
}
