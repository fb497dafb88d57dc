package proxy

import (
	"context"
	"encoding/json"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// panicky is vLLM with a bug: building a decode that carries params, or any prefill, panics,
// as set.
type panicky struct {
	engine.Sequential
	kind                      string
	onPrefill, onDecodeWithKV bool
}

func (p panicky) Kind() string { return p.kind }

func (p panicky) PrefillBody(f *engine.Fields, api engine.API) ([]byte, error) {
	if p.onPrefill {
		panic("a bug building the prefill")
	}
	return p.Sequential.PrefillBody(f, api)
}

func (p panicky) DecodeBody(f *engine.Fields, params json.RawMessage) ([]byte, error) {
	if p.onDecodeWithKV && params != nil {
		panic("a bug building the decode")
	}
	return p.Sequential.DecodeBody(f, params)
}

// panickyCatalog adds the kinds panics_prefill and panics_decode to engine's.
type panickyCatalog struct{ engineCatalog }

func (c panickyCatalog) Engine(kind string) (routerconfig.Engine, bool) {
	switch kind {
	case "panics_prefill":
		return panicky{Sequential: engine.VLLM, kind: kind, onPrefill: true}, true
	case "panics_decode":
		return panicky{Sequential: engine.VLLM, kind: kind, onDecodeWithKV: true}, true
	}
	return c.engineCatalog.Engine(kind)
}

func TestAPanicServingARequestStillFinishesIt(t *testing.T) {
	for _, tc := range []struct {
		name           string
		prefill, decod string
		// drained: the prefiller held KV when the panic came, and the release frees it.
		drained bool
	}{
		{"before anything is held", "panics_prefill", "vllm", false},
		{"with KV held on the prefiller", "vllm", "panics_decode", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newEngine(t, vllmPrefill(prefillerParams))
			d := newEngine(t, vllmDecode)
			pc, dc := prefiller("p0", p.URL()), decoder("d0", d.URL())
			pc.Engine, dc.Engine = tc.prefill, tc.decod
			core, logs := observer.New(zap.ErrorLevel)
			h := newHarnessLogged(t, Config{}, routerconfig.Config{Backends: []routerconfig.BackendConfig{pc, dc}, Engines: panickyCatalog{}},
				lifecycle.Config{}, core)
			resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","stream":true}`,
				http.Header{"X-Request-Id": {"panics-1"}})
			// net/http's own recovery would have cut the connection instead (h.do fails).
			checkOpenAIError(t, resp, body, http.StatusBadGateway)
			h.waitQuiet()
			if n := h.value("pdproxy_panics_total", nil); n != 1 {
				t.Errorf("pdproxy_panics_total = %v, want 1", n)
			}
			if n := h.value("pdproxy_requests_total", map[string]string{"code": "502"}); n != 1 {
				t.Errorf("requests_total{code=502} = %v, want the request counted", n)
			}
			if n := h.table.OutstandingHolds(); n != 0 {
				t.Errorf("%d holds outstanding", n)
			}
			if got := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "drained"}); (got == 1) != tc.drained {
				t.Errorf("kv_releases_total{drained} = %v, want drained %v", got, tc.drained)
			}
			lines := logs.FilterMessage("panic in an engine call").All()
			if len(lines) != 1 || lines[0].ContextMap()["request_id"] != "panics-1" {
				t.Errorf("panic log lines %v, want one naming request panics-1", lines)
			}
		})
	}
}

// panicsOnce is a router whose first decode lease panics: a bug in the proxy's own flow.
type panicsOnce struct {
	*router.Router
	done atomic.Bool
}

func (r *panicsOnce) Acquire(ctx context.Context, role routerconfig.Role, h router.Hint) (*router.Lease, error) {
	if role == routerconfig.RoleDecode && !r.done.Swap(true) {
		panic("a bug picking a decoder")
	}
	return r.Router.Acquire(ctx, role, h)
}

