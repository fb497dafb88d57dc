package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
)

// TestGiveUpStormOnTodaysVLLM sends requests of every kind a client mixes, n > 1, prompt
// arrays, prompt logprobs, max_tokens 0, streaming or not, completions or chat, whose clients
// give up at random moments, to one prefiller and two decoders that the proxy takes for vLLM
// (no explicit abort: holds end by a decoder's pull, a drain, or the lease). Afterwards no
// prefiller holds anything within a second, and every prefill was followed by exactly one
// decode: a hold's params reach one decoder, once. PDPROXY_STORM=N sets the number of
// requests (200 by default).
func TestGiveUpStormOnTodaysVLLM(t *testing.T) {
	n := stormSize(t, "PDPROXY_STORM")
	s := startStack(t, func(c *app.Config) {
		p := app.SimConfig{Role: "prefill", Engine: "vllm", PrefillTime: 5 * time.Millisecond, PrefillPerToken: 10 * time.Microsecond, KVBlocks: 8192}
		d := app.SimConfig{Role: "decode", Engine: "vllm", ITL: 2 * time.Millisecond, KVTransferTime: 100 * time.Microsecond, KVBlocks: 8192}
		c.Sims = []app.SimConfig{p, d, d}
		// vLLM has no abort call: a prefill the client left is let finish and its KV drained,
		// rather than cut with a chance of losing the race with its last step (R1).
		c.Proxy.AbortDuringPrefill = proxy.AbortPrefillFinishThenFree
	})
	kinds := []stormKind{
		{"completion", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true}`},
		{"completion stream", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":true}`},
		{"chat", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"ignore_eos":true}`},
		{"chat stream", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"ignore_eos":true,"stream":true}`},
		{"n=2", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"n":2}`},
		{"prompt array", "/v1/completions", `{"model":"sim","prompt":["%s","second"],"max_tokens":%d,"ignore_eos":true,"stream":true}`},
		{"prompt logprobs", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"prompt_logprobs":1}`},
		{"max_tokens 0", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d}`},
	}
	outcomes, done := giveUpStorm(t, s.url, kinds, n, 11)

	for k, v := range outcomes {
		if strings.HasPrefix(k, "max_tokens 0: 2") {
			t.Errorf("max_tokens 0 answered %s: want 400", k)
		}
		if strings.HasSuffix(k, ": 500") || strings.HasSuffix(k, ": 502") || strings.Contains(k, "error:") {
			t.Errorf("a request the client waited for failed: %s %d", k, v)
		}
	}
	logOutcomes(t, n, outcomes)

	prefiller := s.m.SimURLs("prefill")[0]
	testutil.WaitFor(t, time.Second, func() (bool, string) {
		st := kv(t, prefiller)
		return st.HeldRequests == 0, "prefiller: " + jsonString(st)
	})
	t.Logf("prefiller held_requests 0 %s after the last client was done", time.Since(done).Round(time.Millisecond))
	s.assertQuiet(5 * time.Second)

	// Every prefill that ended holding KV had its params sent to one decoder, once: the
	// client's decode, or a drain after the client left.
	holds := kv(t, prefiller).HoldsTotal
	var withParams int
	for _, u := range s.m.SimURLs("decode") {
		withParams += kv(t, u).RemotePrefillRequestsTotal
	}
	reg := s.m.Registry
	t.Logf("prefiller: %d prefills, %d ended holding KV; decoders: %d decodes with its params (decode-only requests %v); holds by result: handed_over %v, released %v, left_to_engine %v; drains %v",
		kv(t, prefiller).RequestsTotal, holds, withParams, testutil.Value(t, reg, "pdproxy_decode_only_total", nil),
		testutil.Value(t, reg, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": "handed_over"}),
		testutil.Value(t, reg, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": "released"}),
		testutil.Value(t, reg, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": "left_to_engine"}),
		testutil.Value(t, reg, "pdproxy_kv_releases_total", map[string]string{"reason": "drained"}))
	if withParams != holds {
		t.Errorf("decoders got %d decodes with a prefiller's params for %d holds: want one each", withParams, holds)
	}
	if n := testutil.Value(t, reg, "pdproxy_kv_hold_handoffs_total", map[string]string{"result": "left_to_engine"}); n != 0 {
		t.Errorf("%v holds left to the engine's lease", n)
	}
	for _, u := range s.m.SimURLs("decode") {
		t.Logf("%s /debug/kv: %s", u, jsonString(kv(t, u)))
	}
	t.Logf("%s /debug/kv: %s", prefiller, jsonString(kv(t, prefiller)))
}

// stormKind is one kind of request a give-up storm mixes: body takes the prompt (%s) and
// max_tokens (%d), random from 1 to 40, or 0 for the kind named "max_tokens 0".
type stormKind struct{ name, route, body string }

// stormSize is the number of requests a storm sends: env's value, or 200.
func stormSize(t *testing.T, env string) int {
	t.Helper()
	v := os.Getenv(env)
	if v == "" {
		return 200
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", env, v, err)
	}
	return n
}

// giveUpStorm sends n requests, kinds in turn, from 16 clients that each give up after a
// random time of up to 300 ms: a request takes tens of milliseconds here, so clients leave at
// every stage, and some never do. It returns what each got, by "<kind>: <outcome>" (the
// status; "gave up before the answer"; "gave up mid-answer"; "error: ..." when the client
// had not given up), and when the last client was done.
func giveUpStorm(t *testing.T, url string, kinds []stormKind, n int, seed uint64) (map[string]int, time.Time) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer client.CloseIdleConnections()
	var (
		mu       sync.Mutex
		outcomes = map[string]int{}
		wg       sync.WaitGroup
		next     = make(chan int)
	)
	for w := range 16 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), seed))
			for i := range next {
				k := kinds[i%len(kinds)]
				maxTokens := rng.IntN(40) + 1
				if k.name == "max_tokens 0" {
					maxTokens = 0
				}
				body := fmt.Sprintf(k.body, prompt(rng.IntN(400)+1), maxTokens)
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(300))*time.Millisecond)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+k.route, strings.NewReader(body))
				outcome := "gave up before the answer"
				resp, err := client.Do(req)
				if err != nil && ctx.Err() == nil {
					outcome = "error: " + err.Error()
				}
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					switch {
					case err != nil && ctx.Err() != nil:
						outcome = "gave up mid-answer"
					case err != nil:
						outcome = "error: mid-answer: " + err.Error()
					default:
						outcome = strconv.Itoa(resp.StatusCode)
					}
				}
				cancel()
				mu.Lock()
				outcomes[k.name+": "+outcome]++
				mu.Unlock()
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return outcomes, time.Now()
}

// logOutcomes logs a storm's outcomes, one line each, sorted.
func logOutcomes(t *testing.T, n int, outcomes map[string]int) {
	t.Helper()
	var lines []string
	for k, v := range outcomes {
		lines = append(lines, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(lines)
	t.Logf("%d requests:\n  %s", n, strings.Join(lines, "\n  "))
}
