package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// sglangBackends are one SGLang prefiller and one decoder; the prefiller's bootstrap port is
// configured unless discover is set.
func sglangBackends(p, d *fakeEngine, discover bool) routerconfig.Config {
	pc := prefiller("p0", p.URL())
	pc.Engine = "sglang"
	if !discover {
		pc.BootstrapPort = 8998
	}
	dc := decoder("d0", d.URL())
	dc.Engine = "sglang"
	return routerconfig.Config{Backends: []routerconfig.BackendConfig{pc, dc}}
}

// sglangLeg answers a leg: an abort with 200 and no body, a server_info as a prefiller, else
// as serve says.
func sglangLeg(serve engineHandler) engineHandler {
	return func(w http.ResponseWriter, r *http.Request, body []byte) {
		switch r.URL.Path {
		case "/abort_request":
			return
		case "/server_info":
			io.WriteString(w, `{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":9123}`)
			return
		}
		serve(w, r, body)
	}
}

func TestSGLangLegsGoOutTogetherAndTheDecoderAnswers(t *testing.T) {
	for _, discover := range []bool{false, true} {
		t.Run("discover "+strconv.FormatBool(discover), func(t *testing.T) {
			// As with SGLang, the decoder answers only once the prefiller has the room's
			// request: a decoder that answered before would let the proxy end the request,
			// and cancel the prefill leg, before it arrived.
			prefilled := make(chan struct{})
			var once sync.Once
			serveP := answer(http.StatusOK, "application/json", `{"id":"p","choices":[{"text":"x"}]}`)
			p := newEngine(t, sglangLeg(func(w http.ResponseWriter, r *http.Request, body []byte) {
				once.Do(func() { close(prefilled) })
				serveP(w, r, body)
			}))
			var d *fakeEngine
			d = newEngine(t, sglangLeg(func(w http.ResponseWriter, r *http.Request, body []byte) {
				if d.wait(r, prefilled) {
					vllmDecode(w, r, body)
				}
			}))
			h := newHarness(t, Config{}, sglangBackends(p, d, discover))
			resp, body := h.post("/v1/completions", `{"model":"m","prompt":"hi","max_tokens":5}`)
			if resp.StatusCode != http.StatusOK || string(body) != decodeJSONCompletion {
				t.Fatalf("answer %d %s, want the decoder's", resp.StatusCode, body)
			}
			h.waitQuiet() // the prefill leg may end after the client has the answer
			pf, df := p.only(t, "prefiller").fields(t), d.only(t, "decoder").fields(t)
			u, _ := url.Parse(p.URL())
			wantPort := "8998"
			if discover {
				wantPort = "9123"
			}
			for k, want := range map[string]string{"bootstrap_host": strconv.Quote(u.Hostname()), "bootstrap_port": wantPort, "max_tokens": "5"} {
				if string(pf[k]) != want || string(df[k]) != want {
					t.Errorf("%s: prefiller %s, decoder %s; want %s on both", k, pf[k], df[k], want)
				}
			}
			if string(pf["bootstrap_room"]) != string(df["bootstrap_room"]) || len(pf["bootstrap_room"]) == 0 {
				t.Errorf("rooms %s and %s, want one room on both legs", pf["bootstrap_room"], df["bootstrap_room"])
			}
			var rid string
			json.Unmarshal(pf["rid"], &rid)
			if len(rid) != 32 || string(pf["rid"]) != string(df["rid"]) {
				t.Errorf("rids %s and %s, want one 32-digit rid on both legs", pf["rid"], df["rid"])
			}
			h.waitQuiet()
			if n := h.value("pdproxy_kv_hold_handoffs_total", map[string]string{"result": "handed_over"}); n != 1 {
				t.Errorf("handoffs{handed_over} = %v, want 1: the room went to the decoder", n)
			}
			if n := len(p.callsTo("/abort_request")) + len(d.callsTo("/abort_request")); n != 0 {
				t.Errorf("%d aborts for a request that finished", n)
			}
		})
	}
}

// abortOrder records which engine got an abort first.
type abortOrder struct {
	n        atomic.Int64
	prefill  atomic.Int64
	decode   atomic.Int64
	failures atomic.Int64 // aborts still to refuse with 500
}

func (o *abortOrder) leg(role string, serve engineHandler) engineHandler {
	return func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.URL.Path == "/abort_request" {
			if o.failures.Add(-1) >= 0 {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			at := o.n.Add(1)
			if role == "prefill" {
				o.prefill.CompareAndSwap(0, at)
			} else {
				o.decode.CompareAndSwap(0, at)
			}
			return
		}
		serve(w, r, body)
	}
}

