package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// mooncakeConfig is a fast Mooncake engine of role on a free bootstrap port.
func mooncakeConfig(role string) Config {
	cfg := fastConfig()
	cfg.Protocol, cfg.Role = ProtocolMooncake, role
	cfg.BootstrapPort = 0
	cfg.KVHoldTimeout = time.Hour
	return cfg
}

// mcPair is a Mooncake prefiller and decoder, and the prefiller's bootstrap address.
type mcPair struct {
	p, d *testServer
	boot string // http://127.0.0.1:port
}

func startMooncake(t *testing.T, pcfg, dcfg Config) *mcPair {
	t.Helper()
	pr := &mcPair{p: startSGLang(t, pcfg), d: startSGLang(t, dcfg)}
	pr.boot = fmt.Sprintf("http://127.0.0.1:%d", pr.p.e.boot.port())
	return pr
}

// query is the prefiller's GET /query.
func (pr *mcPair) query(t *testing.T) map[string]mooncakeInfo {
	t.Helper()
	resp, err := pr.p.client.Get(pr.boot + "/query")
	if err != nil {
		t.Fatalf("GET /query: %v", err)
	}
	var out map[string]mooncakeInfo
	if err := json.Unmarshal(readAll(t, resp), &out); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /query: status %d, %v", resp.StatusCode, err)
	}
	return out
}

