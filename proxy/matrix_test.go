package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/faultengine"
	"github.com/pdproxy/pdproxy/router"
)

// The failure matrix: every way an engine misbehaves (faultengine's faults, down to the byte
// and the moment), on either leg, of either engine protocol, streamed or not, on completions
// and chat, with a client that waits for its answer or leaves when the fault strikes. Every
// cell must end so: the client gets an answer it can parse (an
// OpenAI-shape error before the first byte, an error event and no [DONE] once a stream began,
// a cut connection for a JSON answer under way) or a whole, correct answer where the fault
// can be served around; nothing panics; nothing is left in the table, in flight or held; a
// hold's params reach one decoder at most; SGLang's legs are aborted decoder first; and only
// the faulty engine is blamed.
//
// CI runs every fault, leg, engine and client behaviour, with stream and route paired
// (each fault sees both); PDPROXY_MATRIX=full crosses all of them.

type matrixCell struct {
	proto faultengine.Protocol
	// kind is the engine kind the proxy is told: vllm (sequential, no explicit abort), sim
	// (sequential, with SGLang's explicit abort), or sglang (paired legs).
	kind   string
	leg    string // "prefill" or "decode"
	fault  faultengine.Fault
	stream bool
	route  string // completions, chat or responses
	leave  bool
	// pass: the request is an embedding, which one decoder answers without P/D (leg is then
	// "decode", stream and chat false).
	pass bool
}

func (c matrixCell) name() string {
	route := c.route
	mode := "json"
	if c.stream {
		mode = "stream"
	}
	client := "stays"
	if c.leave {
		client = "leaves"
	}
	return fmt.Sprintf("%s/%s/%s/%s/%s/client_%s", c.kind, c.leg, c.fault, mode, route, client)
}

// matrixCells is the matrix, whole or with stream and route paired.
func matrixCells(full bool) []matrixCell {
	var cells []matrixCell
	for _, kind := range []string{"vllm", "sim", "sglang", "mooncake"} {
		proto := faultengine.VLLM
		switch kind {
		case "sglang":
			proto = faultengine.SGLang
		case "mooncake":
			proto = faultengine.Mooncake
		}
		for _, leg := range []string{"prefill", "decode"} {
			for _, fault := range faultengine.Faults() {
				if fault == faultengine.BadParams && (leg != "prefill" || proto != faultengine.VLLM) {
					continue // only a vLLM prefiller answers with params
				}
				for _, leave := range []bool{false, true} {
					for _, stream := range []bool{false, true} {
						for _, route := range []string{"completions", "chat", "responses"} {
							// CI pairs stream and route: completions streamed, chat and
							// responses not, responses streamed too (its end and its error
							// event are its own).
							if !full && (route == "completions") != stream && route != "responses" {
								continue
							}
							if !full && route == "responses" && !stream {
								continue
							}
							cells = append(cells, matrixCell{proto, kind, leg, fault, stream, route, leave, false})
						}
					}
				}
			}
		}
	}
	// A passthrough route meets every fault of a single call.
	for _, fault := range faultengine.Faults() {
		if fault == faultengine.BadParams {
			continue
		}
		for _, leave := range []bool{false, true} {
			cells = append(cells, matrixCell{proto: faultengine.VLLM, kind: "vllm", leg: "decode", fault: fault, leave: leave, route: "embeddings", pass: true})
		}
	}
	return cells
}

func TestFailureMatrix(t *testing.T) {
	cells := matrixCells(os.Getenv("PDPROXY_MATRIX") == "full")
	start := time.Now()
	t.Cleanup(func() { t.Logf("%d cells in %v", len(cells), time.Since(start).Round(time.Millisecond)) })
	for _, c := range cells {
		t.Run(c.name(), func(t *testing.T) {
			t.Parallel()
			runCell(t, c)
		})
	}
}

// outcome is what a cell's client may see.
type outcome int

const (
	served outcome = iota // a whole, correct answer
	failed                // a clear failure
	either                // the fault's moment decides: a clear failure or a whole answer
)

