package e2e

// End-to-end tests of pdproxy in front of SGLang engines (issue 12): the simulator's SGLang
// protocol (kvbackend/sim/sglang.go) on loopback, both legs of a request at once, paired by a
// bootstrap room on the prefiller. The sims notice a client that left only after a long
// disconnect delay, so whatever is freed promptly here was freed by the proxy's explicit
// aborts (/abort_request), not by SGLang's own disconnect detection.

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/kvbackend/sim"
)

// sglangDisconnectDelay is how late the SGLang sims notice a client that left: far longer
// than any wait in these tests.
const sglangDisconnectDelay = 30 * time.Second

// sglangSims makes the stack's engines SGLang prefillers and decoders, quick, and slow to
// notice a gone client.
func sglangSims(c *app.Config) {
	for i := range c.Sims {
		c.Sims[i].Protocol = sim.ProtocolSGLang
		c.Sims[i].DisconnectDelay = sglangDisconnectDelay
		c.Sims[i].KVHoldTimeout = 0 // rooms have no lease
		c.Sims[i].PrefillTime = 2 * time.Millisecond
		c.Sims[i].ITL = time.Millisecond
	}
}

// sglangIdle reports an SGLang engine with every block free and nothing held, waited for,
// queued or running.
func sglangIdle(st sim.KVStats) bool {
	return st.BlocksFree == st.BlocksTotal && st.HeldRequests == 0 && st.RunningRequests == 0 &&
		st.WaitingRequests == 0 && st.RoomsWaiting == 0 && st.RoomsHeld == 0 && st.DoubleFreeAttemptsTotal == 0
}

// enginesIdle holds once every engine at urls is idle (sglangIdle).
func enginesIdle(t *testing.T, urls ...string) func() (bool, string) {
	return func() (bool, string) {
		for _, u := range urls {
			if st := kv(t, u); !sglangIdle(st) {
				return false, u + ": " + jsonString(st)
			}
		}
		return true, ""
	}
}

// handoffs reads pdproxy_kv_hold_handoffs_total{result}.
func handoffs(t *testing.T, s *stack, result string) float64 {
	return testutil.Value(t, s.m.Registry, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": result})
}

// tokensOf counts the tokens of an answer: the usage of a whole one, the chunks with text
// of a stream (a sim's token is never empty with ignore_eos). done: a stream ended [DONE].
func tokensOf(t *testing.T, body []byte, stream bool) (tokens, choices int, done bool) {
	t.Helper()
	if !stream {
		var c completion
		if err := json.Unmarshal(body, &c); err != nil || c.Usage == nil {
			t.Fatalf("answer %q: %v", body, err)
		}
		return c.Usage.CompletionTokens, len(c.Choices), true
	}
	seen := map[int]bool{}
	for _, ev := range sseEvents(t, strings.NewReader(string(body))) {
		if ev == "[DONE]" {
			done = true
			continue
		}
		var c struct {
			Choices []struct {
				Index int     `json:"index"`
				Text  *string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("stream event %q: %v", ev, err)
		}
		for _, ch := range c.Choices {
			seen[ch.Index] = true
			if (ch.Text != nil && *ch.Text != "") || ch.Delta.Content != "" {
				tokens++
			}
		}
	}
	return tokens, len(seen), done
}

var sglangShapes = []struct {
	name, route, body string
	stream            bool
	prompts           int
}{
	{"completion", "/v1/completions", `{"model":"sim","prompt":"` + prompt(40) + `","max_tokens":6,"ignore_eos":true}`, false, 1},
	{"completion stream", "/v1/completions", `{"model":"sim","prompt":"` + prompt(40) + `","max_tokens":6,"ignore_eos":true,"stream":true}`, true, 1},
	{"chat", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"` + prompt(40) + `"}],"max_tokens":6,"ignore_eos":true}`, false, 1},
	{"chat stream", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"` + prompt(40) + `"}],"max_tokens":6,"ignore_eos":true,"stream":true}`, true, 1},
	{"batch", "/v1/completions", `{"model":"sim","prompt":["` + prompt(40) + `","second","third"],"max_tokens":6,"ignore_eos":true}`, false, 3},
	{"batch stream", "/v1/completions", `{"model":"sim","prompt":["` + prompt(40) + `","second"],"max_tokens":6,"ignore_eos":true,"stream":true}`, true, 2},
}

func TestSGLangRequestsOfEveryShapeAreAnsweredByTheDecoderAndLeaveNothingHeld(t *testing.T) {
	for _, tc := range sglangShapes {
		t.Run(tc.name, func(t *testing.T) {
			s := startStack(t, sglangSims)
			p, d := s.m.SimURLs("prefill")[0], s.m.SimURLs("decode")[0]
			resp := post(t, context.Background(), s.url+tc.route, tc.body)
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %q: %v", resp.StatusCode, body, err)
			}
			// The prefill leg makes one token a prompt; all six come from the decoder.
			tokens, choices, done := tokensOf(t, body, tc.stream)
			if tokens != 6*tc.prompts || choices != tc.prompts || !done {
				t.Errorf("answer has %d tokens in %d choices (ended: %v), want %d in %d: %s", tokens, choices, done, 6*tc.prompts, tc.prompts, body)
			}
			testutil.WaitFor(t, time.Second, enginesIdle(t, p, d))
			if ps, ds := kv(t, p), kv(t, d); ps.HoldsTotal != tc.prompts || ds.RemotePrefillRequestsTotal != 1 || ps.AbortedTotal+ds.AbortedTotal != 0 {
				t.Errorf("prefiller %s, decoder %s: want %d rooms held once, one decode leg, no abort", jsonString(ps), jsonString(ds), tc.prompts)
			}
			if got := handoffs(t, s, "handed_over"); got != 1 {
				t.Errorf("handoffs{handed_over} = %v, want 1", got)
			}
			s.assertQuiet(time.Second)
		})
	}
}