func TestAPanicInTheProxysFlowReleasesTheHeldKVAndAnswers502(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	// After the prefill, the decoder is picked with the prefiller's KV held: the panic comes
	// then, and the drain that releases the KV gets a decoder.
	core, logs := observer.New(zap.ErrorLevel)
	h := newPanickyFront(t, Config{DecoderReservation: ReserveAfterPrefill}, core,
		func(rt *router.Router) Router { return &panicsOnce{Router: rt} }, prefiller("p0", p.URL()), decoder("d0", d.URL()))
	resp, body := h.do(http.MethodPost, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		http.Header{"X-Request-Id": {"panics-2"}})
	checkOpenAIError(t, resp, body, http.StatusBadGateway)
	h.waitQuiet()
	if n := h.value("pdproxy_panics_total", nil); n != 1 {
		t.Errorf("pdproxy_panics_total = %v, want 1", n)
	}
	if n := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "drained"}); n != 1 {
		t.Errorf("kv_releases_total{drained} = %v, want the held KV drained", n)
	}
	if n := h.table.OutstandingHolds(); n != 0 {
		t.Errorf("%d holds outstanding", n)
	}
	lines := logs.FilterMessage("panic serving a request").All()
	if len(lines) != 1 || lines[0].ContextMap()["request_id"] != "panics-2" {
		t.Errorf("panic log lines %v, want one naming request panics-2", lines)
	}
}

// panicsOnDecodeRetry is a router whose first decode lease goes to the decoder named dead and
// whose second panics: a bug in the proxy's flow while a decode, carrying the prefiller's KV,
// is retried on another decoder.
type panicsOnDecodeRetry struct {
	*router.Router
	dead  string
	picks atomic.Int32
}

func (r *panicsOnDecodeRetry) Acquire(ctx context.Context, role routerconfig.Role, h router.Hint) (*router.Lease, error) {
	if role == routerconfig.RoleDecode {
		switch r.picks.Add(1) {
		case 1:
			for _, b := range r.Router.Backends() {
				if b.Role == "decode" && b.Name != r.dead {
					h.Exclude = append(h.Exclude, b.Name)
				}
			}
		case 2:
			panic("a bug picking a decoder for a retry")
		}
	}
	return r.Router.Acquire(ctx, role, h)
}

// A panic while the decode has the hold (the table handed it over, no decoder acknowledged it)
// still ends the hold, gives back every lease the request took and ends its entry.
func TestAPanicWhileTheDecodeCarriesTheKVEndsItsHoldAndLeases(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := newPanickyFront(t, Config{}, nil, func(rt *router.Router) Router { return &panicsOnDecodeRetry{Router: rt, dead: "dead"} },
		prefiller("p0", p.URL()), decoder("dead", closedURL(t)), decoder("d1", d.URL()))
	resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","stream":true}`,
		http.Header{"X-Request-Id": {"panics-3"}})
	checkOpenAIError(t, resp, body, http.StatusBadGateway)
	h.waitQuiet()
	if n := h.value("pdproxy_panics_total", nil); n != 1 {
		t.Errorf("pdproxy_panics_total = %v, want 1", n)
	}
	if n := h.table.OutstandingHolds(); n != 0 {
		t.Errorf("%d holds outstanding, want the decode's hold ended", n)
	}
	if n := h.value("pdproxy_kv_releases_total", map[string]string{"reason": "expired"}); n != 1 {
		t.Errorf("kv_releases_total{expired} = %v, want the hold left to the prefiller's timer", n)
	}
	if n := len(d.generations()); n != 0 {
		t.Errorf("the live decoder got %d decodes, want none: the params went to no decoder", n)
	}
}

// newPanickyFront is a front over a real router of backends, which wrap turns into one with a
// bug, its errors logged to logged as well (nil: only to the test).
func newPanickyFront(t *testing.T, cfg Config, logged zapcore.Core, wrap func(*router.Router) Router, backends ...routerconfig.BackendConfig) *harness {
	t.Helper()
	reg := prometheus.NewRegistry()
	rt, err := router.New(routerconfig.Config{Backends: backends, Engines: engineCatalog{}, Health: routerconfig.HealthConfig{Interval: -1}}, zaptest.NewLogger(t), reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); rt.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	h := newFrontTable(t, cfg, wrap(rt), reg, lifecycle.Config{}, logged)
	h.rt = rt
	return h
}
