package proxy

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestStreamReachesTheClientChunkByChunk(t *testing.T) {
	for _, tc := range []struct {
		name, route, body string
		chat, pd          bool
	}{
		{name: "completions stream after a prefill", route: "/v1/completions", pd: true,
			body: `{"model":"m","prompt":"hi","stream":true}`},
		{name: "chat stream after a prefill", route: "/v1/chat/completions", chat: true, pd: true,
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`},
		{name: "completions stream, aggregated", route: "/v1/completions",
			body: `{"model":"m","prompt":"hi","stream":true}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			chunks := sseChunks(tc.chat)
			release := make(chan struct{})
			var d *fakeEngine
			d = newEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, chunks[0])
				w.(http.Flusher).Flush()
				// The rest waits until the client has the first chunk: a proxy that buffers
				// never delivers it, and the test fails at its deadline.
				if !d.wait(r, release) {
					return
				}
				for _, c := range chunks[1:] {
					io.WriteString(w, c)
					w.(http.Flusher).Flush()
				}
			})
			var h *harness
			if tc.pd {
				h = pd(t, Config{}, newEngine(t, vllmPrefill(prefillerParams)), d)
			} else {
				h = aggregated(t, Config{}, d)
			}
			ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
			defer cancel()
			resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, tc.route, tc.body, nil))
			if err != nil {
				t.Fatalf("request: %v", err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d, want 200", resp.StatusCode)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
				t.Errorf("Content-Type %q, want text/event-stream", ct)
			}
			br := bufio.NewReader(resp.Body)
			first, err := readEvent(br)
			if err != nil || first != chunks[0] {
				t.Fatalf("first event %q (%v), want %q while the decoder is still streaming", first, err, chunks[0])
			}
			close(release)
			for i, want := range chunks[1:] {
				got, err := readEvent(br)
				if err != nil || got != want {
					t.Fatalf("event %d = %q (%v), want %q", i+1, got, err, want)
				}
			}
			if rest, err := io.ReadAll(br); err != nil || len(rest) != 0 {
				t.Errorf("after [DONE]: %q (%v), want the end of the stream", rest, err)
			}
			h.waitQuiet()
			if n := h.value("pdproxy_time_to_first_token_seconds", map[string]string{"route": tc.route}); n != 1 {
				t.Errorf("pdproxy_time_to_first_token_seconds count = %v, want 1", n)
			}
		})
	}
}

func TestNonStreamingAnswerPassesThroughAsItCame(t *testing.T) {
	for _, tc := range []struct{ name, route, body, want string }{
		{"completions JSON", "/v1/completions", `{"model":"m","prompt":"hi"}`, decodeJSONCompletion},
		{"chat JSON", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false}`, decodeJSONChat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := pd(t, Config{}, newEngine(t, vllmPrefill(prefillerParams)), newEngine(t, vllmDecode))
			resp, body := h.post(tc.route, tc.body)
			if resp.StatusCode != http.StatusOK || string(body) != tc.want {
				t.Fatalf("status %d body %s, want 200 %s", resp.StatusCode, body, tc.want)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q, want application/json", ct)
			}
			h.waitQuiet()
			if n := h.value("pdproxy_requests_total", map[string]string{"route": tc.route, "code": "200"}); n != 1 {
				t.Errorf(`pdproxy_requests_total{code="200"} = %v, want 1`, n)
			}
		})
	}
}

// hang is an engine that never answers until its caller gives up.
func hang(e **fakeEngine) engineHandler {
	return func(_ http.ResponseWriter, r *http.Request, _ []byte) { (*e).wait(r, nil) }
}

func TestPhaseTimeoutsAnswer504(t *testing.T) {
	const short = 50 * time.Millisecond
	off := false
	for _, tc := range []struct {
		name     string
		cfg      Config
		prefill  func(**fakeEngine) engineHandler // nil: aggregated
		decode   func(**fakeEngine) engineHandler
		wantCode string
	}{
		{
			name:     "a prefill slower than prefill_timeout",
			cfg:      Config{PrefillTimeout: short, DecodeOnlyFallback: &off},
			prefill:  hang,
			decode:   func(**fakeEngine) engineHandler { return vllmDecode },
			wantCode: "prefill_timeout",
		},
		{
			name:     "a decoder that sends no headers within decode_first_byte_timeout",
			cfg:      Config{DecodeFirstByteTimeout: short},
			decode:   hang,
			wantCode: "decode_timeout",
		},
		{
			name: "a decoder that sends headers but no byte within decode_first_byte_timeout",
			cfg:  Config{DecodeFirstByteTimeout: short},
			decode: func(e **fakeEngine) engineHandler {
				return func(w http.ResponseWriter, r *http.Request, _ []byte) {
					w.Header().Set("Content-Type", "text/event-stream")
					w.WriteHeader(http.StatusOK)
					w.(http.Flusher).Flush()
					(*e).wait(r, nil)
				}
			},
			wantCode: "decode_timeout",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p, d *fakeEngine
			d = newEngine(t, tc.decode(&d))
			var h *harness
			if tc.prefill != nil {
				p = newEngine(t, tc.prefill(&p))
				h = pd(t, tc.cfg, p, d)
			} else {
				h = aggregated(t, tc.cfg, d)
			}
			resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","stream":true}`)
			_, _, code, _ := checkOpenAIError(t, resp, body, http.StatusGatewayTimeout)
			if code != tc.wantCode {
				t.Errorf("code %q, want %q", code, tc.wantCode)
			}
			if strings.Contains(string(body), "127.0.0.1") {
				t.Errorf("the answer leaks a backend address: %s", body)
			}
			if g := d.generations(); tc.prefill != nil && len(g) != 0 {
				t.Errorf("the decoder got %d calls after the prefill timed out; want none", len(g))
			}
			h.waitQuiet()
		})
	}
}

