package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// With abort_during_prefill finish_then_release the prefill is let finish after the client
// left; the KV it then holds is released as kv_release says, and the proxy's books close.
func TestKVHeldForAGoneClientIsReleased(t *testing.T) {
	for _, tc := range []struct {
		name       string
		release    string
		engineKind string
		reason     string // pdproxy_kv_releases_total reason
		drain      bool   // a drain decode goes to the decoder
		abort      bool   // the prefiller gets /abort_request
	}{
		{name: "drain: a one-token decode pulls the KV so the prefiller frees it", release: ReleaseDrain,
			engineKind: engine.KindVLLM, reason: "drained", drain: true},
		{name: "abort on an engine with an abort call: the prefiller is told to free it", release: ReleaseAbort,
			engineKind: engine.KindSim, reason: "aborted", abort: true},
		{name: "abort on vLLM, which has no abort call: drained instead", release: ReleaseAbort,
			engineKind: engine.KindVLLM, reason: "drained", drain: true},
		{name: "wait: left to the engine's timer, nothing is sent", release: ReleaseWait,
			engineKind: engine.KindVLLM, reason: "expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var h *harness
			var hmu sync.Mutex // h is set after the engines exist
			var p *fakeEngine
			p = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
				if r.URL.Path == "/abort_request" {
					return
				}
				cancel() // the client leaves during the prefill ...
				hmu.Lock()
				hh := h
				hmu.Unlock()
				// ... and the prefill answers only once the proxy has seen it leave.
				seen := func() bool {
					return hh.value("pdproxy_aborts_total", map[string]string{"stage": "prefilling"}) == 1
				}
				if !p.poll(r, seen) {
					return
				}
				vllmPrefill(prefillerParams)(w, r, body)
			})
			d := newEngine(t, vllmDecode)
			hmu.Lock()
			h = newHarness(t, Config{AbortDuringPrefill: AbortPrefillFinishThenFree, KVRelease: tc.release},
				routerconfig.Config{Backends: []routerconfig.BackendConfig{
					{Name: "p0", URL: p.URL(), Role: routerconfig.RolePrefill, Engine: tc.engineKind},
					decoder("d0", d.URL()),
				}})
			hmu.Unlock()

			resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/chat/completions",
				`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":50,"n":1}`, nil))
			if err == nil {
				resp.Body.Close()
				t.Fatalf("answered %d; want the request cut by the client", resp.StatusCode)
			}
			eventually(t, "the hold to be released", func() bool {
				return h.value("pdproxy_kv_releases_total", map[string]string{"reason": tc.reason}) == 1
			})
			h.waitQuiet()
			if n := h.value("pdproxy_kv_releases_total", nil); n != 1 {
				t.Errorf("pdproxy_kv_releases_total = %v, want 1 (one hold, released once)", n)
			}
			if n := h.value("pdproxy_kv_held_requests", nil); n != 0 {
				t.Errorf("pdproxy_kv_held_requests = %v, want 0", n)
			}
			if n := h.table.OutstandingHolds(); n != 0 {
				t.Errorf("OutstandingHolds = %d, want 0", n)
			}
			drains := d.generations()
			if !tc.drain && len(drains) != 0 {
				t.Errorf("the decoder got %d calls; want none", len(drains))
			}
			if tc.drain {
				if len(drains) != 1 {
					t.Fatalf("the decoder got %d calls, want one drain", len(drains))
				}
				f := drains[0].fields(t)
				if string(f["kv_transfer_params"]) != prefillerParams || string(f["stream"]) != "false" ||
					string(f["max_tokens"]) != "1" || string(f["max_completion_tokens"]) != "1" || f["n"] != nil {
					t.Errorf("drain body %s, want the held params, no stream, one token, n dropped", drains[0].Body)
				}
				if id := drains[0].Header.Get("X-Request-Id"); id == "" || id != p.only(t, "prefiller").Header.Get("X-Request-Id") {
					t.Errorf("drain X-Request-Id %q, want the prefill's", id)
				}
			}
			// An engine with an abort call may get one more, sent as the client left during
			// the prefill (race R1); one is enough to free the KV, and a repeat is a no-op.
			aborts := p.callsTo("/abort_request")
			if tc.abort != (len(aborts) > 0) {
				t.Errorf("the prefiller got %d aborts, want abort %v", len(aborts), tc.abort)
			}
			for _, a := range aborts {
				var body map[string]string
				if json.Unmarshal(a.Body, &body); body["rid"] != a.Header.Get("X-Request-Id") || body["rid"] == "" {
					t.Errorf("abort body %s, want the request's id", a.Body)
				}
			}
		})
	}
}

