package proxy

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/pdflow"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// llmdHeader is the header llm-d's scheduler names the prefiller in.
const llmdHeader = "x-prefiller-host-port"

// hostPortOf is an engine's address as llm-d's scheduler writes it: ip:port.
func hostPortOf(t *testing.T, e *fakeEngine) string {
	t.Helper()
	u, err := url.Parse(e.URL())
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

// sidecarHarness is the proxy in llm-d's sidecar slot in front of the local decoder d (of
// engine kind), allowing the prefillers allow lists.
func sidecarHarness(t *testing.T, cfg Config, d *fakeEngine, kind string, allow ...string) *harness {
	t.Helper()
	cfg.PrefillerHeader = llmdHeader
	cfg.PrefillerAllow = allow
	return newHarness(t, cfg, routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "local", URL: d.URL(), Role: routerconfig.RoleDecode, Engine: kind}}})
}

// named is a header naming the prefiller at hostPort.
func named(hostPort string) http.Header {
	h := http.Header{}
	h.Set(llmdHeader, hostPort)
	return h
}

func TestSidecarPrefillsOnThePrefillerTheHeaderNamesAndDecodesLocally(t *testing.T) {
	p0 := newEngine(t, vllmPrefill(prefillerParams))
	p1 := newEngine(t, vllmPrefill(`{"remote_engine_id":"p1","remote_block_ids":[1]}`))
	d := newEngine(t, vllmDecode)
	h := sidecarHarness(t, Config{}, d, "", hostPortOf(t, p0), hostPortOf(t, p1))

	for i, tc := range []struct {
		p      *fakeEngine
		params string
	}{{p0, prefillerParams}, {p1, `{"remote_engine_id":"p1","remote_block_ids":[1]}`}, {p0, prefillerParams}} {
		hdr := named(hostPortOf(t, tc.p))
		hdr.Set("X-Tenant", "team-a")
		resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi","max_tokens":7,"stream":true}`, hdr)
		if resp.StatusCode != http.StatusOK || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
			t.Fatalf("request %d: status %d, body %s", i, resp.StatusCode, body)
		}
		g := tc.p.generations()
		pre := g[len(g)-1]
		var kv map[string]any
		if err := json.Unmarshal(pre.fields(t)["kv_transfer_params"], &kv); err != nil || !reflect.DeepEqual(kv, wantPrefillKV) {
			t.Errorf("request %d: prefill kv_transfer_params = %s, want %v", i, pre.fields(t)["kv_transfer_params"], wantPrefillKV)
		}
		if mt := string(pre.fields(t)["max_tokens"]); mt != "1" {
			t.Errorf("request %d: prefill max_tokens %s, want 1", i, mt)
		}
		dg := d.generations()
		dec := dg[len(dg)-1]
		if got := string(dec.fields(t)["kv_transfer_params"]); got != tc.params {
			t.Errorf("request %d: the decoder got params %s, want the named prefiller's %s", i, got, tc.params)
		}
		if pid, did := pre.Header.Get("X-Request-Id"), dec.Header.Get("X-Request-Id"); pid == "" || pid != did {
			t.Errorf("request %d: X-Request-Id prefill %q, decode %q", i, pid, did)
		}
		for who, got := range map[string]received{"prefiller": pre, "decoder": dec} {
			if v := got.Header.Get(llmdHeader); v != "" {
				t.Errorf("request %d: the %s got %s: %q; it is never forwarded", i, who, llmdHeader, v)
			}
			if got.Header.Get("X-Tenant") != "team-a" {
				t.Errorf("request %d: the %s lost X-Tenant", i, who)
			}
		}
	}
	if n0, n1, nd := len(p0.generations()), len(p1.generations()), len(d.generations()); n0 != 2 || n1 != 1 || nd != 3 {
		t.Errorf("prefills %d on p0, %d on p1, decodes %d; want 2, 1, 3", n0, n1, nd)
	}
	h.waitQuiet()
}

