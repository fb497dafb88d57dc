package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
)

const prefillKV = `"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

func TestPrefillThenDecodeOverHTTPStreamsAndFreesAllBlocks(t *testing.T) {
	prompt := strings.Repeat("abcd", 40) // 40 tokens: 3 blocks of 16
	tests := []struct {
		name      string
		path      string
		prefill   string
		decode    func(kv string) string
		wantUsage bool
		tokens    int // the prompt's, chat template included
	}{
		{
			name:    "completions stream",
			path:    "/v1/completions",
			prefill: `{"model":"sim","prompt":"` + prompt + `","max_tokens":1,"stream":false,` + prefillKV + `}`,
			decode: func(kv string) string {
				return `{"model":"sim","prompt":"` + prompt + `","max_tokens":8,"ignore_eos":true,"stream":true,"kv_transfer_params":` + kv + `}`
			},
			tokens: 40,
		},
		{
			name:    "chat stream with usage",
			path:    "/v1/chat/completions",
			prefill: `{"messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":1,"max_completion_tokens":1,` + prefillKV + `}`,
			decode: func(kv string) string {
				return `{"messages":[{"role":"user","content":"` + prompt + `"}],"max_completion_tokens":8,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true},"kv_transfer_params":` + kv + `}`
			},
			wantUsage: true,
			tokens:    50,
		},
		{
			name:    "responses stream",
			path:    "/v1/responses",
			prefill: `{"model":"sim","input":"` + prompt + `","max_output_tokens":1,"stream":false,` + prefillKV + `}`,
			decode: func(kv string) string {
				return `{"model":"sim","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"` + prompt + `"}]}],"max_output_tokens":8,"ignore_eos":true,"stream":true,"kv_transfer_params":` + kv + `}`
			},
			tokens: 50, // a chat's: the same template
		},
		{
			name:    "messages stream",
			path:    "/v1/messages",
			prefill: `{"model":"sim","messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":1,"stream":false,` + prefillKV + `}`,
			decode: func(kv string) string {
				return `{"model":"sim","messages":[{"role":"user","content":[{"type":"text","text":"` + prompt + `"}]}],"max_tokens":8,"ignore_eos":true,"stream":true,"kv_transfer_params":` + kv + `}`
			},
			tokens: 50, // a chat's: the same template
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startServer(t, fastConfig())
			d := startServer(t, fastConfig())
			rid := "happy-" + strings.ReplaceAll(tt.name, " ", "-")
			hdr := map[string]string{"X-Request-Id": rid}

			resp := p.post(t, context.Background(), tt.path, tt.prefill, hdr)
			body := readAll(t, resp)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("prefill: status %d: %s", resp.StatusCode, body)
			}
			if got := resp.Header.Get("X-Request-Id"); got != rid {
				t.Errorf("prefill echoed X-Request-Id %q, want %q", got, rid)
			}
			var pr struct {
				KV json.RawMessage `json:"kv_transfer_params"`
			}
			if err := json.Unmarshal(body, &pr); err != nil {
				t.Fatalf("prefill body %s: %v", body, err)
			}
			var kv kvTransferParams
			if err := json.Unmarshal(pr.KV, &kv); err != nil || !kv.DoRemotePrefill {
				t.Fatalf("prefill kv_transfer_params = %s, want an object with do_remote_prefill", pr.KV)
			}
			u, _ := url.Parse(p.srv.URL)
			if strconv.Itoa(kv.RemotePort) != u.Port() || kv.RemoteHost != "127.0.0.1" || kv.RemoteRequestID != rid || kv.RemoteEngineID != p.e.ID() {
				t.Errorf("prefill kv_transfer_params = %+v, want P's address %s, request %s, engine %s", kv, u.Host, rid, p.e.ID())
			}
			blocks := (tt.tokens + 15) / 16
			if prompt, completion := usageTokens(t, body); len(kv.RemoteBlockIDs) != blocks || prompt != tt.tokens || completion != 1 {
				t.Errorf("prefill holds %d blocks with usage %d+%d, want %d blocks, %d prompt tokens, 1 completion token", len(kv.RemoteBlockIDs), prompt, completion, blocks, tt.tokens)
			}
			if s := p.kv(t); s.BlocksHeld != blocks || s.HeldRequests != 1 {
				t.Errorf("after prefill P /debug/kv = %+v, want %d blocks held by 1 request", s, blocks)
			}

			resp = d.post(t, context.Background(), tt.path, tt.decode(string(pr.KV)), hdr)
			body = readAll(t, resp)
			if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				t.Fatalf("decode: status %d, content type %q: %s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
			}
			events := sseEvents(t, body)
			text, finish := streamText(t, events)
			if want := expectedText(0, rid, 8); text != want || finish != "length" {
				t.Errorf("decode streamed %q (finish %q), want %q (finish length)", text, finish, want)
			}
			if tt.wantUsage {
				last := events[len(events)-2]
				if !strings.Contains(last, `"usage":{"prompt_tokens":50,"completion_tokens":8,"total_tokens":58,"prompt_tokens_details":{"cached_tokens":0}}`) || !strings.Contains(last, `"choices":[]`) {
					t.Errorf("usage chunk = %s", last)
				}
				if !strings.Contains(events[0], `"role":"assistant"`) {
					t.Errorf("first chat chunk %s has no assistant role", events[0])
				}
			}
			p.waitKV(t, "prefiller frees after the decoder's notify", allFree)
			d.waitKV(t, "decoder frees after the stream", allFree)
			for name, s := range map[string]KVStats{"P": p.kv(t), "D": d.kv(t)} {
				if s.LateEventsTotal != 0 || s.DoubleFreeAttemptsTotal != 0 || s.ExpiredTotal != 0 || s.AbortedTotal != 0 {
					t.Errorf("%s counters = %+v, want no late events, double frees, expiries or aborts", name, s)
				}
			}
		})
	}
}

func TestPlainRequestIsServedAggregated(t *testing.T) {
	ts := startServer(t, fastConfig())
	tests := []struct {
		name, path, body, want, usage string
	}{
		{"completions non-streaming", "/v1/completions", `{"prompt":"hi","max_tokens":5,"ignore_eos":true}`, `"text":"%s"`,
			`"usage":{"prompt_tokens":1,"completion_tokens":5,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":0}}`},
		// The chat template: <|im_start|> user \n hi <|im_end|> \n <|im_start|> assi stan t \n.
		{"chat non-streaming", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"ignore_eos":true}`, `"message":{"role":"assistant","content":"%s"}`,
			`"usage":{"prompt_tokens":11,"completion_tokens":5,"total_tokens":16,"prompt_tokens_details":{"cached_tokens":0}}`},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rid := fmt.Sprintf("plain-%d", i)
			resp := ts.post(t, context.Background(), tt.path, tt.body, map[string]string{"X-Request-Id": rid})
			body := string(readAll(t, resp))
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			for _, want := range []string{
				fmt.Sprintf(tt.want, expectedText(0, rid, 5)),
				`"finish_reason":"length"`,
				tt.usage,
				`"kv_transfer_params":null`,
				rid + `"`,
			} {
				if !strings.Contains(body, want) {
					t.Errorf("body %s lacks %s", body, want)
				}
			}
		})
	}
	ts.waitKV(t, "all free", allFree)
}
