package sim

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// barrier returns once ts's scheduler has applied every event queued before
// it: a heartbeat for an unknown id is one more event, applied in order and
// counted late. It lets a test assert that something did NOT happen.
func barrier(t *testing.T, ts *testServer) KVStats {
	t.Helper()
	before := ts.kv(t).LateEventsTotal
	resp := ts.post(t, context.Background(), "/kv/heartbeat", `{"request_ids":["barrier"]}`, nil)
	if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
		t.Fatalf("barrier: %d %s", resp.StatusCode, b)
	}
	s := ts.waitKV(t, "barrier", func(s KVStats) bool { return s.LateEventsTotal == before+1 })
	s.LateEventsTotal-- // the barrier's own
	return s
}

func TestDecoderRejectingAParsedBodyNotifiesThePrefiller_PR41269(t *testing.T) {
	prompt := strings.Repeat("abcd", 40) // 40 tokens
	tests := []struct {
		name string
		body func(kv string) string
		code string
		// freed: the prefiller heard of the rejection and freed its hold
		freed bool
		// status is the answer's, 400 when zero; vLLM's 404s carry a numeric code.
		status int
	}{
		{"max_tokens 0", func(kv string) string {
			return `{"prompt":"` + prompt + `","max_tokens":0,"kv_transfer_params":` + kv + `}`
		}, "invalid_max_tokens", true, 0},
		{"max_tokens negative", func(kv string) string {
			return `{"prompt":"` + prompt + `","max_tokens":-5,"kv_transfer_params":` + kv + `}`
		}, "invalid_max_tokens", true, 0},
		{"prompt longer than --max-model-len", func(kv string) string {
			return `{"prompt":"` + prompt + `","max_tokens":4,"kv_transfer_params":` + kv + `}`
		}, "prompt_too_long", true, 0},
		{"chat prompt longer than --max-model-len", func(kv string) string {
			return `{"messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":4,"kv_transfer_params":` + kv + `}`
		}, "prompt_too_long", true, 0},
		{"responses prompt longer than --max-model-len", func(kv string) string {
			return `{"input":"` + prompt + `","max_output_tokens":4,"kv_transfer_params":` + kv + `}`
		}, "prompt_too_long", true, 0},
		{"responses previous_response_id the decoder never stored", func(kv string) string {
			return `{"input":"` + prompt + `","previous_response_id":"resp_elsewhere","kv_transfer_params":` + kv + `}`
		}, "", true, http.StatusNotFound},
		{"a model the decoder does not serve", func(kv string) string {
			return `{"model":"other","prompt":"` + prompt + `","max_tokens":4,"kv_transfer_params":` + kv + `}`
		}, "", true, http.StatusNotFound},
		{"malformed JSON fails before the handler", func(kv string) string {
			return `{"prompt":"` + prompt + `","max_tokens":4,"kv_transfer_params":` + kv + `,}`
		}, "invalid_json", false, 0},
		{"max_tokens of the wrong JSON type fails before the handler", func(kv string) string {
			return `{"prompt":"` + prompt + `","max_tokens":"4","kv_transfer_params":` + kv + `}`
		}, "invalid_json", false, 0},
		{"prompt of the wrong JSON type fails before the handler", func(kv string) string {
			return `{"prompt":{"text":"x"},"max_tokens":4,"kv_transfer_params":` + kv + `}`
		}, "invalid_prompt", false, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startServer(t, fastConfig())
			dc := fastConfig()
			dc.MaxModelLen = 32
			d := startServer(t, dc)
			kv := p.prefill(t, "rejected", prompt)
			path := "/v1/completions"
			switch {
			case strings.HasPrefix(tt.name, "chat"):
				path = "/v1/chat/completions"
			case strings.HasPrefix(tt.name, "responses"):
				path = "/v1/responses"
			}
			resp := d.post(t, context.Background(), path, tt.body(kv), map[string]string{"X-Request-Id": "rejected"})
			body := readAll(t, resp)
			want := http.StatusBadRequest
			if tt.status != 0 {
				want = tt.status
			}
			if resp.StatusCode != want {
				t.Fatalf("decode: status %d, body %s; want %d", resp.StatusCode, body, want)
			}
			if tt.code == "" {
				if !strings.Contains(string(body), fmt.Sprintf(`"code":%d`, want)) {
					t.Errorf("body %s lacks vLLM's numeric code %d", body, want)
				}
			} else if e := decodeError(t, body); e.Code != tt.code {
				t.Errorf("error code %q, want %q", e.Code, tt.code)
			}
			// The notify is sent before the 400: a barrier behind it on P
			// shows whether it came.
			s := barrier(t, p)
			if tt.freed && (!allFree(s) || s.LateEventsTotal != 0) {
				t.Errorf("P /debug/kv = %+v, want the hold freed by D's notify", s)
			}
			if !tt.freed && s.HeldRequests != 1 {
				t.Errorf("P /debug/kv = %+v, want the hold kept: D never saw the request", s)
			}
			if ds := d.kv(t); ds.RequestsTotal != 0 || !allFree(ds) {
				t.Errorf("D /debug/kv = %+v, want nothing scheduled", ds)
			}
		})
	}
}

func TestDecoderAbortingAQueuedDecodeNotifiesThePrefiller_Issue19223(t *testing.T) {
	pd := startPDPair(t, func(c *Config) { c.MaxRunning = 1 })
	stopBlocker := occupy(t, pd.d, "blocker")
	defer stopBlocker()
	kv := pd.p.prefill(t, "queued", "hello")
	ctx, cancel := context.WithCancel(context.Background())
	done := decodeInBackground(t, ctx, pd.d, "queued", `{"prompt":"hello","max_tokens":4,"kv_transfer_params":`+kv+`}`)
	pd.d.waitKV(t, "decode queued", func(s KVStats) bool { return s.WaitingRequests == 1 })
	cancel() // the client leaves before D scheduled the decode
	if res := testutil.Recv(t, testutil.Timeout, done, "the decode"); res.status != -1 {
		t.Fatalf("decode answered %d %s after its client left", res.status, res.body)
	}
	if s := pd.p.waitKV(t, "P frees on D's notify", allFree); s.ExpiredTotal != 0 || s.LateEventsTotal != 0 {
		t.Errorf("P /debug/kv = %+v", s)
	}
	s := pd.d.waitKV(t, "decode aborted", func(s KVStats) bool { return s.WaitingRequests == 0 })
	if s.AbortedTotal != 1 || s.DoubleFreeAttemptsTotal != 0 {
		t.Errorf("D /debug/kv = %+v, want one abort", s)
	}
}