// expected is what a client that stays must see in cell c, and, for a failure before any
// byte, the status.
func (c matrixCell) expected() (outcome, int) {
	f := c.fault
	switch f {
	case faultengine.BigHeaders, faultengine.KeepAliveReset, faultengine.LateEnd:
		// LateEnd's pause is longer than client_write_timeout, shorter than the idle one.
		return served, 200
	}
	if c.leg == "prefill" {
		switch f {
		case faultengine.Status400, faultengine.Status400Huge:
			return failed, 400
		case faultengine.Status422Empty:
			return failed, 422
		}
		if c.proto == faultengine.VLLM {
			// Nobody prefilled: the decoder computes the prompt itself.
			return served, 200
		}
		if sendsHead(f) {
			// The room's KV went to the decoder before the prefiller's answer broke.
			return either, 0
		}
		return failed, 0
	}
	switch f {
	case faultengine.Status400, faultengine.Status400Huge:
		return failed, 400
	case faultengine.Status422Empty:
		return failed, 422
	case faultengine.Status500, faultengine.Status503, faultengine.CloseAfterRead, faultengine.HeadersThenClose,
		faultengine.HeadersThenReset, faultengine.EmptyClose:
		return failed, http.StatusBadGateway
	case faultengine.Silent, faultengine.HeadersThenSilence:
		return failed, http.StatusGatewayTimeout
	case faultengine.NoDone:
		if !c.stream {
			return served, 200 // a JSON answer ends whole
		}
	}
	return failed, 0 // mid-answer: after the status line
}

func sendsHead(f faultengine.Fault) bool {
	switch f {
	case faultengine.Status500, faultengine.Status503, faultengine.Status400, faultengine.Status400Huge,
		faultengine.Status422Empty, faultengine.CloseAfterRead, faultengine.Silent:
		return false
	}
	return true
}

func runCell(t *testing.T, c matrixCell) {
	rooms := faultengine.NewRooms()
	start := func(prefill bool, fault faultengine.Fault) *faultengine.Engine {
		e, err := faultengine.Start(faultengine.Config{Protocol: c.proto, Prefill: prefill, Fault: fault, Rooms: rooms})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close)
		return e
	}
	pf, df := faultengine.None, faultengine.None
	if c.leg == "prefill" {
		pf = c.fault
	} else {
		df = c.fault
	}
	p := start(true, pf)
	d0 := start(false, df)
	engines := map[string]*faultengine.Engine{"p0": p, "d0": d0}
	backends := []router.BackendConfig{prefiller("p0", p.URL()), decoder("d0", d0.URL())}
	backends[1].Weight = 2 // least_inflight's ties go to the heavier: the faulty decoder is tried first
	if c.proto == faultengine.VLLM {
		// A second decoder, where a drain, a retry, or a bug, could send a hold's params.
		d1 := start(false, faultengine.None)
		engines["d1"] = d1
		backends = append(backends, decoder("d1", d1.URL()))
		for i := range backends {
			backends[i].Engine = c.kind
		}
	} else {
		for i := range backends {
			backends[i].Engine = c.kind
		}
		backends[0].BootstrapPort = 8998
		if c.proto == faultengine.Mooncake {
			// Its bootstrap server's /query is served on the engine's own port.
			u, _ := url.Parse(p.URL())
			backends[0].BootstrapPort, _ = strconv.Atoi(u.Port())
		}
	}
	cfg := Config{
		PrefillTimeout:         400 * time.Millisecond,
		DecodeFirstByteTimeout: 400 * time.Millisecond,
		DecodeIdleTimeout:      400 * time.Millisecond,
		// Shorter than the silences above: the error event must still reach the client.
		ClientWriteTimeout: 150 * time.Millisecond,
		DrainTimeout:       time.Second,
	}
	h := newHarness(t, cfg, router.Config{Backends: backends})

	path := "/v1/completions"
	body := `{"model":"m","prompt":"hello there","max_tokens":8`
	switch c.route {
	case "chat":
		path = "/v1/chat/completions"
		body = `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":8`
	case "responses":
		path = "/v1/responses"
		body = `{"model":"m","input":[{"role":"user","content":"hello there"}],"max_output_tokens":8`
	}
	if c.stream {
		body += `,"stream":true`
	}
	body += "}"
	if c.pass {
		path, body = "/v1/embeddings", `{"model":"m","input":"hello there"}`
	}

	if c.fault == faultengine.KeepAliveReset {
		// The connection the fault resets must be one kept open from an earlier request.
		if got := matrixCall(t, h, path, body, nil); got.err != nil || got.status != 200 {
			t.Fatalf("warm-up request: status %d, %v", got.status, got.err)
		}
	}

	var leave <-chan struct{}
	if c.leave {
		leave = engines[map[string]string{"prefill": "p0", "decode": "d0"}[c.leg]].Faulted()
	}
	got := matrixCall(t, h, path, body, leave)

	if !c.leave {
		want, status := c.expected()
		got.check(t, c, want, status)
		if c.fault == faultengine.BigHeaders || c.fault == faultengine.KeepAliveReset {
			// Served around the fault with P/D, not by a decode-only fallback that leaves
			// the prefilled KV to the engine's lease.
			if n := h.value("pdproxy_fallbacks_total", nil); n != 0 {
				t.Errorf("%v decode-only fallbacks", n)
			}
		}
	}

	// Nothing is left behind, whatever the client saw.
	h.waitQuiet()
	eventually(t, "every KV hold released", func() bool {
		return h.table.OutstandingHolds() == 0 && h.value("pdproxy_kv_held_requests", nil) == 0
	})
	if n := h.value("pdproxy_panics_total", nil); n != 0 {
		t.Errorf("%v panics", n)
	}
	switch c.proto {
	case faultengine.VLLM:
		paramsAtOneDecoder(t, engines["d0"], engines["d1"])
	case faultengine.SGLang:
		legsAbortedDecoderFirst(t, c, p, d0, got)
	}
	// Only the faulty engine is blamed for a failure.
	for _, b := range backends {
		if b.Name == map[string]string{"prefill": "p0", "decode": "d0"}[c.leg] {
			continue
		}
		for _, code := range []string{"error", "500", "502", "503", "504"} {
			if v := h.value("pdproxy_backend_requests_total", map[string]string{"backend": b.Name, "code": code}); v != 0 {
				t.Errorf("healthy backend %s was charged %v failures with code %s", b.Name, v, code)
			}
		}
	}
}