// withKV is body with a kv_transfer_params object (and extra top-level fields).
func withKV(t *testing.T, body string, kv map[string]any, extra map[string]any) string {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("body %s: %v", body, err)
	}
	m["kv_transfer_params"] = kv
	for k, v := range extra {
		m[k] = v
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// prefillLeg and decodeLeg are body as vLLM's mooncake proxy sends it to each side.
func prefillLeg(t *testing.T, body, xfer string) string {
	extra := map[string]any{"max_tokens": 1, "stream": false}
	if strings.Contains(body, `"input"`) {
		extra = map[string]any{"max_output_tokens": 1, "stream": false} // the Responses API's
	}
	return withKV(t, body, map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": xfer}, extra)
}

func (pr *mcPair) decodeLeg(t *testing.T, body, xfer string, rank int) string {
	t.Helper()
	id := pr.query(t)[fmt.Sprint(rank)].EngineID
	return withKV(t, body, map[string]any{"do_remote_prefill": true, "do_remote_decode": false,
		"remote_bootstrap_addr": pr.boot, "remote_engine_id": id, "remote_dp_rank": rank, "transfer_id": xfer}, nil)
}

// decodedText is the text of a decode's answer, streamed or not.
func decodedText(t *testing.T, a answer, stream bool) string {
	t.Helper()
	if a.status != http.StatusOK {
		t.Fatalf("decode answered %d %s", a.status, a.body)
	}
	if stream {
		text, _ := streamText(t, sseEvents(t, []byte(a.body)))
		return text
	}
	return answerText(t, []byte(a.body))
}

func mcWaiting(s KVStats) bool { return s.TransfersWaiting == 1 }

func TestMooncakePairServesCompletionsAndChatAndThePrefillerEndsHoldingNothing(t *testing.T) {
	prompt := strings.Repeat("the quick brown fox jumps over the lazy dog ", 8)
	for _, tc := range []struct {
		name, path string
		stream     bool
	}{
		{"completions", "/v1/completions", false},
		{"completions streamed", "/v1/completions", true},
		{"chat", "/v1/chat/completions", false},
		{"chat streamed", "/v1/chat/completions", true},
		{"responses", "/v1/responses", false},
		{"responses streamed", "/v1/responses", true},
		{"messages", "/v1/messages", false},
		{"messages streamed", "/v1/messages", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr := startMooncake(t, mooncakeConfig("prefill"), mooncakeConfig("decode"))
			body := fmt.Sprintf(`{"prompt":%q,"max_tokens":5,"ignore_eos":true,"stream":%t}`, prompt, tc.stream)
			switch tc.path {
			case "/v1/chat/completions":
				body = fmt.Sprintf(`{"messages":[{"role":"user","content":%q}],"max_tokens":5,"ignore_eos":true,"stream":%t}`, prompt, tc.stream)
			case "/v1/responses":
				body = fmt.Sprintf(`{"input":%q,"max_output_tokens":5,"ignore_eos":true,"stream":%t}`, prompt, tc.stream)
			case "/v1/messages":
				body = fmt.Sprintf(`{"model":"sim","messages":[{"role":"user","content":%q}],"max_tokens":5,"ignore_eos":true,"stream":%t}`, prompt, tc.stream)
			}
			hdr := map[string]string{"X-Request-Id": "req-1", HeaderDataParallelRank: "0"}
			pa := pr.p.send(context.Background(), tc.path, prefillLeg(t, body, "xfer-1"), hdr)
			da := pr.d.send(context.Background(), tc.path, pr.decodeLeg(t, body, "xfer-1", 0), map[string]string{"X-Request-Id": "req-1"})
			if a := recvAnswer(t, pa, "prefill leg"); a.status != http.StatusOK {
				t.Fatalf("prefill leg answered %d %s", a.status, a.body)
			}
			if got, want := decodedText(t, recvAnswer(t, da, "decode leg"), tc.stream), expectedText(0, "req-1", 5); got != want {
				t.Errorf("decode text = %q, want %q", got, want)
			}
			ps := pr.p.waitKV(t, "prefiller frees its hold after the pull", allFree)
			if ps.HoldsTotal != 1 || ps.ExpiredTotal != 0 || ps.DoubleFreeAttemptsTotal != 0 {
				t.Errorf("prefiller /debug/kv = %+v, want one hold, freed by the pull", ps)
			}
			ds := pr.d.waitKV(t, "decoder done", allFree)
			if ds.KVBlocksPulledTotal == 0 || ds.KVLoadFailuresTotal != 0 || ds.RemotePrefillRequestsTotal != 1 {
				t.Errorf("decoder /debug/kv = %+v, want blocks pulled, no fallback", ds)
			}
		})
	}
}

func TestMooncakeDecodeArrivingBeforeItsPrefillWaitsThenPulls(t *testing.T) {
	pr := startMooncake(t, mooncakeConfig("prefill"), mooncakeConfig("decode"))
	body := `{"prompt":"` + strings.Repeat("a b c d ", 20) + `","max_tokens":3,"ignore_eos":true}`
	da := pr.d.send(context.Background(), "/v1/completions", pr.decodeLeg(t, body, "xfer-early", 0), map[string]string{"X-Request-Id": "early"})
	pr.d.waitKV(t, "the decode waits for its transfer", mcWaiting)
	testutil.Eventually(t, testutil.Timeout, func() bool { return transferWaiters(pr.p.e, "xfer-early") == 1 }, "the claim to reach the prefiller")

	pa := pr.p.send(context.Background(), "/v1/completions", prefillLeg(t, body, "xfer-early"), map[string]string{"X-Request-Id": "early"})
	if a := recvAnswer(t, pa, "prefill leg"); a.status != http.StatusOK {
		t.Fatalf("prefill leg answered %d %s", a.status, a.body)
	}
	if got, want := decodedText(t, recvAnswer(t, da, "decode leg"), false), expectedText(0, "early", 3); got != want {
		t.Errorf("decode text = %q, want %q", got, want)
	}
	pr.p.waitKV(t, "prefiller frees its hold after the pull", allFree)
	if ds := pr.d.waitKV(t, "decoder done", allFree); ds.KVBlocksPulledTotal == 0 || ds.KVLoadFailuresTotal != 0 || ds.TransfersWaiting != 0 {
		t.Errorf("decoder /debug/kv = %+v, want blocks pulled after the wait", ds)
	}
}

// transferWaiters is how many claims wait for transfer id on a prefiller's rank 0.
func transferWaiters(e *Engine, id string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if tr := e.transfers[id]; tr != nil {
		return tr.waiters
	}
	return 0
}

// heldStill checks that a prefiller's rank holds one prefill's blocks.
func heldStill(t *testing.T, ts *testServer, rank int, what string) {
	t.Helper()
	if s := ts.kv(t); s.HeldRequests != 1 || s.BlocksHeld == 0 || s.Ranks[rank].HeldRequests != 1 || s.Ranks[rank].BlocksHeld == 0 {
		t.Fatalf("%s: /debug/kv = %+v, want one request holding blocks", what, s)
	}
}

func TestMooncakeHolds(t *testing.T) {
	const hold = 480 * time.Second
	body := `{"prompt":"` + strings.Repeat("one two three four ", 10) + `","max_tokens":2,"ignore_eos":true}`
	for _, tc := range []struct {
		name string
		// cutDecode: the transfer's decode came first and its client left while it waited.
		cutDecode bool
	}{
		{"a prefill whose decoder never comes holds until its timeout", false},
		{"a decode leg cut while it waits leaves the hold until its timeout", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := newFakeClock()
			pcfg := mooncakeConfig("prefill")
			pcfg.Clock, pcfg.PrefillTime, pcfg.ITL, pcfg.KVHoldTimeout = clock, 0, 0, hold
			pr := startMooncake(t, pcfg, mooncakeConfig("decode"))
			if tc.cutDecode {
				ctx, cancel := context.WithCancel(context.Background())
				da := pr.d.send(ctx, "/v1/completions", pr.decodeLeg(t, body, "xfer-h", 0), nil)
				pr.d.waitKV(t, "the decode waits for its transfer", mcWaiting)
				testutil.Eventually(t, testutil.Timeout, func() bool { return transferWaiters(pr.p.e, "xfer-h") == 1 }, "the claim to reach the prefiller")
				cancel()
				if a := testutil.Recv(t, testutil.Timeout, da, "cut decode leg"); a.err == nil {
					t.Fatalf("cut decode leg answered %d %s, want a client error", a.status, a.body)
				}
				pr.d.waitKV(t, "the decoder gives up the pull", func(s KVStats) bool { return allFree(s) && s.TransfersWaiting == 0 })
				testutil.Eventually(t, testutil.Timeout, func() bool { return transferWaiters(pr.p.e, "xfer-h") == 0 }, "the prefiller to see the claim withdrawn")
			}
			pa := pr.p.send(context.Background(), "/v1/completions", prefillLeg(t, body, "xfer-h"), nil)
			if a := recvAnswer(t, pa, "prefill leg"); a.status != http.StatusOK {
				t.Fatalf("prefill leg answered %d %s, want 200 at once", a.status, a.body)
			}
			heldStill(t, pr.p, 0, "after the prefill")
			clock.Advance(hold - time.Second)
			heldStill(t, pr.p, 0, "just before the hold timeout")
			clock.Advance(time.Second)
			s := pr.p.waitKV(t, "the hold ends with its timeout", func(s KVStats) bool { return allFree(s) && s.ExpiredTotal == 1 })
			if s.Ranks[0].ExpiredTotal != 1 {
				t.Errorf("prefiller /debug/kv = %+v, want rank 0 to count the expiry", s)
			}
			pr.checkUnavailable(t, body, "xfer-h")
		})
	}
}