func TestConcurrentRequestsAllCompleteAndLeaveNothingBehind(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d0, d1 := newEngine(t, vllmDecode), newEngine(t, vllmDecode)
	h := newHarness(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{
		prefiller("p0", p.URL()), decoder("d0", d0.URL()), decoder("d1", d1.URL()),
	}})
	const n = 24
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			stream := i%2 == 0
			body := fmt.Sprintf(`{"model":"m","prompt":"req %d","stream":%v}`, i, stream)
			req := h.request(context.Background(), http.MethodPost, "/v1/completions", body, nil)
			resp, err := h.front.Client().Do(req)
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			switch {
			case err != nil:
				errs <- err
			case resp.StatusCode != http.StatusOK:
				errs <- fmt.Errorf("request %d: status %d", i, resp.StatusCode)
			case stream && !strings.HasSuffix(string(b), "data: [DONE]\n\n"):
				errs <- fmt.Errorf("request %d: stream %q does not end with [DONE]", i, b)
			case !stream && !json.Valid(b):
				errs <- fmt.Errorf("request %d: body %q is not JSON", i, b)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	h.waitQuiet()
	if got := len(d0.generations()) + len(d1.generations()); got != n {
		t.Errorf("decoders got %d calls, want %d", got, n)
	}
	if got := h.value("pdproxy_requests_total", map[string]string{"code": "200"}); got != n {
		t.Errorf(`pdproxy_requests_total{code="200"} = %v, want %d`, got, n)
	}
}

func TestASecondRequestWithAnIDInFlightIs409(t *testing.T) {
	release := make(chan struct{})
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if d.wait(r, release) {
			vllmDecode(w, r, body)
		}
	})
	h := aggregated(t, Config{}, d)
	hdr := http.Header{"X-Request-Id": {"same-id"}}
	done := make(chan int, 1)
	go func() {
		req := h.request(context.Background(), http.MethodPost, "/v1/completions", `{"model":"m","prompt":"a"}`, hdr)
		resp, err := h.front.Client().Do(req)
		if err != nil {
			done <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	eventually(t, "the first request to reach the decoder", func() bool { return len(d.generations()) == 1 })
	resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"b"}`, hdr)
	if _, _, code, param := checkOpenAIError(t, resp, body, http.StatusConflict); code != "duplicate_request_id" || param == nil || *param != "X-Request-Id" {
		t.Errorf("code %q param %v, want duplicate_request_id on X-Request-Id", code, param)
	}
	close(release)
	if status := <-done; status != http.StatusOK {
		t.Errorf("the first request got %d, want 200", status)
	}
	h.waitQuiet()
	// Once the first is done the id is free again.
	if resp, _ := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"c"}`, hdr); resp.StatusCode != http.StatusOK {
		t.Errorf("the id reused after the first finished got %d, want 200", resp.StatusCode)
	}
}