// matrixResult is what the client got.
type matrixResult struct {
	status int
	ctype  string
	body   []byte
	err    error // the answer could not be read to its end
	left   bool  // the client left
}

// matrixCall sends one request; a client that leaves cancels it once leave is closed.
func matrixCall(t *testing.T, h *harness, path, body string, leave <-chan struct{}) matrixResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testDeadline)
	defer cancel()
	if leave != nil {
		stop := make(chan struct{})
		defer close(stop)
		go func() {
			select {
			case <-leave:
				cancel()
			case <-stop:
			}
		}()
	}
	resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, path, body, nil))
	if err != nil {
		return matrixResult{err: err, left: leave != nil && ctx.Err() != nil}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return matrixResult{status: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), body: b, err: err, left: leave != nil && ctx.Err() != nil}
}

// check asserts what a client that stayed saw.
func (r matrixResult) check(t *testing.T, c matrixCell, want outcome, status int) {
	t.Helper()
	ok := r.whole(c)
	switch {
	case want == served && !ok:
		t.Fatalf("want a whole answer, got status %d (%v): %s", r.status, r.err, clip(r.body))
	case want == served:
		return
	case want == either && ok:
		return
	case ok:
		t.Fatalf("the engine failed, yet the client got a whole answer: status %d: %s", r.status, clip(r.body))
	}
	// A clear failure.
	if r.status != 200 {
		if r.err != nil {
			t.Fatalf("error status %d could not be read: %v", r.status, r.err)
		}
		if !strings.HasPrefix(r.ctype, "application/json") || !openAIError(r.body) {
			t.Fatalf("status %d with %q is not an OpenAI error: %s", r.status, r.ctype, clip(r.body))
		}
		if status != 0 && r.status != status {
			t.Fatalf("status %d, want %d: %s", r.status, status, clip(r.body))
		}
		return
	}
	if status != 0 && status != 200 {
		t.Fatalf("status 200, want %d before any byte: %s", status, clip(r.body))
	}
	if !c.stream {
		if r.err == nil {
			t.Fatalf("a broken JSON answer was passed off as complete: %s", clip(r.body))
		}
		return
	}
	// A stream that failed: its last event is an OpenAI error, and no [DONE] came.
	events := sseDispatched(r.body)
	if len(events) == 0 {
		t.Fatalf("a failed stream with no event: %q (%v)", r.body, r.err)
	}
	if last := events[len(events)-1]; !openAIError([]byte(last)) {
		t.Fatalf("a failed stream's last event is not an OpenAI error: %q", last)
	}
	for _, ev := range events {
		if ev == "[DONE]" {
			t.Fatalf("a failed stream carried [DONE]: %q", r.body)
		}
	}
	if r.err != nil {
		t.Fatalf("a failed stream was cut instead of ending with its error event: %v", r.err)
	}
}

