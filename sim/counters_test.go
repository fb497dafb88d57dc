package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// prefillHold runs a prefill of prompt on p and returns its kv_transfer_params.
func prefillHold(t *testing.T, p *testServer, rid, body string) string {
	t.Helper()
	resp := p.post(t, context.Background(), "/v1/completions", body, map[string]string{"X-Request-Id": rid})
	b := readAll(t, resp)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("prefill: status %d: %s", resp.StatusCode, b)
	}
	var pr struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(b, &pr); err != nil || len(pr.KV) == 0 || string(pr.KV) == "null" {
		t.Fatalf("prefill answered %s (%v), want kv_transfer_params", b, err)
	}
	return string(pr.KV)
}

func TestHoldsTotalCountsEveryPrefillThatEndsHoldingKV(t *testing.T) {
	prompt := strings.Repeat("abcd", 20)
	tests := []struct {
		name string
		body string
		want int
	}{
		{"a prefill holds once", `{"prompt":"` + prompt + `","max_tokens":1,` + prefillKV + `}`, 1},
		{"a prefill with n=3 holds once per sample (vLLM #38900)", `{"prompt":"` + prompt + `","max_tokens":1,"n":3,` + prefillKV + `}`, 3},
		{"a prefill of two prompts holds once per prompt (vLLM #54707)", `{"prompt":["` + prompt + `","x"],"max_tokens":1,` + prefillKV + `}`, 2},
		{"a request without kv_transfer_params holds nothing", `{"prompt":"` + prompt + `","max_tokens":1}`, 0},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startServer(t, fastConfig())
			resp := p.post(t, context.Background(), "/v1/completions", tt.body, map[string]string{"X-Request-Id": fmt.Sprintf("holds-%d", i)})
			if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, b)
			}
			if s := p.kv(t); s.HoldsTotal != tt.want || s.HeldRequests != tt.want {
				t.Errorf("/debug/kv holds_total = %d with %d held, want %d", s.HoldsTotal, s.HeldRequests, tt.want)
			}
			if s := p.kv(t); s.RemotePrefillRequestsTotal != 0 {
				t.Errorf("prefiller counted %d remote prefill requests, want 0", s.RemotePrefillRequestsTotal)
			}
		})
	}
}

func TestRemotePrefillRequestsTotalCountsEachDecodeRequestThatArrivesWithParams(t *testing.T) {
	prompt := strings.Repeat("abcd", 20)
	p := startServer(t, fastConfig())
	u, _ := url.Parse(p.srv.URL)
	// Params naming blocks nobody holds: a decode pulling them fails, a rejected one
	// notifies P for nothing (a late event there). What is counted is the arrival.
	stale := fmt.Sprintf(`{"do_remote_prefill":true,"remote_block_ids":[1],"remote_engine_id":%q,"remote_request_id":"stale","remote_host":"127.0.0.1","remote_port":%s}`, p.e.ID(), u.Port())
	tests := []struct {
		name   string
		body   func(kv string) string
		hdr    map[string]string
		status int
		want   int
		hold   bool // the decode reads a real hold on P
		holds  int  // holds_total on the decoder
	}{
		{
			name: "a decode of a held prefill counts once",
			body: func(kv string) string {
				return `{"prompt":"` + prompt + `","max_tokens":4,"kv_transfer_params":` + kv + `}`
			},
			status: http.StatusOK, want: 1, hold: true,
		},
		{
			name: "a decode streamed counts once, not per chunk",
			body: func(kv string) string {
				return `{"prompt":"` + prompt + `","max_tokens":4,"stream":true,"kv_transfer_params":` + kv + `}`
			},
			status: http.StatusOK, want: 1, hold: true,
		},
		{
			name:   "a decode rejected by the serving layer counts",
			body:   func(string) string { return `{"prompt":"x","max_tokens":0,"kv_transfer_params":` + stale + `}` },
			status: http.StatusBadRequest, want: 1,
		},
		{
			name:   "a decode with n=2 is one request and counts once",
			body:   func(string) string { return `{"prompt":"x","n":2,"kv_transfer_params":` + stale + `}` },
			status: http.StatusBadRequest, want: 1,
		},
		{
			name:   "a decode answered by an injected failure counts",
			body:   func(string) string { return `{"prompt":"x","kv_transfer_params":` + stale + `}` },
			hdr:    map[string]string{HeaderFailStatus: "503"},
			status: http.StatusServiceUnavailable, want: 1,
		},
		{
			name:   "a decode whose pull fails counts",
			body:   func(string) string { return `{"prompt":"x","kv_transfer_params":` + stale + `}` },
			status: http.StatusInternalServerError, want: 1,
		},
		{
			name:   "a request without kv_transfer_params does not count",
			body:   func(string) string { return `{"prompt":"x","max_tokens":2}` },
			status: http.StatusOK, want: 0,
		},
		{
			name:   "a prefill does not count",
			body:   func(string) string { return `{"prompt":"x","max_tokens":1,` + prefillKV + `}` },
			status: http.StatusOK, want: 0, holds: 1,
		},
		{
			name:   "a body that is not JSON does not count",
			body:   func(string) string { return `{"prompt":` },
			status: http.StatusBadRequest, want: 0,
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := startServer(t, fastConfig())
			rid := fmt.Sprintf("remote-%d", i)
			kv := stale
			if tt.hold {
				kv = prefillHold(t, p, rid, `{"prompt":"`+prompt+`","max_tokens":1,`+prefillKV+`}`)
			}
			hdr := map[string]string{"X-Request-Id": rid}
			for k, v := range tt.hdr {
				hdr[k] = v
			}
			resp := d.post(t, context.Background(), "/v1/completions", tt.body(kv), hdr)
			if b := readAll(t, resp); resp.StatusCode != tt.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tt.status, b)
			}
			if s := d.kv(t); s.RemotePrefillRequestsTotal != tt.want || s.HoldsTotal != tt.holds {
				t.Errorf("decoder /debug/kv remote_prefill_requests_total = %d, holds_total = %d; want %d and %d", s.RemotePrefillRequestsTotal, s.HoldsTotal, tt.want, tt.holds)
			}
			d.waitKV(t, "decoder ends every request", func(s KVStats) bool {
				return s.BlocksInUse == 0 && s.RunningRequests == 0 && s.WaitingRequests == 0
			})
		})
	}
	p.waitKV(t, "prefiller frees every hold its decoders read", allFree)
}