// With decoder_reservation after_prefill a prefilled request may find every decoder busy; it
// fails (429), and the KV its prefiller holds is drained past the decoder's in-flight limit,
// not left to the engine's timer.
func TestPrefilledRequestFindingNoDecoderHasItsKVDrained(t *testing.T) {
	release := make(chan struct{})
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if strings.Contains(string(body), `"prompt":"first"`) && !d.wait(r, release) {
			return
		}
		vllmDecode(w, r, body)
	})
	p := newEngine(t, vllmPrefill(prefillerParams))
	h := newHarness(t, Config{DecoderReservation: ReserveAfterPrefill}, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			prefiller("p0", p.URL()),
			{Name: "d0", URL: d.URL(), Role: routerconfig.RoleDecode, MaxInflight: 1},
		},
		Queue: routerconfig.QueueConfig{Size: -1},
	})

	first := make(chan int, 1)
	go func() {
		resp, err := h.front.Client().Do(h.request(context.Background(), http.MethodPost, "/v1/completions", `{"model":"m","prompt":"first"}`, nil))
		if err != nil {
			first <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	eventually(t, "the first request to occupy the decoder", func() bool { return len(d.generations()) == 1 })

	resp, body := h.post("/v1/completions", `{"model":"m","prompt":"second"}`)
	// Every 429 speaks one vocabulary, the client limits' too: OpenAI's type "requests".
	if _, typ, code, _ := checkOpenAIError(t, resp, body, http.StatusTooManyRequests); code != "queue_full" || typ != "requests" {
		t.Errorf("type %q code %q, want requests, queue_full", typ, code)
	}
	eventually(t, "the second request's KV to be drained", func() bool {
		return h.value("pdproxy_kv_releases_total", map[string]string{"reason": "drained"}) == 1
	})
	if n := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "expired"}); n != 0 {
		t.Errorf(`pdproxy_kv_releases_total{reason="expired"} = %v, want 0: the hold was drained`, n)
	}
	var drain *received
	for _, g := range d.generations() {
		if strings.Contains(string(g.Body), `"prompt":"second"`) {
			drain = &g
		}
	}
	if drain == nil {
		t.Fatalf("no drain reached the decoder")
	}
	if f := drain.fields(t); string(f["kv_transfer_params"]) != prefillerParams || string(f["max_tokens"]) != "1" || string(f["stream"]) != "false" {
		t.Errorf("drain body %s, want the held params, one token, no stream", drain.Body)
	}
	close(release)
	if status := <-first; status != http.StatusOK {
		t.Errorf("the first request got %d, want 200", status)
	}
	h.waitQuiet()
}

// Race R4: a prefilled request that waited for a decoder past the KV hold deadline must not
// forward the prefiller's params (its blocks may be reused by then); the decoder recomputes,
// and an engine with an abort call is told to free the stale hold.
func TestKVPastItsHoldDeadlineIsNeverForwarded(t *testing.T) {
	release := make(chan struct{})
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if strings.Contains(string(body), `"prompt":"first"`) && !d.wait(r, release) {
			return
		}
		vllmDecode(w, r, body)
	})
	p := newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.URL.Path != "/abort_request" {
			vllmPrefill(prefillerParams)(w, r, body)
		}
	})
	clock := testutil.NewClock(time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC))
	const holdTimeout = 30 * time.Second
	h := newHarnessTable(t, Config{DecoderReservation: ReserveAfterPrefill}, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			{Name: "p0", URL: p.URL(), Role: routerconfig.RolePrefill, Engine: engine.KindSim},
			{Name: "d0", URL: d.URL(), Role: routerconfig.RoleDecode, MaxInflight: 1},
		},
	}, lifecycle.Config{KVHoldTimeout: holdTimeout, Now: clock.Now})
	t.Cleanup(func() { closeOnce(release) })

	first := make(chan int, 1)
	go func() { first <- h.statusOf(`{"model":"m","prompt":"first"}`, nil) }()
	eventually(t, "the first request to occupy the decoder", func() bool { return len(d.generations()) == 1 })

	second := make(chan int, 1)
	hdr := http.Header{"X-Request-Id": {"waits-in-kv-held"}}
	go func() { second <- h.statusOf(`{"model":"m","prompt":"second","stream":true}`, hdr) }()
	eventually(t, "the second request to wait for a decoder with its KV held", func() bool {
		st, ok := h.table.State("waits-in-kv-held")
		return ok && st == lifecycle.KVHeld
	})
	clock.Advance(holdTimeout + time.Second)
	closeOnce(release)

	if s := <-first; s != http.StatusOK {
		t.Errorf("first request: %d, want 200", s)
	}
	if s := <-second; s != http.StatusOK {
		t.Errorf("second request: %d, want 200 (the decoder recomputes)", s)
	}
	h.waitQuiet()
	var dec *received
	for _, g := range d.generations() {
		if strings.Contains(string(g.Body), `"prompt":"second"`) {
			dec = &g
		}
	}
	if dec == nil {
		t.Fatalf("the second request never reached the decoder")
	}
	if kv, ok := dec.fields(t)["kv_transfer_params"]; ok {
		t.Errorf("the decode carries kv_transfer_params %s past the hold deadline; want none", kv)
	}
	if n := h.value("pdproxy_kv_hold_deadline_exceeded_total", nil); n != 1 {
		t.Errorf("pdproxy_kv_hold_deadline_exceeded_total = %v, want 1", n)
	}
	if n := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "expired"}); n != 1 {
		t.Errorf(`pdproxy_kv_releases_total{reason="expired"} = %v, want 1`, n)
	}
	var engineID string
	for _, g := range p.generations() {
		if strings.Contains(string(g.Body), `"prompt":"second"`) {
			engineID = g.Header.Get("X-Request-Id")
		}
	}
	eventually(t, "the prefiller to be told to free the stale hold", func() bool {
		for _, a := range p.callsTo("/abort_request") {
			if engineID != "" && a.Header.Get("X-Request-Id") == engineID {
				return true
			}
		}
		return false
	})
}