func TestDecoderGoingSilentMidAnswer(t *testing.T) {
	silentAfter := func(first string) func(**fakeEngine) engineHandler {
		return func(e **fakeEngine) engineHandler {
			return func(w http.ResponseWriter, r *http.Request, _ []byte) {
				io.WriteString(w, first)
				w.(http.Flusher).Flush()
				(*e).wait(r, nil)
			}
		}
	}
	cfg := Config{DecodeIdleTimeout: 50 * time.Millisecond}

	t.Run("a stream ends with an error event and no [DONE]", func(t *testing.T) {
		var d *fakeEngine
		d = newEngine(t, silentAfter(sseChunks(false)[0])(&d))
		h := aggregated(t, cfg, d)
		resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","stream":true}`)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d, want 200 (the stream had begun)", resp.StatusCode)
		}
		s := string(body)
		if !strings.HasPrefix(s, sseChunks(false)[0]) {
			t.Errorf("the chunk sent before the silence is missing: %q", s)
		}
		rest := strings.TrimPrefix(s, sseChunks(false)[0])
		if !strings.HasPrefix(rest, `data: {"error":{`) || !strings.HasSuffix(rest, "\n\n") ||
			!strings.Contains(rest, `"code":"decode_timeout"`) || !strings.Contains(rest, `"param":null`) {
			t.Errorf("stream ends %q, want an OpenAI error event with code decode_timeout", rest)
		}
		if strings.Contains(s, "[DONE]") {
			t.Errorf("a failed stream ends with [DONE]: %q", s)
		}
		h.waitQuiet()
		if n := h.value("pdproxy_requests_total", map[string]string{"code": "504"}); n != 1 {
			t.Errorf(`pdproxy_requests_total{code="504"} = %v, want 1`, n)
		}
	})

	t.Run("a stream whose end went out is served, though its decoder falls silent before closing", func(t *testing.T) {
		var d *fakeEngine
		d = newEngine(t, silentAfter(strings.Join(sseChunks(false), ""))(&d))
		h := aggregated(t, cfg, d)
		resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","stream":true}`)
		if want := strings.Join(sseChunks(false), ""); resp.StatusCode != http.StatusOK || string(body) != want {
			t.Errorf("got %d %q, want the whole stream and nothing after its [DONE]: %q", resp.StatusCode, body, want)
		}
		h.waitQuiet()
		if n := h.value("pdproxy_requests_total", map[string]string{"code": "200"}); n != 1 {
			t.Errorf(`pdproxy_requests_total{code="200"} = %v, want the request counted as served`, n)
		}
	})

	t.Run("a JSON answer is cut off, never passed off as complete", func(t *testing.T) {
		var d *fakeEngine
		d = newEngine(t, silentAfter(`{"id":"cmpl-d","choices":[`)(&d))
		h := aggregated(t, cfg, d)
		ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
		defer cancel()
		resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil))
		if err != nil {
			t.Fatalf("request: %v", err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err == nil {
			t.Errorf("the truncated answer %q was delivered as complete; want a broken connection", body)
		}
		h.waitQuiet()
	})
}
