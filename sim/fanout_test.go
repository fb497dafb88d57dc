package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// fanOutAnswer is what these tests read of a prefill's whole answer.
type fanOutAnswer struct {
	Choices []struct {
		Index int `json:"index"`
	} `json:"choices"`
	Usage usage           `json:"usage"`
	KV    json.RawMessage `json:"kv_transfer_params"`
}

// checkFanOut runs a fanned-out prefill on a fresh pair and checks what a
// proxy would see: one params object for the X-Request-Id, holds for every
// child, and the invisible ones outliving the decode until their lease.
func checkFanOut(t *testing.T, path, body string, wantChoices, wantHolds, wantBlocks, wantPromptTokens int) {
	t.Helper()
	// Each child's blocks are its own, as without prefix caching: with it,
	// the children of one prompt share its full blocks.
	pd := startPDPairWith(t, noPrefixCache, nil)
	resp := pd.p.post(t, context.Background(), path, body, map[string]string{"X-Request-Id": "fan"})
	raw := readAll(t, resp)
	var ans fanOutAnswer
	if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &ans) != nil {
		t.Fatalf("prefill: %d %s", resp.StatusCode, raw)
	}
	if len(ans.Choices) != wantChoices || ans.Usage.PromptTokens != wantPromptTokens {
		t.Errorf("prefill answer %s: want %d choices and %d prompt tokens", raw, wantChoices, wantPromptTokens)
	}
	for i, c := range ans.Choices {
		if c.Index != i {
			t.Errorf("choice %d has index %d", i, c.Index)
		}
	}
	var kv kvTransferParams
	if err := json.Unmarshal(ans.KV, &kv); err != nil || kv.RemoteRequestID != "fan" {
		t.Fatalf("kv_transfer_params = %s, want one object for request fan", ans.KV)
	}
	s := pd.p.kv(t)
	if s.HeldRequests != wantHolds || s.BlocksHeld != wantBlocks {
		t.Fatalf("P /debug/kv = %+v, want %d holds of %d blocks in all", s, wantHolds, wantBlocks)
	}

	// The decoder reads and frees the one hold it was told about...
	resp = pd.d.post(t, context.Background(), "/v1/completions", `{"prompt":"x","max_tokens":1,"kv_transfer_params":`+string(ans.KV)+`}`, map[string]string{"X-Request-Id": "fan"})
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Fatalf("decode: %d %s", resp.StatusCode, b)
	}
	pd.p.waitKV(t, "P frees the hold it was told about", func(s KVStats) bool { return s.HeldRequests == wantHolds-1 })
	// ... and the others, which nobody can name, stay until their lease ends.
	pd.clock.Advance(30 * time.Second)
	s = pd.p.waitKV(t, "the invisible holds expire", allFree)
	if s.ExpiredTotal != wantHolds-1 || s.DoubleFreeAttemptsTotal != 0 || s.LateEventsTotal != 0 {
		t.Errorf("P /debug/kv = %+v, want %d expiries", s, wantHolds-1)
	}
}

func TestPrefillWithNHoldsEveryChildAndAnswersOneParams_Issue38900(t *testing.T) {
	prompt := strings.Repeat("abcd", 40) // 40 tokens: 3 blocks
	tests := []struct {
		name, path, body         string
		choices, holds, promptTk int
	}{
		{"completions n=3", "/v1/completions", `{"prompt":"` + prompt + `","n":3,"max_tokens":1,` + prefillKV + `}`, 3, 3, 40},
		{"completions best_of=4 n=2 runs 4, shows 2", "/v1/completions", `{"prompt":"` + prompt + `","n":2,"best_of":4,"max_tokens":1,` + prefillKV + `}`, 2, 4, 40},
		// The chat template adds 10 tokens: 4 blocks.
		{"chat n=2", "/v1/chat/completions", `{"messages":[{"role":"user","content":"` + prompt + `"}],"n":2,"max_tokens":1,"max_completion_tokens":1,` + prefillKV + `}`, 2, 2, 50},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFanOut(t, tt.path, tt.body, tt.choices, tt.holds, (tt.promptTk+15)/16*tt.holds, tt.promptTk)
		})
	}
}

func TestPrefillOfAPromptArrayHoldsEachPromptAndAnswersTheFirstsParams_Issue54707(t *testing.T) {
	long := strings.Repeat("abcd", 40) // 40 tokens: 3 blocks
	tests := []struct {
		name, body                       string
		choices, holds, blocks, promptTk int
	}{
		{"two strings", `{"prompt":["` + long + `","hi"],"max_tokens":1,` + prefillKV + `}`, 2, 2, 3 + 1, 41},
		{"two token lists", `{"prompt":[[1,2,3],[4,5,6,7,8,9,10,11,12,13,14,15,16,17]],"max_tokens":1,` + prefillKV + `}`, 2, 2, 1 + 1, 17},
		{"two prompts with n=2", `{"prompt":["` + long + `","hi"],"n":2,"max_tokens":1,` + prefillKV + `}`, 4, 4, 3 + 3 + 1 + 1, 41},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkFanOut(t, "/v1/completions", tt.body, tt.choices, tt.holds, tt.blocks, tt.promptTk)
		})
	}
}

