package proxy

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// A decode whose KV pull failed (the decoder answers 500, as vLLM's kv_load_failure_policy
// "fail" makes it) is prefilled again, on the other prefiller, and the client reads the whole
// answer; the attempt that failed holds nothing afterwards.
func TestAFailedPullIsPrefilledAgainOnAnotherPrefiller(t *testing.T) {
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "json", true: "stream"}[stream]
		t.Run(name, func(t *testing.T) {
			p0 := newEngine(t, vllmPrefill(`{"remote_engine_id":"p0","remote_block_ids":[1,2]}`))
			p1 := newEngine(t, vllmPrefill(`{"remote_engine_id":"p1","remote_block_ids":[3,4]}`))
			var pulls atomic.Int32
			// The decoder fails the pull of p0's blocks, as one does when they are gone.
			d := newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
				if r.Method != http.MethodPost {
					return
				}
				pulls.Add(1)
				if bytes.Contains(body, []byte(`"remote_engine_id":"p0"`)) {
					answer(500, "application/json", `{"error":{"message":"Internal server error","type":"InternalServerError","code":500}}`)(w, r, body)
					return
				}
				vllmDecode(w, r, body)
			})
			p0b, p1b := prefiller("p0", p0.URL()), prefiller("p1", p1.URL())
			p0b.Weight = 2 // the first pick
			h := newHarness(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{p0b, p1b, decoder("d0", d.URL())}})
			body := `{"model":"m","prompt":"hello","max_tokens":4`
			if stream {
				body += `,"stream":true`
			}
			resp, got := h.post("/v1/completions", body+"}")
			if resp.StatusCode != http.StatusOK || !strings.Contains(string(got), "lo") {
				t.Fatalf("status %d: %s; want the whole answer", resp.StatusCode, got)
			}
			if stream && !strings.HasSuffix(string(got), "data: [DONE]\n\n") {
				t.Fatalf("the stream ends without its [DONE]: %s", got)
			}
			if n := len(p0.generations()) + len(p1.generations()); n != 2 || len(p1.generations()) != 1 {
				t.Errorf("prefills: p0 %d, p1 %d; want one each", len(p0.generations()), len(p1.generations()))
			}
			if n := pulls.Load(); n != 2 {
				t.Errorf("%d decodes, want 2: the failed pull and the one after the second prefill", n)
			}
			if n := h.value("pdproxy_retries_total", map[string]string{"role": "prefill", "reason": "kv_pull_failed"}); n != 1 {
				t.Errorf("retries{prefill,kv_pull_failed} = %v, want 1", n)
			}
			h.waitQuiet()
			if n := h.table.OutstandingHolds(); n != 0 {
				t.Errorf("%d holds outstanding", n)
			}
		})
	}
}

// A decoder that breaks the connection before its first byte lost the request: the request
// is served on a fresh pair, the broken decoder left out, and only it is charged.
func TestADecoderThatDiesBeforeItsFirstByteIsReplaced(t *testing.T) {
	p := newEngine(t, vllmPrefill(`{"remote_engine_id":"p0","remote_block_ids":[1]}`))
	dead := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		if r.Method == http.MethodPost {
			panic(http.ErrAbortHandler) // the connection closes with no answer
		}
	})
	live := newEngine(t, vllmDecode)
	d0 := decoder("d0", dead.URL())
	d0.Weight = 2
	h := newHarness(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{prefiller("p0", p.URL()), d0, decoder("d1", live.URL())}})
	resp, got := h.post("/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	if resp.StatusCode != http.StatusOK || !strings.HasSuffix(string(got), "data: [DONE]\n\n") {
		t.Fatalf("status %d: %s; want the whole stream", resp.StatusCode, got)
	}
	if len(dead.generations()) != 1 || len(live.generations()) != 1 || len(p.generations()) != 2 {
		t.Errorf("calls: prefiller %d, dead decoder %d, live decoder %d; want 2, 1, 1",
			len(p.generations()), len(dead.generations()), len(live.generations()))
	}
	if n := h.value("pdproxy_retries_total", map[string]string{"role": "decode", "reason": "decoder_failed"}); n != 1 {
		t.Errorf("retries{decode,decoder_failed} = %v, want 1", n)
	}
	h.waitQuiet()
	if n := failuresCharged(h, "d1") + failuresCharged(h, "p0"); n != 0 {
		t.Errorf("healthy engines were charged %v failures", n)
	}
	if n := failuresCharged(h, "d0"); n == 0 {
		t.Error("the decoder that died was charged nothing")
	}
	if n := h.table.OutstandingHolds(); n != 0 {
		t.Errorf("%d holds outstanding", n)
	}
}

// With nobody to take its place, a decoder that failed is not tried again through a second
// prefill: the client is told of the failure at once.
func TestNoFreshPairWithoutAnotherDecoder(t *testing.T) {
	p := newEngine(t, vllmPrefill(`{"remote_engine_id":"p0","remote_block_ids":[1]}`))
	dead := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		if r.Method == http.MethodPost {
			panic(http.ErrAbortHandler)
		}
	})
	h := pd(t, Config{}, p, dead)
	resp, got := h.post("/v1/completions", `{"model":"m","prompt":"hello","max_tokens":4}`)
	checkOpenAIError(t, resp, got, http.StatusBadGateway)
	if n := len(p.generations()); n != 1 {
		t.Errorf("%d prefills, want 1", n)
	}
	h.waitQuiet()
}

// A decoder reserved before the prefill and marked down while the prefill ran gets no decode:
// it goes to a decoder that is up, with the same KV.
func TestADecoderDownAfterItsReservationGetsNoDecode(t *testing.T) {
	release := make(chan struct{})
	var prefilling atomic.Bool
	p := newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.Method != http.MethodPost {
			return
		}
		prefilling.Store(true)
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		vllmPrefill(`{"remote_engine_id":"p0","remote_block_ids":[1]}`)(w, r, body)
	})
	var sick atomic.Bool
	sickDecoder := sickableDecoder(t, &sick)
	other := newEngine(t, vllmDecode)
	d0 := decoder("d0", sickDecoder.URL())
	d0.Weight = 2
	backends := []routerconfig.BackendConfig{prefiller("p0", p.URL()), d0, decoder("d1", other.URL())}
	for i := range backends {
		// Named, so that the checks do not ask the fake engines for their models.
		backends[i].Models = []string{"m"}
	}
	h := newHarness(t, Config{}, routerconfig.Config{
		Backends: backends,
		Health:   routerconfig.HealthConfig{Interval: 20 * time.Millisecond, Timeout: 100 * time.Millisecond, UnhealthyThreshold: 1},
	})
	done := make(chan []byte, 1)
	go func() {
		resp, err := http.DefaultClient.Do(h.request(t.Context(), http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hello","max_tokens":4}`, nil))
		if err != nil {
			done <- []byte(err.Error())
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- b
	}()
	eventually(t, "the prefill is under way", prefilling.Load)
	sick.Store(true)
	eventually(t, "d0 is marked down", func() bool {
		for _, b := range h.rt.Backends() {
			if b.Name == "d0" {
				return !b.Healthy
			}
		}
		return false
	})
	close(release)
	if got := <-done; !strings.Contains(string(got), "Hello") {
		t.Fatalf("the client got %s, want the answer", got)
	}
	if n := len(sickDecoder.generations()); n != 0 {
		t.Errorf("the decoder marked down got %d decodes", n)
	}
	if n := len(other.generations()); n != 1 {
		t.Errorf("the decoder that is up got %d decodes, want 1", n)
	}
	h.waitQuiet()
}