func TestMooncakePrefillLegCutBeforeItsPrefillHoldsNothing(t *testing.T) {
	pcfg := mooncakeConfig("prefill")
	pcfg.PrefillTime = time.Hour
	pr := startMooncake(t, pcfg, mooncakeConfig("decode"))
	body := `{"prompt":"` + strings.Repeat("x y z ", 20) + `","max_tokens":2,"ignore_eos":true}`
	ctx, cancel := context.WithCancel(context.Background())
	pa := pr.p.send(ctx, "/v1/completions", prefillLeg(t, body, "xfer-cut"), nil)
	pr.p.waitKV(t, "the prefill runs", func(s KVStats) bool { return s.RunningRequests == 1 })
	cancel()
	if a := testutil.Recv(t, testutil.Timeout, pa, "cut prefill leg"); a.err == nil {
		t.Fatalf("cut prefill leg answered %d %s, want a client error", a.status, a.body)
	}
	s := pr.p.waitKV(t, "the prefill is aborted", func(s KVStats) bool { return allFree(s) && s.AbortedTotal == 1 })
	if s.HoldsTotal != 0 || s.BlocksHeld != 0 {
		t.Errorf("prefiller /debug/kv = %+v, want nothing held", s)
	}
	// Its decode learns at once that there is nothing to pull.
	pr.checkUnavailable(t, body, "xfer-cut")
}