func TestPromptLogprobsOnADecodeWithParamsCrashesTheDecoder_Issue50792(t *testing.T) {
	tests := []struct {
		name, path, extra string
		crash             bool
	}{
		{"prompt_logprobs", "/v1/completions", `"prompt_logprobs":0`, true},
		{"echo with logprobs", "/v1/completions", `"echo":true,"logprobs":1`, true},
		{"chat echo with logprobs", "/v1/chat/completions", `"echo":true,"logprobs":true`, true},
		{"echo without logprobs is safe", "/v1/completions", `"echo":true,"logprobs":null`, false},
		{"logprobs without echo is safe", "/v1/completions", `"logprobs":2`, false},
		{"chat echo with logprobs false is safe", "/v1/chat/completions", `"echo":true,"logprobs":false`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pd := startPDPair(t, nil)
			kv := pd.p.prefill(t, "lp", "hello")
			input := `"prompt":"hello"`
			if strings.HasPrefix(tt.path, "/v1/chat") {
				input = `"messages":[{"role":"user","content":"hello"}]`
			}
			resp := pd.d.post(t, context.Background(), tt.path, `{`+input+`,"max_tokens":1,`+tt.extra+`,"kv_transfer_params":`+kv+`}`, map[string]string{"X-Request-Id": "lp"})
			body := readAll(t, resp)
			if !tt.crash {
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("decode: %d %s", resp.StatusCode, body)
				}
				if s := pd.d.kv(t); s.EngineCrashesTotal != 0 {
					t.Errorf("D /debug/kv = %+v, want no crash", s)
				}
				return
			}
			if resp.StatusCode != http.StatusInternalServerError || decodeError(t, body).Code != "engine_dead" {
				t.Fatalf("decode: %d %s, want a 500 engine_dead", resp.StatusCode, body)
			}
			if s := pd.d.kv(t); s.EngineCrashesTotal != 1 || !allFree(s) {
				t.Errorf("D /debug/kv = %+v, want one crash and nothing left", s)
			}
		})
	}

	// The same requests without kv_transfer_params are served.
	ts := startServer(t, fastConfig())
	resp := ts.post(t, context.Background(), "/v1/completions", `{"prompt":"hello","max_tokens":2,"prompt_logprobs":1,"echo":true,"logprobs":1}`, nil)
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Errorf("aggregated request with prompt logprobs: %d %s", resp.StatusCode, b)
	}
}

func TestDecoderCrashFailsEveryRequestAndItsHoldsEndWithTheirLeases_Issue50792_PR41383(t *testing.T) {
	pd := startPDPair(t, func(c *Config) { c.MaxRunning = 1 })

	// A stream that is running when the engine dies.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream := pd.d.post(t, ctx, "/v1/completions", `{"prompt":"busy","max_tokens":1000,"ignore_eos":true,"stream":true}`, map[string]string{"X-Request-Id": "running"})
	defer stream.Body.Close()
	sr := bufio.NewReader(stream.Body)
	if line, err := sr.ReadString('\n'); err != nil || !strings.Contains(line, " tok") {
		t.Fatalf("stream's first line %q, %v", line, err)
	}
	// A decode queued behind it, whose heartbeats keep its prefill held.
	kvQ := pd.p.prefill(t, "queued", "hello")
	queued := decodeInBackground(t, context.Background(), pd.d, "queued", `{"prompt":"hello","max_tokens":1,"kv_transfer_params":`+kvQ+`}`)
	pd.d.waitKV(t, "decode queued", func(s KVStats) bool { return s.WaitingRequests == 1 })
	pd.clock.Advance(5 * time.Second)
	pd.p.waitKV(t, "a heartbeat", func(s KVStats) bool { return s.HeartbeatsTotal == 1 })

	// The request that kills the engine.
	kvLP := pd.p.prefill(t, "lp", "hello")
	resp := pd.d.post(t, context.Background(), "/v1/completions", `{"prompt":"hello","max_tokens":1,"prompt_logprobs":1,"kv_transfer_params":`+kvLP+`}`, map[string]string{"X-Request-Id": "lp"})
	if b := readAll(t, resp); resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("crashing decode: %d %s", resp.StatusCode, b)
	}
	if res := testutil.Recv(t, testutil.Timeout, queued, "the queued decode"); res.status != http.StatusInternalServerError || !strings.Contains(res.body, "engine_dead") {
		t.Errorf("queued decode: %d %s, want a 500 engine_dead", res.status, res.body)
	}
	rest, _ := io.ReadAll(sr)
	if !strings.Contains(string(rest), `"code":"engine_dead"`) {
		t.Errorf("running stream after the crash: %s, want an engine_dead error event", rest)
	}
	s := pd.d.waitKV(t, "D empty", allFree)
	if s.EngineCrashesTotal != 1 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("D /debug/kv = %+v", s)
	}

	// A dead decoder notifies nobody and heartbeats no more: P keeps both
	// holds until their leases end, 30s after the prefill or the last heartbeat.
	if s := barrier(t, pd.p); s.HeldRequests != 2 {
		t.Fatalf("P /debug/kv = %+v, want both holds kept", s)
	}
	pd.clock.Advance(30 * time.Second)
	s = pd.p.waitKV(t, "both leases end", allFree)
	if s.ExpiredTotal != 2 || s.HeartbeatsTotal != 1 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("P /debug/kv = %+v, want 2 expiries after 1 heartbeat", s)
	}

	// The sim restarts at once and serves again.
	resp = pd.d.post(t, context.Background(), "/v1/completions", `{"prompt":"again","max_tokens":1}`, nil)
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Errorf("after the crash: %d %s", resp.StatusCode, b)
	}
}
