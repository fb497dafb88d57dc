package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// ids40 is a prompt of 40 token ids: two full blocks of 16 and a partial one.
func ids40() string {
	var b strings.Builder
	for i := range 40 {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, 100+i)
	}
	return "[" + b.String() + "]"
}

// A generate request is prefilled on one engine and decoded on another as vLLM's token-in
// route serves it: the prefill answers its kv_transfer_params at the top, the decode pulls
// the held blocks and streams token ids, one event each, its usage, [DONE]; nothing stays
// held.
func TestAGenerateRequestIsPrefilledAndDecodedWithTokenIDsOnly(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream %v", stream), func(t *testing.T) {
			p, d := startServer(t, fastConfig()), startServer(t, fastConfig())
			hdr := map[string]string{"X-Request-Id": "gen-1"}
			resp := p.post(t, context.Background(), generateRoute,
				`{"model":"sim","token_ids":`+ids40()+`,"sampling_params":{"max_tokens":1},"stream":false,`+prefillKV+`}`, hdr)
			b := readAll(t, resp)
			var pr struct {
				RequestID string           `json:"request_id"`
				Choices   []genChoice      `json:"choices"`
				KV        *prefillKVParams `json:"kv_transfer_params"`
			}
			if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &pr) != nil || pr.KV == nil || len(pr.KV.RemoteBlockIDs) == 0 {
				t.Fatalf("prefill: status %d: %s", resp.StatusCode, b)
			}
			if pr.RequestID != "generate-tokens-gen-1" || len(pr.Choices) != 1 || len(pr.Choices[0].TokenIDs) != 1 || *pr.Choices[0].FinishReason != "length" {
				t.Errorf("prefill answer %s, want request_id generate-tokens-gen-1 and one choice of one token, finished by length", b)
			}
			kv, _ := json.Marshal(pr.KV)
			body := fmt.Sprintf(`{"model":"sim","token_ids":%s,"sampling_params":{"max_tokens":5,"ignore_eos":true},"stream":%v,"stream_options":{"include_usage":true},"kv_transfer_params":%s}`, ids40(), stream, kv)
			resp = d.post(t, context.Background(), generateRoute, body, hdr)
			b = readAll(t, resp)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("decode: status %d: %s", resp.StatusCode, b)
			}
			var ids []uint32
			if stream {
				events := sseEvents(t, b)
				if len(events) != 7 || events[6] != "[DONE]" {
					t.Fatalf("stream of %d events, want 5 tokens, the usage and [DONE]: %s", len(events), b)
				}
				for i, ev := range events[:5] {
					var e genEvent
					if err := json.Unmarshal([]byte(ev), &e); err != nil || e.RequestID != "generate-tokens-gen-1" || len(e.Choices) != 1 || len(e.Choices[0].TokenIDs) != 1 {
						t.Fatalf("event %d %s: want one choice of one token id", i, ev)
					}
					if last := i == 4; (e.Choices[0].FinishReason != nil) != last {
						t.Errorf("event %d %s: a finish_reason on the last token's event only", i, ev)
					}
					if strings.Contains(ev, `"text"`) {
						t.Errorf("event %d carries text: %s", i, ev)
					}
					ids = append(ids, e.Choices[0].TokenIDs...)
				}
				var u genEvent
				if json.Unmarshal([]byte(events[5]), &u) != nil || len(u.Choices) != 0 || u.Usage == nil || u.Usage.CompletionTokens != 5 || u.Usage.PromptTokens != 40 {
					t.Errorf("usage event %s, want no choice and 40 prompt and 5 completion tokens", events[5])
				}
			} else {
				var a genAnswer
				if err := json.Unmarshal(b, &a); err != nil || len(a.Choices) != 1 || a.KVTransferParams != nil || a.Usage == nil || a.Usage.CompletionTokens != 5 {
					t.Fatalf("decode answer %s: want one choice, no kv_transfer_params, 5 completion tokens", b)
				}
				ids = a.Choices[0].TokenIDs
			}
			if len(ids) != 5 {
				t.Errorf("decoded %d token ids, want 5", len(ids))
			}
			p.waitKV(t, "the prefiller freed its hold", allFree)
			if s := d.waitKV(t, "the decoder is done", allFree); s.KVBlocksPulledTotal != len(pr.KV.RemoteBlockIDs) {
				t.Errorf("the decoder pulled %d blocks, want the %d held", s.KVBlocksPulledTotal, len(pr.KV.RemoteBlockIDs))
			}
		})
	}
}

// What vLLM's GenerateRequest model refuses before its handler is refused, with a 400.
func TestAGenerateRequestVLLMWouldRefuseIsRefused(t *testing.T) {
	ts := startServer(t, fastConfig())
	for _, tc := range []struct{ name, body string }{
		{"no token_ids", `{"sampling_params":{}}`},
		{"empty token_ids", `{"token_ids":[],"sampling_params":{}}`},
		{"a negative token id", `{"token_ids":[1,-2],"sampling_params":{}}`},
		{"no sampling_params", `{"token_ids":[1,2]}`},
		{"an empty cache_salt", `{"token_ids":[1,2],"sampling_params":{},"cache_salt":""}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := ts.post(t, context.Background(), generateRoute, tc.body, nil)
			if b := readAll(t, resp); resp.StatusCode != http.StatusBadRequest {
				t.Errorf("status %d, want 400: %s", resp.StatusCode, b)
			}
		})
	}
}

// SGLang serves no /inference/v1/generate: a sim speaking its protocol answers 404.
func TestTheGenerateRouteIsNotAnSGLangRoute(t *testing.T) {
	cfg := fastConfig()
	cfg.Protocol, cfg.Role = ProtocolSGLang, "decode"
	ts := startServer(t, cfg)
	resp := ts.post(t, context.Background(), generateRoute, `{"token_ids":[1,2],"sampling_params":{}}`, nil)
	if b := readAll(t, resp); resp.StatusCode != http.StatusNotFound {
		t.Errorf("status %d, want 404: %s", resp.StatusCode, b)
	}
}