var closeMu sync.Mutex

// closeOnce closes ch unless it is closed already.
func closeOnce(ch chan struct{}) {
	closeMu.Lock()
	defer closeMu.Unlock()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// Race R2: a client that leaves while its prefilled request waits for a decoder gets its KV
// released at once (drained past the busy decoder's limit), not pinned until the engine's timer.
func TestClientLeavingWithKVHeldGetsItDrained(t *testing.T) {
	release := make(chan struct{})
	var d *fakeEngine
	d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if strings.Contains(string(body), `"prompt":"first"`) && !d.wait(r, release) {
			return
		}
		vllmDecode(w, r, body)
	})
	p := newEngine(t, vllmPrefill(prefillerParams))
	h := newHarness(t, Config{DecoderReservation: ReserveAfterPrefill}, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			prefiller("p0", p.URL()),
			{Name: "d0", URL: d.URL(), Role: routerconfig.RoleDecode, MaxInflight: 1},
		},
	})
	t.Cleanup(func() { closeOnce(release) })

	first := make(chan int, 1)
	go func() { first <- h.statusOf(`{"model":"m","prompt":"first"}`, nil) }()
	eventually(t, "the first request to occupy the decoder", func() bool { return len(d.generations()) == 1 })

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gone := make(chan error, 1)
	go func() {
		req := h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"second","stream":true}`,
			http.Header{"X-Request-Id": {"leaves-in-kv-held"}})
		resp, err := h.front.Client().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		gone <- err
	}()
	eventually(t, "the second request to wait for a decoder with its KV held", func() bool {
		st, ok := h.table.State("leaves-in-kv-held")
		return ok && st == lifecycle.KVHeld
	})
	cancel()
	if err := <-gone; err == nil {
		t.Fatalf("the second request was answered; want it cut by the client")
	}
	eventually(t, "the held KV to be drained", func() bool {
		return h.value("pdproxy_kv_releases_total", map[string]string{"reason": "drained"}) == 1
	})
	if n := h.value("pdproxy_aborts_total", map[string]string{"stage": "kv_held"}); n != 1 {
		t.Errorf(`pdproxy_aborts_total{stage="kv_held"} = %v, want 1`, n)
	}
	drains := d.generationsWith(`"prompt":"second"`)
	if len(drains) != 1 {
		t.Fatalf("the decoder got %d calls for the second request, want one drain", len(drains))
	}
	if f := drains[0].fields(t); string(f["kv_transfer_params"]) != prefillerParams || string(f["stream"]) != "false" || string(f["max_tokens"]) != "1" {
		t.Errorf("drain body %s, want the held params, no stream, one token", drains[0].Body)
	}
	closeOnce(release)
	if s := <-first; s != http.StatusOK {
		t.Errorf("first request: %d, want 200", s)
	}
	h.waitQuiet()
	if n := h.table.OutstandingHolds(); n != 0 {
		t.Errorf("OutstandingHolds = %d, want 0", n)
	}
}

// TestAnAcknowledgedDecodeIsNeverSentToASecondDecoder: a non-streaming answer's headers come
// at its end, so a client that leaves mid-decode cuts the call before them. The decoder had
// acknowledged the decode ("100 Continue") and has the params: the proxy must not drain
// them to another decoder, which would read blocks the first one already pulled.
func TestAnAcknowledgedDecodeIsNeverSentToASecondDecoder(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream %v", stream), func(t *testing.T) {
			p := newEngine(t, vllmPrefill(prefillerParams))
			var decoders []*fakeEngine
			for range 2 {
				var d *fakeEngine
				d = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
					// Generates until the client leaves; a stream's headers go out at once.
					if stream {
						w.Header().Set("Content-Type", "text/event-stream")
						w.WriteHeader(http.StatusOK)
						w.(http.Flusher).Flush()
					}
					d.wait(r, nil)
				})
				decoders = append(decoders, d)
			}
			h := newHarness(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{
				prefiller("p0", p.URL()), decoder("d0", decoders[0].URL()), decoder("d1", decoders[1].URL()),
			}})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() {
				defer close(done)
				resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions",
					fmt.Sprintf(`{"model":"m","prompt":"hi","max_tokens":100,"stream":%v}`, stream), nil))
				if err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}()
			eventually(t, "a decoder to have the decode", func() bool {
				return len(decoders[0].generations())+len(decoders[1].generations()) == 1
			})
			cancel()
			<-done
			h.waitQuiet()
			if n := len(decoders[0].generations()) + len(decoders[1].generations()); n != 1 {
				t.Errorf("the decoders got %d calls with the hold's params, want 1", n)
			}
			if n := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "decoded"}); n != 1 {
				t.Errorf(`pdproxy_kv_releases_total{reason="decoded"} = %v, want 1`, n)
			}
			if n := h.value("pdproxy_kv_releases_total", nil); n != 1 {
				t.Errorf("pdproxy_kv_releases_total = %v, want 1 (one hold, released once)", n)
			}
			if n := h.value("pdproxy_kv_held_requests", nil); n != 0 {
				t.Errorf("pdproxy_kv_held_requests = %v, want 0", n)
			}
		})
	}
}

// A drain that finds no decoder usable waits for one to come back, for as long as the hold's
// params may go to a decoder, rather than leave the blocks to the prefiller's lease: the only
// decoder is down by its health checks when a prefilled request looks for one; the request
// fails (503), its hold stays the proxy's, and the drain goes once the decoder is up again.
func TestADrainWaitsForADecoderToComeBack(t *testing.T) {
	h, p, d, down := decoderDownAfterPrefill(t, lifecycle.Config{})
	resp, body := h.post("/v1/completions", `{"model":"m","prompt":"held"}`)
	checkOpenAIError(t, resp, body, http.StatusServiceUnavailable)
	if n := len(p.generations()); n != 1 {
		t.Fatalf("the prefiller got %d calls, want the one prefill (%s)", n, body)
	}
	// Several health checks later, the decoder still down: the hold is still the proxy's.
	time.Sleep(200 * time.Millisecond)
	if n := h.value("pdproxy_kv_releases_total", nil); n != 0 {
		t.Fatalf("pdproxy_kv_releases_total = %v while no decoder could take the drain, want 0: the hold was given up", n)
	}
	if n := h.table.OutstandingHolds(); n != 1 {
		t.Errorf("OutstandingHolds = %d while the drain waits, want 1", n)
	}
	down.Store(false)
	eventually(t, "the held KV to be drained once the decoder is back", func() bool {
		return h.value("pdproxy_kv_releases_total", map[string]string{"reason": "drained"}) == 1
	})
	drain := d.only(t, "the decoder")
	if f := drain.fields(t); string(f["kv_transfer_params"]) != prefillerParams || string(f["max_tokens"]) != "1" {
		t.Errorf("drain body %s, want the held params, one token", drain.Body)
	}
	if n := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "expired"}); n != 0 {
		t.Errorf(`pdproxy_kv_releases_total{reason="expired"} = %v, want 0`, n)
	}
	h.waitQuiet()
}

// A drain that waits for a decoder stops at the hold deadline: past it the params go to no
// decoder (race R4), not even one that comes back, and the hold is left to the prefiller's
// lease, counted as a failed drain.
func TestADrainGivesUpAtTheHoldDeadline(t *testing.T) {
	h, _, d, down := decoderDownAfterPrefill(t, lifecycle.Config{KVHoldTimeout: 300 * time.Millisecond})
	resp, body := h.post("/v1/completions", `{"model":"m","prompt":"held"}`)
	checkOpenAIError(t, resp, body, http.StatusServiceUnavailable)
	eventually(t, "the hold to be given up at its deadline", func() bool {
		return h.value("pdproxy_kv_releases_total", map[string]string{"reason": "expired"}) == 1
	})
	if n := h.value("pdproxy_kv_release_failures_total", map[string]string{"mode": "drain"}); n != 1 {
		t.Errorf(`pdproxy_kv_release_failures_total{mode="drain"} = %v, want 1`, n)
	}
	down.Store(false)
	eventually(t, "the decoder to be up again", func() bool {
		return h.value("pdproxy_backend_healthy", map[string]string{"backend": "d0"}) == 1
	})
	h.waitQuiet()
	if g := d.generations(); len(g) != 0 {
		t.Errorf("the decoder got %d calls after the hold deadline, want none: %s", len(g), g[0].Body)
	}
	if n := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "drained"}); n != 0 {
		t.Errorf(`pdproxy_kv_releases_total{reason="drained"} = %v, want 0`, n)
	}
}

// decoderDownAfterPrefill is a proxy (its table built from lcfg) with one prefiller and one
// decoder, whose health checks fail while down is set: a prefill sets it, and answers once the
// proxy has seen the decoder go down, so that the prefilled request finds no decoder.
func decoderDownAfterPrefill(t *testing.T, lcfg lifecycle.Config) (h *harness, p, d *fakeEngine, down *atomic.Bool) {
	down = new(atomic.Bool)
	d = sickableDecoder(t, down)
	var hp atomic.Pointer[harness]
	prefill := vllmPrefill(prefillerParams)
	p = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		if r.Method != http.MethodPost {
			return
		}
		down.Store(true)
		if p.poll(r, func() bool {
			return hp.Load().value("pdproxy_backend_healthy", map[string]string{"backend": "d0"}) == 0
		}) {
			prefill(w, r, body)
		}
	})
	backends := []routerconfig.BackendConfig{prefiller("p0", p.URL()), decoder("d0", d.URL())}
	for i := range backends {
		// Named, so that the checks do not ask the fake engines for their models.
		backends[i].Models = []string{"m"}
	}
	h = newHarnessTable(t, Config{DecoderReservation: ReserveAfterPrefill}, routerconfig.Config{
		Backends: backends,
		Health:   routerconfig.HealthConfig{Interval: 20 * time.Millisecond, UnhealthyThreshold: 1, HealthyThreshold: 1},
	}, lcfg)
	hp.Store(h)
	return h, p, d, down
}

// A drain whose decoder is gone (its connection refused: the decoder reserved for the request
// died while the prefill ran) goes to another decoder, which pulls the blocks; the dead one
// never read the params, so they still reach one decoder only.
func TestADrainWhoseDecoderIsGoneGoesToAnother(t *testing.T) {
	release, prefilled := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() { closeOnce(release); closeOnce(prefilled) })
	var decoders [2]*fakeEngine
	for i := range decoders {
		e := &decoders[i]
		*e = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
			if strings.Contains(string(body), `"prompt":"first"`) && !(*e).wait(r, release) {
				return
			}
			vllmDecode(w, r, body)
		})
	}
	prefill := vllmPrefill(prefillerParams)
	var p *fakeEngine
	p = newEngine(t, func(w http.ResponseWriter, r *http.Request, body []byte) {
		// The second prefill ends only after its client left: finish_then_release lets it.
		if strings.Contains(string(body), `"prompt":"second"`) {
			select {
			case <-prefilled:
			case <-p.stop:
				return
			}
		}
		prefill(w, r, body)
	})
	h := newHarness(t, Config{AbortDuringPrefill: AbortPrefillFinishThenFree}, routerconfig.Config{
		Backends: []routerconfig.BackendConfig{
			prefiller("p0", p.URL()),
			{Name: "d0", URL: decoders[0].URL(), Role: routerconfig.RoleDecode, MaxInflight: 1},
			{Name: "d1", URL: decoders[1].URL(), Role: routerconfig.RoleDecode, MaxInflight: 1},
		},
	})
	first := make(chan int, 1)
	go func() { first <- h.statusOf(`{"model":"m","prompt":"first"}`, nil) }()
	busy := -1
	eventually(t, "the first request to occupy a decoder", func() bool {
		for i, d := range decoders {
			if len(d.generations()) == 1 {
				busy = i
			}
		}
		return busy >= 0
	})
	// The second request reserves the other decoder, the only one with a free slot.
	reserved, other := decoders[1-busy], decoders[busy]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	gone := make(chan error, 1)
	go func() {
		resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions", `{"model":"m","prompt":"second"}`, nil))
		if err == nil {
			resp.Body.Close()
		}
		gone <- err
	}()
	eventually(t, "the second prefill to reach the prefiller", func() bool { return len(p.generations()) == 2 })
	// The reserved decoder dies: nothing listens at its address any more.
	reserved.srv.CloseClientConnections()
	reserved.srv.Close()
	cancel()
	if err := <-gone; err == nil {
		t.Fatal("the second request was answered; want it cut by its client")
	}
	eventually(t, "the proxy to see the client leave during the prefill", func() bool {
		return h.value("pdproxy_aborts_total", map[string]string{"stage": "prefilling"}) == 1
	})
	// The prefill ends while the first request still runs on the live decoder: the dead one,
	// with nothing in flight, is the first pick for the drain.
	closeOnce(prefilled)
	eventually(t, "the held KV to be drained through the live decoder", func() bool {
		return h.value("pdproxy_kv_releases_total", map[string]string{"reason": "drained"}) == 1
	})
	closeOnce(release)
	if s := <-first; s != http.StatusOK {
		t.Errorf("the first request got %d, want 200", s)
	}
	drains := other.generationsWith(`"prompt":"second"`)
	if len(drains) != 1 {
		t.Fatalf("the live decoder got %d calls for the second request, want one drain", len(drains))
	}
	if f := drains[0].fields(t); string(f["kv_transfer_params"]) != prefillerParams || string(f["max_tokens"]) != "1" {
		t.Errorf("drain body %s, want the held params, one token", drains[0].Body)
	}
	if n := len(reserved.generations()); n != 0 {
		t.Errorf("the dead decoder read %d calls, want none", n)
	}
	if n := h.value("pdproxy_kv_release_failures_total", nil); n != 0 {
		t.Errorf("pdproxy_kv_release_failures_total = %v, want 0", n)
	}
	h.waitQuiet()
}
