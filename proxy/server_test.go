package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sort"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestHealthAndReadiness(t *testing.T) {
	h := aggregated(t, Config{}, newEngine(t, vllmDecode))

	t.Run("/health answers 200", func(t *testing.T) {
		resp, body := h.do(http.MethodGet, "/health", "", nil)
		if resp.StatusCode != http.StatusOK || !jsonEqual(t, body, []byte(`{"status":"ok"}`)) {
			t.Errorf("/health = %d %s, want 200 ok", resp.StatusCode, body)
		}
	})
	t.Run("/ready answers 200 with a healthy decoder", func(t *testing.T) {
		if resp, body := h.do(http.MethodGet, "/ready", "", nil); resp.StatusCode != http.StatusOK {
			t.Errorf("/ready = %d %s, want 200", resp.StatusCode, body)
		}
	})
	t.Run("/ready answers 503 once draining, /health still 200", func(t *testing.T) {
		h.srv.SetDraining()
		resp, body := h.do(http.MethodGet, "/ready", "", nil)
		if _, _, code, _ := checkOpenAIError(t, resp, body, http.StatusServiceUnavailable); code != "shutting_down" {
			t.Errorf("code %q, want shutting_down", code)
		}
		if resp, _ := h.do(http.MethodGet, "/health", "", nil); resp.StatusCode != http.StatusOK {
			t.Errorf("/health = %d while draining, want 200", resp.StatusCode)
		}
	})
}

func TestMetricsAreExposed(t *testing.T) {
	h := pd(t, Config{}, newEngine(t, vllmPrefill(prefillerParams)), newEngine(t, vllmDecode))
	if resp, _ := h.post("/v1/completions", `{"model":"m","prompt":"hi","stream":true}`); resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d, want 200", resp.StatusCode)
	}
	h.waitQuiet()
	resp, body := h.do(http.MethodGet, "/metrics", "", nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics = %d", resp.StatusCode)
	}
	text := string(body)
	for _, want := range []string{
		// The engines' models are not known (no health checks here): the model label is
		// "other", never the name a client sent.
		`pdproxy_requests_total{code="200",model="other",route="/v1/completions"} 1`,
		`pdproxy_request_duration_seconds_count{model="other",route="/v1/completions"} 1`,
		`pdproxy_time_to_first_token_seconds_count{model="other",route="/v1/completions"} 1`,
		`pdproxy_inflight_requests{state="decoding"} 0`,
		`pdproxy_inflight_requests{state="prefilling"} 0`,
		`pdproxy_backend_inflight_requests{backend="d0",role="decode"} 0`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func TestDebugRequestsListsWhatIsInFlight(t *testing.T) {
	release := make(chan struct{})
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if d.wait(r, release) {
			vllmDecode(w, r, body)
		}
	})
	h := aggregated(t, Config{}, d)

	list := func() []map[string]any {
		resp, body := h.do(http.MethodGet, "/debug/requests", "", nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("/debug/requests = %d", resp.StatusCode)
		}
		var out []map[string]any
		if err := json.Unmarshal(body, &out); err != nil || out == nil {
			t.Fatalf("/debug/requests = %s, want a JSON array", body)
		}
		return out
	}
	if got := list(); len(got) != 0 {
		t.Fatalf("idle /debug/requests = %v, want []", got)
	}

	done := make(chan struct{})
	go func() {
		defer close(done)
		hdr := http.Header{"X-Request-Id": {"debug-me"}}
		ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
		defer cancel()
		resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, hdr))
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	var got []map[string]any
	eventually(t, "the request to show in /debug/requests", func() bool { got = list(); return len(got) == 1 })
	if got[0]["id"] != "debug-me" || got[0]["state"] != "decoding" || got[0]["decode"] != "d0" {
		t.Errorf("/debug/requests = %v, want debug-me decoding on d0", got)
	}
	close(release)
	<-done
	h.waitQuiet()
	if got := list(); len(got) != 0 {
		t.Errorf("/debug/requests after the answer = %v, want []", got)
	}
}

func TestModelsMergesTheDecodersLists(t *testing.T) {
	models := func(ids ...string) engineHandler {
		return func(w http.ResponseWriter, r *http.Request, body []byte) {
			if r.URL.Path != "/v1/models" {
				vllmDecode(w, r, body)
				return
			}
			var data []string
			for _, id := range ids {
				data = append(data, `{"id":"`+id+`","object":"model","owned_by":"vllm","max_model_len":4096}`)
			}
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"object":"list","data":[`+strings.Join(data, ",")+`]}`)
		}
	}
	d0 := newEngine(t, models("llama-8b", "llama-8b-lora"))
	d1 := newEngine(t, models("llama-8b", "qwen-7b"))
	p0 := newEngine(t, models("prefill-only"))
	h := newHarness(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{
		decoder("d0", d0.URL()), decoder("d1", d1.URL()), prefiller("p0", p0.URL()),
	}})
	resp, body := h.do(http.MethodGet, "/v1/models", "", nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/v1/models = %d %s", resp.StatusCode, body)
	}
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		t.Fatalf("/v1/models: %v: %s", err, body)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
		if m.MaxModelLen != 4096 {
			t.Errorf("model %s lost its max_model_len", m.ID)
		}
	}
	sort.Strings(ids)
	if list.Object != "list" || strings.Join(ids, ",") != "llama-8b,llama-8b-lora,qwen-7b" {
		t.Errorf("/v1/models = %s %v, want a list of llama-8b, llama-8b-lora, qwen-7b once each", list.Object, ids)
	}
}

func TestModelsWithNoDecoderAnsweringIs503(t *testing.T) {
	h := aggregated(t, Config{}, newEngine(t, answer(500, "text/plain", "down")))
	resp, body := h.do(http.MethodGet, "/v1/models", "", nil)
	checkOpenAIError(t, resp, body, http.StatusServiceUnavailable)
	if resp.Header.Get("Retry-After") == "" {
		t.Errorf("no Retry-After")
	}
}