func TestMooncakeQueryAnswersPerRankAndTheHeaderPicksTheRank(t *testing.T) {
	pcfg := mooncakeConfig("prefill")
	pcfg.DataParallelSize = 2
	pr := startMooncake(t, pcfg, mooncakeConfig("decode"))
	q := pr.query(t)
	stats := pr.p.kv(t)
	if len(q) != 2 || len(stats.Ranks) != 2 || q["0"].EngineID == q["1"].EngineID {
		t.Fatalf("/query = %+v, /debug/kv ranks = %+v; want two ranks with their own engine ids", q, stats.Ranks)
	}
	for i, r := range stats.Ranks {
		if info := q[fmt.Sprint(i)]; info.EngineID != r.EngineID || info.DPRank != i || info.TPSize != 1 || info.Port != pr.p.e.boot.port() {
			t.Errorf("/query[%d] = %+v, want rank %d's engine id %q and the bootstrap port", i, info, i, r.EngineID)
		}
	}
	body := `{"prompt":"` + strings.Repeat("p q r s ", 20) + `","max_tokens":2,"ignore_eos":true}`
	pa := pr.p.send(context.Background(), "/v1/completions", prefillLeg(t, body, "xfer-r1"), map[string]string{HeaderDataParallelRank: "1"})
	da := pr.d.send(context.Background(), "/v1/completions", pr.decodeLeg(t, body, "xfer-r1", 1), map[string]string{"X-Request-Id": "r1"})
	if a := recvAnswer(t, pa, "prefill leg"); a.status != http.StatusOK {
		t.Fatalf("prefill leg answered %d %s", a.status, a.body)
	}
	if got, want := decodedText(t, recvAnswer(t, da, "decode leg"), false), expectedText(0, "r1", 2); got != want {
		t.Errorf("decode text = %q, want %q", got, want)
	}
	s := pr.p.waitKV(t, "prefiller frees its hold", allFree)
	if s.HoldsTotal != 1 || s.Ranks[1].HoldsTotal != 1 || s.Ranks[0].HoldsTotal != 0 || s.Ranks[1].RequestsTotal != 1 || s.Ranks[0].RequestsTotal != 0 {
		t.Errorf("prefiller /debug/kv = %+v, want the one prefill on rank 1", s)
	}
	if ds := pr.d.waitKV(t, "decoder done", allFree); ds.KVBlocksPulledTotal == 0 || ds.KVLoadFailuresTotal != 0 {
		t.Errorf("decoder /debug/kv = %+v, want blocks pulled from rank 1", ds)
	}
}

func TestMooncakeRefusesLegsItCannotServe(t *testing.T) {
	pr := startMooncake(t, mooncakeConfig("prefill"), mooncakeConfig("decode"))
	body := `{"prompt":"hello there","max_tokens":2}`
	for _, tc := range []struct {
		name string
		ts   *testServer
		kv   map[string]any
		want string
	}{
		{"older vLLM's bootstrap_server_host and port", pr.d, map[string]any{"do_remote_prefill": true,
			"bootstrap_server_host": "127.0.0.1", "bootstrap_server_port": 8998}, "older vLLM"},
		{"a decode without transfer_id", pr.d, map[string]any{"do_remote_prefill": true, "remote_bootstrap_addr": pr.boot}, "transfer_id"},
		{"a prefill without transfer_id", pr.p, map[string]any{"do_remote_decode": true}, "transfer_id"},
		{"a decode with a bad bootstrap address", pr.d, map[string]any{"do_remote_prefill": true, "remote_bootstrap_addr": "p:1", "transfer_id": "x"}, "remote_bootstrap_addr"},
		{"a prefill sent to the decoder", pr.d, map[string]any{"do_remote_decode": true, "transfer_id": "x"}, "decode engine"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := recvAnswer(t, tc.ts.send(context.Background(), "/v1/completions", withKV(t, body, tc.kv, nil), nil), tc.name)
			if a.status != http.StatusBadRequest || !strings.Contains(a.body, tc.want) {
				t.Errorf("answered %d %s, want a 400 saying %q", a.status, a.body, tc.want)
			}
		})
	}
}