// openAIError reports whether b is an error in the OpenAI shape, as the SDKs read it: an
// "error" object with a message (vLLM's own errors carry a numeric code).
func openAIError(b []byte) bool {
	var v struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	return json.Unmarshal(b, &v) == nil && v.Error != nil && v.Error.Message != "" && v.Error.Type != ""
}

// whole reports whether the client got a complete, correct answer.
func (r matrixResult) whole(c matrixCell) bool {
	if r.err != nil || r.status != 200 {
		return false
	}
	if c.route == "responses" {
		return wholeResponse(r.body, c.stream)
	}
	if c.pass {
		var v struct {
			Data []struct {
				Embedding []float64 `json:"embedding"`
			} `json:"data"`
		}
		return json.Unmarshal(r.body, &v) == nil && len(v.Data) == 1 && len(v.Data[0].Embedding) == 3
	}
	if !c.stream {
		var v struct {
			Choices []json.RawMessage `json:"choices"`
		}
		return json.Unmarshal(r.body, &v) == nil && len(v.Choices) == 1
	}
	events := sseDispatched(r.body)
	if len(events) != 5 || events[4] != "[DONE]" {
		return false
	}
	for _, ev := range events[:4] {
		if !json.Valid([]byte(ev)) || strings.Contains(ev, `"error"`) {
			return false
		}
	}
	return true
}

// wholeResponse reports whether body is the fault engine's whole Responses answer: a
// response object, or its stream from response.created through 4 deltas to response.completed.
func wholeResponse(body []byte, stream bool) bool {
	type event struct {
		Type   string `json:"type"`
		Object string `json:"object"`
		Status string `json:"status"`
	}
	if !stream {
		var v event
		return json.Unmarshal(body, &v) == nil && v.Object == "response" && v.Status == "completed"
	}
	events := sseDispatched(body)
	if len(events) != 6 {
		return false
	}
	for i, ev := range events {
		var v event
		if json.Unmarshal([]byte(ev), &v) != nil || strings.Contains(ev, `"error"`) {
			return false
		}
		want := "response.output_text.delta"
		switch i {
		case 0:
			want = "response.created"
		case 5:
			want = "response.completed"
		}
		if v.Type != want {
			return false
		}
	}
	return true
}

// paramsAtOneDecoder checks that no prefill's params reached two decoders, or one twice.
func paramsAtOneDecoder(t *testing.T, ds ...*faultengine.Engine) {
	t.Helper()
	seen := map[string]int{}
	for _, d := range ds {
		for _, r := range d.Requests() {
			kv := r.Field("kv_transfer_params")
			if kv == nil || bytes.Equal(kv, []byte("null")) {
				continue
			}
			var p struct {
				ID string `json:"remote_request_id"`
			}
			json.Unmarshal(kv, &p)
			seen[p.ID]++
		}
	}
	for id, n := range seen {
		if n > 1 {
			t.Errorf("the params of prefill %s reached decoders %d times", id, n)
		}
	}
}

// legsAbortedDecoderFirst checks SGLang's aborts: a request that failed with its decoder's
// leg at fault has that leg aborted, and when both legs are aborted, the decoder's goes first.
func legsAbortedDecoderFirst(t *testing.T, c matrixCell, p, d *faultengine.Engine, got matrixResult) {
	t.Helper()
	firstAbort := func(e *faultengine.Engine) (time.Time, bool) {
		for _, r := range e.Requests() {
			if r.Path == "/abort_request" {
				return r.At, true
			}
		}
		return time.Time{}, false
	}
	want, _ := c.expected()
	mustAbortDecoder := !c.leave && c.leg == "decode" && want == failed && c.fault != faultengine.KeepAliveReset
	if mustAbortDecoder {
		eventually(t, "the decoder's leg aborted", func() bool { _, ok := firstAbort(d); return ok })
	}
	dAt, dOK := firstAbort(d)
	pAt, pOK := firstAbort(p)
	if pOK && !dOK {
		t.Errorf("the prefiller's leg was aborted and the decoder's was not")
	}
	if pOK && dOK && pAt.Before(dAt) {
		t.Errorf("the prefiller's leg was aborted %v before the decoder's", dAt.Sub(pAt))
	}
}