func TestSGLangLegsAreAbortedDecoderFirst(t *testing.T) {
	hang := func(e **fakeEngine) engineHandler {
		return func(w http.ResponseWriter, r *http.Request, _ []byte) { (*e).wait(r, nil) }
	}
	for _, tc := range []struct {
		name          string
		prefillAnswer engineHandler // nil: hangs
		decodeAnswer  engineHandler // nil: hangs
		clientLeaves  bool
		abortFailures int64
		wantStatus    int
		wantReason    string
	}{
		{name: "the client leaves while the room is held", clientLeaves: true, wantReason: "aborted"},
		{name: "the prefill leg fails: the decoder would wait for the room", wantStatus: http.StatusBadGateway, wantReason: "aborted",
			prefillAnswer: answer(http.StatusInternalServerError, "application/json", `{"error":"boom"}`)},
		{name: "the decode leg fails: the prefiller would hold the room", wantStatus: http.StatusBadGateway, wantReason: "aborted",
			decodeAnswer: answer(http.StatusServiceUnavailable, "application/json", `{"error":"busy"}`)},
		{name: "aborts that fail are retried", clientLeaves: true, abortFailures: 2, wantReason: "aborted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var o abortOrder
			o.failures.Store(tc.abortFailures)
			var p, d *fakeEngine
			pa, da := tc.prefillAnswer, tc.decodeAnswer
			if pa == nil {
				pa = hang(&p)
			}
			if da == nil {
				da = hang(&d)
			}
			p = newEngine(t, o.leg("prefill", pa))
			d = newEngine(t, o.leg("decode", da))
			h := newHarness(t, Config{}, sglangBackends(p, d, false))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			status := make(chan int, 1)
			go func() {
				resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil))
				if err != nil {
					status <- 0
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				status <- resp.StatusCode
			}()
			if tc.clientLeaves {
				eventually(t, "both legs to arrive", func() bool { return len(p.generations()) == 1 && len(d.generations()) == 1 })
				cancel()
			}
			if s := <-status; s != tc.wantStatus {
				t.Errorf("client got %d, want %d", s, tc.wantStatus)
			}
			eventually(t, "the room to be released", func() bool {
				return h.value("pdproxy_kv_releases_total", map[string]string{"reason": tc.wantReason}) == 1
			})
			h.waitQuiet()
			if dp, pp := o.decode.Load(), o.prefill.Load(); dp == 0 || pp == 0 || dp > pp {
				t.Errorf("abort order: decoder %d, prefiller %d; want both, the decoder's first", dp, pp)
			}
			if n := h.value("pdproxy_kv_release_failures_total", nil); n != 0 {
				t.Errorf("pdproxy_kv_release_failures_total = %v, want 0", n)
			}
			if n := h.value("pdproxy_kv_held_requests", nil); n != 0 {
				t.Errorf("pdproxy_kv_held_requests = %v, want 0", n)
			}
		})
	}
}

func TestSGLangAbortsThatNeverSucceedAreCounted(t *testing.T) {
	var p, d *fakeEngine
	refuse := func(e **fakeEngine) engineHandler {
		return func(w http.ResponseWriter, r *http.Request, _ []byte) {
			if r.URL.Path == "/abort_request" {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			(*e).wait(r, nil)
		}
	}
	p, d = newEngine(t, refuse(&p)), newEngine(t, refuse(&d))
	h := newHarness(t, Config{}, sglangBackends(p, d, false))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("answered %d, want the client's timeout", resp.StatusCode)
	}
	eventually(t, "the failed aborts to be counted, one per leg", func() bool {
		return h.value("pdproxy_kv_release_failures_total", map[string]string{"mode": "abort"}) == 2
	})
	h.waitQuiet()
	if n := h.value("pdproxy_kv_hold_handoffs_total", map[string]string{"result": "left_to_engine"}); n != 1 {
		t.Errorf("handoffs{left_to_engine} = %v, want 1", n)
	}
	if n := len(d.callsTo("/abort_request")); n < pdflow.AbortRetries {
		t.Errorf("the decoder got %d aborts, want at least %d tries", n, pdflow.AbortRetries)
	}
}

func TestSGLangLogLineSplitsPrefillAndDecodeTime(t *testing.T) {
	// The prefiller answers at once; the decoder takes its time over the tokens: the log line
	// puts that time in decode_duration, and only the wait for the legs to join in
	// prefill_duration.
	const perChunk = 60 * time.Millisecond
	p := newEngine(t, sglangLeg(answer(http.StatusOK, "application/json", `{"id":"p","choices":[{"text":"x"}]}`)))
	d := newEngine(t, sglangLeg(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, c := range sseChunks(false) {
			io.WriteString(w, c)
			w.(http.Flusher).Flush()
			time.Sleep(perChunk)
		}
	}))
	core, logs := observer.New(zap.InfoLevel)
	h := newHarnessLogged(t, Config{}, sglangBackends(p, d, false), lifecycle.Config{}, core)
	resp, _ := h.post("/v1/completions", `{"model":"m","prompt":"hi","max_tokens":5,"stream":true}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	h.waitQuiet()
	lines := logs.FilterMessage("request").All()
	if len(lines) != 1 {
		t.Fatalf("%d request log lines, want 1", len(lines))
	}
	f := lines[0].ContextMap()
	prefill, decode, total := f["prefill_duration"].(time.Duration), f["decode_duration"].(time.Duration), f["duration"].(time.Duration)
	if decode < 2*perChunk || decode > total {
		t.Errorf("decode_duration %v, want the decoder's %v or more, within the request's %v", decode, 2*perChunk, total)
	}
	if prefill <= 0 || prefill >= decode {
		t.Errorf("prefill_duration %v, want the wait for the legs to join, shorter than decode_duration %v", prefill, decode)
	}
}