func TestSidecarRequestNamingNoPrefillerIsDecodedAlone(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := sidecarHarness(t, Config{}, d, "", hostPortOf(t, p))
	for _, hdr := range []http.Header{nil, named(""), named(" , " + hostPortOf(t, p))} {
		resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, hdr)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("header %v: status %d, body %s", hdr, resp.StatusCode, body)
		}
	}
	if g := p.generations(); len(g) != 0 {
		t.Errorf("the prefiller got %d calls; a request naming none is decoded alone", len(g))
	}
	for _, dec := range d.generations() {
		if kv, ok := dec.fields(t)["kv_transfer_params"]; ok {
			t.Errorf("the decode carries kv_transfer_params %s; want none", kv)
		}
	}
	if n := h.value("pdproxy_decode_only_total", map[string]string{"reason": pdflow.ReasonNoPrefiller}); n != 3 {
		t.Errorf("pdproxy_decode_only_total{reason=%s} = %v, want 3", pdflow.ReasonNoPrefiller, n)
	}
	h.waitQuiet()
}

func TestSidecarRefusesAPrefillerOutsideTheAllowlistOrMalformed(t *testing.T) {
	allowed := newEngine(t, vllmPrefill(prefillerParams))
	other := newEngine(t, vllmPrefill(prefillerParams)) // same host, another port
	d := newEngine(t, vllmDecode)
	h := sidecarHarness(t, Config{}, d, "", hostPortOf(t, allowed), "10.0.0.0/8", "vllm-prefill-*.llm.svc:8000")
	for _, tc := range []struct {
		name, value string
		status      int
		typ, code   string
		reason      string
	}{
		{"a port the allowlist does not name", hostPortOf(t, other), http.StatusForbidden, "permission_error", "prefiller_not_allowed", refusedNotAllowed},
		{"an address outside every CIDR", "192.168.0.1:8000", http.StatusForbidden, "permission_error", "prefiller_not_allowed", refusedNotAllowed},
		{"a name of another namespace", "vllm-prefill-0.other.svc:8000", http.StatusForbidden, "permission_error", "prefiller_not_allowed", refusedNotAllowed},
		{"a cloud metadata address", "169.254.169.254:80", http.StatusForbidden, "permission_error", "prefiller_not_allowed", refusedNotAllowed},
		{"a URL with a path", "http://10.0.0.1:8000/admin", http.StatusBadRequest, "invalid_request_error", "invalid_prefiller", refusedMalformed},
		{"no port", "10.0.0.1", http.StatusBadRequest, "invalid_request_error", "invalid_prefiller", refusedMalformed},
		{"an octal address", "012.0.0.1:8000", http.StatusBadRequest, "invalid_request_error", "invalid_prefiller", refusedMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := h.do(http.MethodPost, "/v1/completions", `{"model":"m","prompt":"hi"}`, named(tc.value))
			_, typ, code, param := checkOpenAIError(t, resp, body, tc.status)
			if typ != tc.typ || code != tc.code || param == nil || *param != http.CanonicalHeaderKey(llmdHeader) {
				t.Errorf("type %q code %q param %v, want %q %q %q", typ, code, param, tc.typ, tc.code, llmdHeader)
			}
			if strings.Contains(string(body), tc.value) {
				t.Errorf("the answer quotes the header: %s", body)
			}
		})
	}
	for who, e := range map[string]*fakeEngine{"allowed prefiller": allowed, "other prefiller": other, "decoder": d} {
		if g := e.generations(); len(g) != 0 {
			t.Errorf("the %s got %d calls; a refused request reaches no engine", who, len(g))
		}
	}
	if n := h.value("pdproxy_prefiller_header_refused_total", map[string]string{"reason": refusedNotAllowed}); n != 4 {
		t.Errorf("pdproxy_prefiller_header_refused_total{reason=not_allowed} = %v, want 4", n)
	}
	if n := h.value("pdproxy_prefiller_header_refused_total", map[string]string{"reason": refusedMalformed}); n != 3 {
		t.Errorf("pdproxy_prefiller_header_refused_total{reason=malformed} = %v, want 3", n)
	}
	if n := h.value("pdproxy_requests_total", map[string]string{"code": "403"}); n != 4 {
		t.Errorf(`pdproxy_requests_total{code="403"} = %v, want 4`, n)
	}
	h.waitQuiet()
}

