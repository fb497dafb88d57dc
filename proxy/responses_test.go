package proxy

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// A decoder whose Responses stream carries the end event's words in a delta's text, then
// stops before its end, is a failed stream to the client: an error event last, no clean end.
func TestResponsesStreamCutAfterTheEndsWordsInTextEndsInAnError(t *testing.T) {
	events := []string{
		"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"status\":\"in_progress\"}}\n\n",
		"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"\\n\\nevent: response.completed\\n\"}\n\n",
	}
	d := newEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, ev := range events {
			io.WriteString(w, ev)
			w.(http.Flusher).Flush()
		}
		// The handler returns: the stream ends, cleanly on the wire, before its end event.
	})
	h := pd(t, Config{}, newEngine(t, vllmPrefill(prefillerParams)), d)
	resp, body := h.post("/v1/responses", `{"model":"m","input":"hi","stream":true}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	got := string(body)
	if !strings.HasPrefix(got, events[0]+events[1]) {
		t.Fatalf("stream %q does not start with the decoder's events", got)
	}
	last := strings.TrimPrefix(got, events[0]+events[1])
	if !strings.HasPrefix(last, "event: error\ndata: ") || !strings.HasSuffix(last, "\n\n") {
		t.Fatalf("after the decoder's events: %q, want an error event", last)
	}
	h.waitQuiet()
	if n := h.value("pdproxy_requests_total", map[string]string{"route": "/v1/responses", "code": "200"}); n != 0 {
		t.Errorf(`pdproxy_requests_total{code="200"} = %v, want 0: the stream failed`, n)
	}
}

// Under P/D, a Responses request that needs state kept on one engine is refused with a 400
// naming the field, before any engine is asked; previous_response (the earlier response
// whole) stands in for previous_response_id alone. Without prefillers the one engine keeps
// its own state, and the request reaches it as it came. An empty previous_response_id names
// no response, anywhere: a 400 rather than an engine's 404.
func TestResponsesStateIsRefusedUnderPDAndPassesToOneEngine(t *testing.T) {
	const earlier = `{"id":"resp_1","object":"response","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi"}]}]}`
	tests := []struct {
		name, fields string
		refused      string // the param of the 400 under P/D; "" for none
	}{
		{"previous_response_id", `"previous_response_id":"resp_1"`, "previous_response_id"},
		{"background", `"background":true`, "background"},
		{"store", `"store":true`, "store"},
		{"store with a null previous_response", `"store":true,"previous_response":null`, "store"},
		{"store with the earlier response whole", `"store":true,"previous_response":` + earlier, "store"},
		{"background with the earlier response whole", `"background":true,"previous_response":` + earlier, "background"},
		{"previous_response_id with a null previous_response", `"previous_response_id":"resp_1","previous_response":null`, "previous_response_id"},
		{"previous_response_id with the earlier response whole", `"previous_response_id":"resp_1","previous_response":` + earlier, ""},
		{"store and background false", `"store":false,"background":false`, ""},
	}
	const answer200 = `{"id":"resp_2","object":"response","status":"completed","model":"m","output":[]}`
	for _, tt := range tests {
		body := `{"model":"m","input":"go on",` + tt.fields + `}`
		t.Run(tt.name+"/P/D", func(t *testing.T) {
			p, d := newEngine(t, vllmPrefill(prefillerParams)), newEngine(t, answer(http.StatusOK, "application/json", answer200))
			h := pd(t, Config{}, p, d)
			resp, got := h.post("/v1/responses", body)
			if tt.refused == "" {
				if resp.StatusCode != http.StatusOK || string(got) != answer200 {
					t.Fatalf("status %d %s, want the decoder's answer", resp.StatusCode, got)
				}
				p.only(t, "prefiller")
				d.only(t, "decoder")
				return
			}
			_, _, code, param := checkOpenAIError(t, resp, got, http.StatusBadRequest)
			if code != "unsupported_parameter" || param == nil || *param != tt.refused {
				t.Errorf("code %q, param %v, want unsupported_parameter naming %s: %s", code, param, tt.refused, got)
			}
			if n := len(p.generations()) + len(d.generations()); n != 0 {
				t.Errorf("the engines got %d calls, want none", n)
			}
		})
		t.Run(tt.name+"/one engine", func(t *testing.T) {
			d := newEngine(t, answer(http.StatusOK, "application/json", answer200))
			h := aggregated(t, Config{}, d)
			resp, got := h.post("/v1/responses", body)
			if resp.StatusCode != http.StatusOK || string(got) != answer200 {
				t.Fatalf("status %d %s, want the engine's answer", resp.StatusCode, got)
			}
			if sent := d.only(t, "engine"); !jsonEqual(t, sent.Body, []byte(body)) {
				t.Errorf("engine got %s, want the client's %s", sent.Body, body)
			}
		})
	}
	for name, h := range map[string]func(t *testing.T, d *fakeEngine) *harness{
		"P/D": func(t *testing.T, d *fakeEngine) *harness {
			return pd(t, Config{}, newEngine(t, vllmPrefill(prefillerParams)), d)
		},
		"one engine": func(t *testing.T, d *fakeEngine) *harness { return aggregated(t, Config{}, d) },
	} {
		t.Run("an empty previous_response_id/"+name, func(t *testing.T) {
			d := newEngine(t, answer(http.StatusOK, "application/json", answer200))
			resp, got := h(t, d).post("/v1/responses", `{"model":"m","input":"go on","previous_response_id":""}`)
			if _, _, _, param := checkOpenAIError(t, resp, got, http.StatusBadRequest); param == nil || *param != "previous_response_id" {
				t.Errorf("param %v, want previous_response_id: %s", param, got)
			}
			if n := len(d.generations()); n != 0 {
				t.Errorf("the decoder got %d calls, want none", n)
			}
		})
	}
}
