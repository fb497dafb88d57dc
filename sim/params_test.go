package sim

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// prefillAnswer is the part of a prefill's answer these tests read.
type prefillAnswer struct {
	Choices []struct {
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	KV json.RawMessage `json:"kv_transfer_params"`
}

func TestPrefillThatStopsOnEOSHoldsAndReturnsParams_FinishedStopped2026(t *testing.T) {
	rid := ridWithEOS("eos", 0)          // its only token is an EOS
	prompt := strings.Repeat("abcd", 20) // 20 tokens: 2 blocks
	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "whole answer", true: "stream"}[stream], func(t *testing.T) {
			pd := startPDPair(t, nil)
			body := `{"prompt":"` + prompt + `","max_tokens":1,"stream":` + map[bool]string{false: "false", true: "true"}[stream] + `,` + prefillKV + `}`
			resp := pd.p.post(t, context.Background(), "/v1/completions", body, map[string]string{"X-Request-Id": rid})
			raw := readAll(t, resp)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("prefill: %d %s", resp.StatusCode, raw)
			}
			if stream {
				events := sseEvents(t, raw)
				if len(events) < 2 || events[len(events)-1] != "[DONE]" {
					t.Fatalf("prefill stream %q", events)
				}
				raw = []byte(events[len(events)-2]) // the final chunk carries the params
			}
			var ans prefillAnswer
			if err := json.Unmarshal(raw, &ans); err != nil || len(ans.Choices) != 1 || ans.Choices[0].FinishReason != "stop" {
				t.Fatalf("prefill answer %s (%v), want one choice finished on stop", raw, err)
			}
			var kv map[string]any
			if err := json.Unmarshal(ans.KV, &kv); err != nil || kv == nil {
				t.Fatalf("kv_transfer_params = %s, want an object: FINISHED_STOPPED holds too", ans.KV)
			}
			leaseEnd := pd.clock.Now().Add(30 * time.Second)
			want := map[string]any{
				"do_remote_prefill": true, "do_remote_decode": false, "remote_request_id": rid,
				"remote_engine_id": pd.p.e.ID(), "tp_size": 1.0,
				"remote_num_tokens": 20.0, "remote_blocks_expiry_time": float64(leaseEnd.UnixNano()) / 1e9,
				"transfer_mode": "read", "dcp_size": 1.0, "pp_size": 1.0,
			}
			for k, v := range want {
				if kv[k] != v {
					t.Errorf("kv_transfer_params.%s = %v, want %v (all: %s)", k, kv[k], v, ans.KV)
				}
			}
			if ids, _ := kv["remote_block_ids"].([]any); len(ids) != 2 {
				t.Errorf("remote_block_ids = %v, want 2 blocks", kv["remote_block_ids"])
			}
			if s := pd.p.kv(t); s.HeldRequests != 1 || s.BlocksHeld != 2 {
				t.Fatalf("P /debug/kv = %+v, want the EOS prefill held", s)
			}

			// The decoder ignores the fields it does not use, reads and frees.
			resp = pd.d.post(t, context.Background(), "/v1/completions",
				`{"prompt":"`+prompt+`","max_tokens":1,"ignore_eos":true,"kv_transfer_params":`+string(ans.KV)+`}`, map[string]string{"X-Request-Id": rid})
			if b := readAll(t, resp); resp.StatusCode != http.StatusOK {
				t.Fatalf("decode: %d %s", resp.StatusCode, b)
			}
			if s := pd.p.waitKV(t, "P frees on the notify", allFree); s.LateEventsTotal != 0 || s.ExpiredTotal != 0 {
				t.Errorf("P /debug/kv = %+v", s)
			}
		})
	}
}

func TestDecodeWithoutRemoteBlocksComputesThePromptItself_2026(t *testing.T) {
	for _, ids := range []string{`[]`, `null`} {
		t.Run("remote_block_ids "+ids, func(t *testing.T) {
			p := startServer(t, fastConfig())
			d := startServer(t, fastConfig())
			kv := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":` + ids + `,"remote_engine_id":"` + p.e.ID() +
				`","remote_request_id":"short","remote_host":"127.0.0.1","remote_port":` + p.srv.URL[strings.LastIndex(p.srv.URL, ":")+1:] +
				`,"tp_size":1,"remote_num_tokens":3,"transfer_mode":"read","some_future_field":{"x":1}}`
			resp := d.post(t, context.Background(), "/v1/completions", `{"prompt":"hello","max_tokens":3,"ignore_eos":true,"kv_transfer_params":`+kv+`}`,
				map[string]string{"X-Request-Id": "short"})
			body := string(readAll(t, resp))
			if resp.StatusCode != http.StatusOK || !strings.Contains(body, expectedText(0, "short", 3)) {
				t.Fatalf("decode: %d %s", resp.StatusCode, body)
			}
			d.waitKV(t, "D frees", allFree)
			// Nothing to read means nothing held: no pull, no notify, no heartbeat.
			if s := p.kv(t); s.LateEventsTotal != 0 || s.HeartbeatsTotal != 0 {
				t.Errorf("P /debug/kv = %+v, want no event from D", s)
			}
		})
	}
}
