package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
)

// tokenIDs is a prompt of n token ids, as a JSON array.
func tokenIDs(n int) string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprint(1000 + i)
	}
	return "[" + strings.Join(ids, ",") + "]"
}

// generateBody is a body of vLLM's token-in route: n prompt ids, maxTokens out.
func generateBody(n, maxTokens int, stream bool) string {
	return fmt.Sprintf(`{"model":"sim","token_ids":%s,"sampling_params":{"max_tokens":%d,"ignore_eos":true},"stream":%t}`, tokenIDs(n), maxTokens, stream)
}

// A token-in request goes through the sim prefiller and decoder of the embedded default as a
// completion does: the prefiller computes the prompt and holds it, the decoder pulls it and
// answers token ids (a stream of one id an event, then [DONE]), and nothing stays held.
func TestATokenInGenerateRequestIsPrefilledThenDecodedThroughTheProxy(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream %v", stream), func(t *testing.T) {
			s := startStack(t, fastSims)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp := post(t, ctx, s.url+"/inference/v1/generate", generateBody(200, 6, stream))
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, b)
			}
			var ids []uint32
			if stream {
				events := sseEvents(t, strings.NewReader(string(b)))
				if len(events) != 7 || events[6] != "[DONE]" {
					t.Fatalf("%d events, want 6 tokens and [DONE]: %s", len(events), b)
				}
				for _, ev := range events[:6] {
					var e struct {
						Choices []struct {
							TokenIDs []uint32 `json:"token_ids"`
						} `json:"choices"`
					}
					if json.Unmarshal([]byte(ev), &e) != nil || len(e.Choices) != 1 || len(e.Choices[0].TokenIDs) != 1 {
						t.Fatalf("event %s, want one choice of one token id", ev)
					}
					ids = append(ids, e.Choices[0].TokenIDs...)
				}
			} else {
				var a struct {
					Choices []struct {
						TokenIDs []uint32 `json:"token_ids"`
					} `json:"choices"`
				}
				if json.Unmarshal(b, &a) != nil || len(a.Choices) != 1 {
					t.Fatalf("answer %s, want one choice", b)
				}
				ids = a.Choices[0].TokenIDs
			}
			if len(ids) != 6 {
				t.Errorf("%d token ids, want 6", len(ids))
			}
			p, d := kv(t, s.m.SimURLs("prefill")[0]), kv(t, s.m.SimURLs("decode")[0])
			if p.RequestsTotal != 1 || p.PromptTokensComputedTotal != 200 {
				t.Errorf("the prefiller served %d requests, computed %d prompt tokens; want 1 and the 200", p.RequestsTotal, p.PromptTokensComputedTotal)
			}
			if d.KVBlocksPulledTotal == 0 || d.PromptTokensComputedTotal != 0 {
				t.Errorf("the decoder pulled %d blocks and computed %d prompt tokens; want the prefiller's blocks and none", d.KVBlocksPulledTotal, d.PromptTokensComputedTotal)
			}
			s.assertQuiet(2 * time.Second)
		})
	}
}

// A token-in request whose client leaves while it is prefilling, while its KV is held for a
// busy decoder, or while it waits in the decoder, is aborted at that stage and leaves no KV
// held anywhere: the rules of a completion's.
func TestATokenInGenerateRequestWhoseClientLeavesAtAnyStageLeavesNothingHeld(t *testing.T) {
	body := generateBody(300, 5, false)
	for _, tc := range []struct {
		stage string
		// stages are where the request's abort may be counted, and aborts how many aborts
		// they count in all: the busy decoder's own stream is aborted at decoding when the
		// test stops it, and a client that leaves as its decode goes out is aborted there too.
		stages []string
		aborts float64
		setup  func(*app.Config)
		leave  func(t *testing.T, s *stack)
	}{
		{"prefilling", []string{"prefilling"}, 1, fastSims, func(t *testing.T, s *stack) {
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			<-inBackground(t, ctx, s.url+"/inference/v1/generate", body, "X-Sim-Stall", "400ms")
		}},
		{"kv_held", []string{"kv_held", "decoding"}, 2, func(c *app.Config) {
			fastSims(c)
			c.Sims[1].MaxRunning, c.Sims[1].MaxInflight = 1, 1
			c.Proxy.DecoderReservation, c.Proxy.KVRelease = "after_prefill", "abort"
		}, func(t *testing.T, s *stack) {
			stop := busyDecoder(t, s)
			defer stop()
			ctx, cancel := context.WithCancel(context.Background())
			done := inBackground(t, ctx, s.url+"/inference/v1/generate", body, "X-Request-Id", "gen-held")
			testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
				st, ok := s.m.Table.State("gen-held")
				return ok && st.String() == "kv_held", fmt.Sprintf("gen-held is %v", st)
			})
			cancel()
			<-done
		}},
		{"decoding", []string{"decoding"}, 2, func(c *app.Config) { fastSims(c); c.Sims[1].MaxRunning = 1 }, func(t *testing.T, s *stack) {
			stop := busyDecoder(t, s)
			defer stop()
			ctx, cancel := context.WithCancel(context.Background())
			done := inBackground(t, ctx, s.url+"/inference/v1/generate", body, "X-Request-Id", "gen-queued")
			testutil.WaitFor(t, 2*time.Second, queuedOnDecoder(t, s, "gen-queued"))
			cancel()
			<-done
		}},
	} {
		t.Run(tc.stage, func(t *testing.T) {
			s := startStack(t, tc.setup)
			tc.leave(t, s)
			testutil.WaitFor(t, 2*time.Second, prefillerHoldsNothing(t, s))
			// The handler counts the abort as it finishes, a moment after the engines let go.
			testutil.WaitFor(t, 2*time.Second, func() (bool, string) {
				got := 0.0
				for _, st := range tc.stages {
					got += testutil.Value(t, s.m.Registry, "pdproxy_aborts_total", map[string]string{"stage": st})
				}
				return got >= tc.aborts, fmt.Sprintf("aborts at %v = %v, want %v", tc.stages, got, tc.aborts)
			})
			s.assertQuiet(2 * time.Second)
		})
	}
}

// On vLLM's MooncakeConnector both legs of a token-in request go out at once under one
// transfer id, as a completion's do: the prefiller computes the prompt, the decoder pulls it
// and streams the token ids, and every engine ends idle.
func TestATokenInGenerateRequestIsServedByMooncakeLegs(t *testing.T) {
	s, engines := mooncakePool(t, 1, 1, 1, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp := post(t, ctx, s.url+"/inference/v1/generate", generateBody(200, 6, true))
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if events := sseEvents(t, strings.NewReader(string(b))); resp.StatusCode != http.StatusOK || len(events) != 7 || events[6] != "[DONE]" {
		t.Fatalf("status %d, %d events, want 6 tokens and [DONE]: %s", resp.StatusCode, len(events), b)
	}
	p, d := engines[0].Stats(), engines[1].Stats()
	if p.PromptTokensComputedTotal != 200 || d.KVBlocksPulledTotal == 0 || d.PromptTokensComputedTotal != 0 {
		t.Errorf("prefiller computed %d prompt tokens, decoder pulled %d blocks and computed %d; want 200, the prefiller's blocks, 0",
			p.PromptTokensComputedTotal, d.KVBlocksPulledTotal, d.PromptTokensComputedTotal)
	}
	testutil.WaitFor(t, 2*time.Second, func() (bool, string) { return idle(engines) })
	s.assertQuiet(2 * time.Second)
}