func TestSidecarModeRefusesToStartOutsideItsSlot(t *testing.T) {
	d := "http://127.0.0.1:8200"
	allow := []string{"10.0.0.0/8"}
	for _, tc := range []struct {
		name     string
		header   string
		allow    []string
		backends []routerconfig.BackendConfig
		want     string
	}{
		{"no allowlist", llmdHeader, nil, []routerconfig.BackendConfig{decoder("local", d)}, "prefiller_allow: required"},
		{"an allowlist without the header", "", allow, []routerconfig.BackendConfig{decoder("local", d)}, "prefiller_allow: set without prefiller_header"},
		{"a header name that is none", "x prefiller", allow, []routerconfig.BackendConfig{decoder("local", d)}, "prefiller_header"},
		{"an allowlist entry it cannot read", llmdHeader, []string{"10.0.0.0/8", "10.0.0.1"}, []routerconfig.BackendConfig{decoder("local", d)}, "prefiller_allow[1]"},
		{"two decoders", llmdHeader, allow, []routerconfig.BackendConfig{decoder("d0", d), decoder("d1", "http://127.0.0.1:8201")}, "exactly one decode backend"},
		{"a prefill backend", llmdHeader, allow, []routerconfig.BackendConfig{prefiller("p0", "http://10.0.0.1:8000"), decoder("local", d)}, "no prefill backend"},
		{"a paired engine", llmdHeader, allow, []routerconfig.BackendConfig{{Name: "local", URL: d, Role: routerconfig.RoleDecode, Engine: engine.KindSGLang}}, "prefiller_header"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			rt, err := router.New(routerconfig.Config{Backends: tc.backends, Engines: engineCatalog{}, Health: routerconfig.HealthConfig{Interval: -1}}, zaptest.NewLogger(t), reg)
			if err != nil {
				t.Fatal(err)
			}
			cfg := Config{PrefillerHeader: tc.header, PrefillerAllow: tc.allow}
			_, err = New(cfg, rt, lifecycle.New(lifecycle.Config{}, zaptest.NewLogger(t), reg), zaptest.NewLogger(t), reg, reg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New: %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

// The abort and release paths work with a prefiller the header named: a client that leaves
// during the prefill gets its KV released on the local decoder (a drain) or, on an engine with
// an explicit abort, on the named prefiller.
func TestSidecarReleasesTheNamedPrefillersKVWhenTheClientLeaves(t *testing.T) {
	for _, tc := range []struct {
		name, kind, reason string
		drain, abort       bool
	}{
		{"vllm: a one-token drain on the local decoder", engine.KindVLLM, "drained", true, false},
		{"an engine with an abort call: the named prefiller is told", engine.KindSim, "aborted", false, true},
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
				// ... and the prefill answers once the proxy has seen it leave.
				if !p.poll(r, func() bool { return hh.value("pdproxy_aborts_total", map[string]string{"stage": "prefilling"}) == 1 }) {
					return
				}
				vllmPrefill(prefillerParams)(w, r, body)
			})
			d := newEngine(t, vllmDecode)
			hmu.Lock()
			h = sidecarHarness(t, Config{AbortDuringPrefill: AbortPrefillFinishThenFree, KVRelease: ReleaseAbort}, d, tc.kind, hostPortOf(t, p))
			hmu.Unlock()

			resp, err := h.front.Client().Do(h.request(ctx, http.MethodPost, "/v1/completions",
				`{"model":"m","prompt":"hi","stream":true,"max_tokens":50}`, named(hostPortOf(t, p))))
			if err == nil {
				resp.Body.Close()
				t.Fatalf("answered %d; want the request cut by the client", resp.StatusCode)
			}
			eventually(t, "the hold to be released", func() bool {
				return h.value("pdproxy_kv_releases_total", map[string]string{"reason": tc.reason}) == 1
			})
			h.waitQuiet()
			if n := h.table.OutstandingHolds(); n != 0 {
				t.Errorf("OutstandingHolds = %d, want 0", n)
			}
			drains := d.generations()
			if tc.drain {
				if len(drains) != 1 {
					t.Fatalf("the local decoder got %d calls, want one drain", len(drains))
				}
				if f := drains[0].fields(t); string(f["kv_transfer_params"]) != prefillerParams || string(f["max_tokens"]) != "1" {
					t.Errorf("drain body %s, want the named prefiller's params and one token", drains[0].Body)
				}
			} else if len(drains) != 0 {
				t.Errorf("the local decoder got %d calls; want none", len(drains))
			}
			if aborts := p.callsTo("/abort_request"); tc.abort != (len(aborts) > 0) {
				t.Errorf("the named prefiller got %d aborts, want abort %v", len(aborts), tc.abort)
			}
		})
	}
}