// checkUnavailable sends a decode for a transfer the prefiller no longer has to the pair's
// decoder, which fails it (kv_load_failure_policy "fail", vLLM's default), and to a
// decoder that recomputes it.
func (pr *mcPair) checkUnavailable(t *testing.T, body, xfer string) {
	t.Helper()
	rcfg := mooncakeConfig("decode")
	rcfg.KVLoadFailurePolicy = KVLoadFailureRecompute
	for _, tc := range []struct {
		policy string
		d      *testServer
	}{
		{KVLoadFailureFail, pr.d},
		{KVLoadFailureRecompute, startSGLang(t, rcfg)},
	} {
		a := recvAnswer(t, tc.d.send(context.Background(), "/v1/completions", pr.decodeLeg(t, body, xfer, 0), map[string]string{"X-Request-Id": "late"}), "late decode")
		if tc.policy == KVLoadFailureFail {
			errorAnswer(t, a, http.StatusInternalServerError, "kv_transfer_failed", "decode for a transfer the prefiller no longer has")
		} else if got, want := decodedText(t, a, false), expectedText(0, "late", 2); got != want {
			t.Errorf("recomputed decode text = %q, want %q", got, want)
		}
		if ds := tc.d.waitKV(t, "decoder done", allFree); ds.KVLoadFailuresTotal != 1 || ds.KVBlocksPulledTotal != 0 {
			t.Errorf("%s decoder /debug/kv = %+v, want one load failure and nothing pulled", tc.policy, ds)
		}
	}
}

func TestMooncakeDecodeWhosePrefillNeverComesFailsAtTheWaitingTimeout(t *testing.T) {
	clock := newFakeClock()
	dcfg := mooncakeConfig("decode")
	dcfg.Clock, dcfg.WaitingTimeout = clock, time.Minute
	pr := startMooncake(t, mooncakeConfig("prefill"), dcfg)
	da := pr.d.send(context.Background(), "/v1/completions", pr.decodeLeg(t, `{"prompt":"hi there","max_tokens":2}`, "xfer-never", 0), nil)
	pr.d.waitKV(t, "the decode waits for its transfer", mcWaiting)
	clock.Advance(time.Minute)
	a := recvAnswer(t, da, "decode leg")
	errorAnswer(t, a, http.StatusInternalServerError, "kv_transfer_failed", "decode past the waiting timeout")
	if !strings.Contains(a.body, "waiting timeout") {
		t.Errorf("answer %s does not say the waiting timeout passed", a.body)
	}
	if s := pr.d.waitKV(t, "decoder done", func(s KVStats) bool { return allFree(s) && s.TransfersWaiting == 0 }); s.KVLoadFailuresTotal != 1 {
		t.Errorf("decoder /debug/kv = %+v, want one load failure", s)
	}
	testutil.Eventually(t, testutil.Timeout, func() bool { return transferWaiters(pr.p.e, "xfer-never") == 0 }, "the prefiller to see the claim withdrawn")
}

func TestMooncakeDecoderPullsOnlyTheBlocksItsPrefixCacheLacks(t *testing.T) {
	pr := startMooncake(t, mooncakeConfig("prefill"), mooncakeConfig("decode"))
	body := `{"prompt":"` + strings.Repeat("alpha beta gamma delta ", 12) + `","max_tokens":2,"ignore_eos":true}`
	pulled := make([]int, 2)
	for i, xfer := range []string{"xfer-first", "xfer-second"} {
		pa := pr.p.send(context.Background(), "/v1/completions", prefillLeg(t, body, xfer), nil)
		da := pr.d.send(context.Background(), "/v1/completions", pr.decodeLeg(t, body, xfer, 0), map[string]string{"X-Request-Id": xfer})
		if a := recvAnswer(t, pa, "prefill leg"); a.status != http.StatusOK {
			t.Fatalf("prefill leg answered %d %s", a.status, a.body)
		}
		if got, want := decodedText(t, recvAnswer(t, da, "decode leg"), false), expectedText(0, xfer, 2); got != want {
			t.Errorf("decode text = %q, want %q", got, want)
		}
		pr.p.waitKV(t, "prefiller frees its hold after the pull", allFree)
		pulled[i] = pr.d.waitKV(t, "decoder done", allFree).KVBlocksPulledTotal
	}
	if first, second := pulled[0], pulled[1]-pulled[0]; first < 2 || second >= first || second < 1 {
		t.Errorf("blocks pulled: %d the first time, %d the second; want the second to pull only what the decoder's cache lacks", first, second)
	}
}
