package router

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"
	"gopkg.in/yaml.v3"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/enginemetrics"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// scrapedAs gives b a scrape of the engine reporting waiting and running requests and usage
// (negative: not reported), taken when this replica had inflightThen requests on it, fresh
// or stale by the real clock (LeastLoaded's without a router).
func scrapedAs(b *Backend, waiting, running int64, usage float64, inflightThen int64, fresh bool) {
	at := time.Now().Add(-time.Hour)
	if fresh {
		at = time.Now()
	}
	started := b.st.started.Load()
	b.st.load.last.Store(&engineLoad{Load: enginemetrics.Load{Waiting: waiting, Running: running, Usage: usage}, started: started, ended: started - inflightThen,
		at: at, staleAt: at.Add(staleScrapes * time.Minute)})
}

func TestLeastLoadedScoresWhatTheEnginesReport(t *testing.T) {
	tests := []struct {
		name string
		// setup gives the backends (b0, b1, b2 decoders unless it says otherwise) their
		// in-flight counts and scrapes.
		setup func(bs []*Backend)
		n     int
		want  string
		// stale names the backends a pick must count as scored by in-flight alone.
		stale []string
	}{
		{
			name: "the engine reporting the fewest waiting plus running requests wins",
			n:    3,
			setup: func(bs []*Backend) {
				scrapedAs(bs[0], 2, 3, 0.1, 0, true) // 5
				scrapedAs(bs[1], 0, 4, 0.1, 0, true) // 4
				scrapedAs(bs[2], 4, 2, 0.1, 0, true) // 6
			},
			want: "b1",
		},
		{
			name: "load that did not come through this replica counts: fewer own requests lose to an idle engine",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].st.inflight.Store(1)
				scrapedAs(bs[0], 0, 9, 0.5, 1, true) // 8 requests of someone else's
				bs[1].st.inflight.Store(3)
				scrapedAs(bs[1], 0, 3, 0.5, 3, true)
			},
			want: "b1",
		},
		{
			name: "this replica's requests started since the scrape are added",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].st.inflight.Store(3)
				scrapedAs(bs[0], 0, 1, 0, 0, true) // 1 + 3 since
				scrapedAs(bs[1], 0, 2, 0, 0, true)
			},
			want: "b1",
		},
		{
			name: "this replica's requests ended since the scrape are taken off",
			n:    2,
			setup: func(bs []*Backend) {
				scrapedAs(bs[0], 0, 4, 0, 4, true) // all four were ours and are gone
				scrapedAs(bs[1], 0, 1, 0, 0, true)
			},
			want: "b0",
		},
		{
			name: "the score is never below this replica's own in-flight count",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].st.inflight.Store(3) // sent before the scrape, not yet at the engine
				scrapedAs(bs[0], 0, 0, 0, 3, true)
				scrapedAs(bs[1], 0, 2, 0, 0, true)
			},
			want: "b1",
		},
		{
			name: "a stale scrape falls back to in-flight counts, and is counted",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].st.inflight.Store(1)
				scrapedAs(bs[0], 0, 0, 0, 1, false) // said idle, an hour ago
				scrapedAs(bs[1], 0, 2, 0, 0, true)
			},
			want:  "b0", // 1 in flight beats 2 running
			stale: []string{"b0"},
		},
		{
			name: "a backend never scraped is scored by in-flight, and counted",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].st.inflight.Store(3)
				scrapedAs(bs[1], 5, 5, 0, 0, true)
			},
			want:  "b0",
			stale: []string{"b0"},
		},
		{
			name: "a prefiller near a full KV pool is avoided though it has the least work",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].Role, bs[1].Role = routerconfig.RolePrefill, routerconfig.RolePrefill
				scrapedAs(bs[0], 0, 0, 0.95, 0, true)
				scrapedAs(bs[1], 3, 4, 0.3, 0, true)
			},
			want: "b1",
		},
		{
			name: "when every prefiller is near full, the least busy of them is picked",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].Role, bs[1].Role = routerconfig.RolePrefill, routerconfig.RolePrefill
				scrapedAs(bs[0], 2, 0, 0.99, 0, true)
				scrapedAs(bs[1], 1, 0, 0.92, 0, true)
			},
			want: "b1",
		},
		{
			name: "a stale prefiller's last KV usage is not held against it",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].Role, bs[1].Role = routerconfig.RolePrefill, routerconfig.RolePrefill
				scrapedAs(bs[0], 0, 0, 0.99, 0, false)
				scrapedAs(bs[1], 0, 1, 0.2, 0, true)
			},
			want:  "b0",
			stale: []string{"b0"},
		},
		{
			name: "a decoder's high KV usage is its business: decoders run full by design",
			n:    2,
			setup: func(bs []*Backend) {
				scrapedAs(bs[0], 0, 1, 0.97, 0, true)
				scrapedAs(bs[1], 0, 2, 0.2, 0, true)
			},
			want: "b0",
		},
		{
			name: "an engine that reports no KV usage is never taken as full",
			n:    2,
			setup: func(bs []*Backend) {
				bs[0].Role, bs[1].Role = routerconfig.RolePrefill, routerconfig.RolePrefill
				scrapedAs(bs[0], 0, 0, -1, 0, true)
				scrapedAs(bs[1], 0, 1, 0.2, 0, true)
			},
			want: "b0",
		},
		{
			name: "a tie goes to the higher weight",
			n:    3,
			setup: func(bs []*Backend) {
				bs[2].Weight = 3
				for _, b := range bs {
					scrapedAs(b, 0, 2, 0, 0, true)
				}
			},
			want: "b2",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs := testBackends(make([]int64, tt.n)...)
			tt.setup(bs)
			p := &LeastLoaded{}
			if got := p.Select(bs, Hint{}); got.Name != tt.want {
				var scores []string
				for _, b := range bs {
					s, full, fresh := b.loadScore(time.Now())
					scores = append(scores, fmt.Sprintf("%s: score %d full %t fresh %t", b.Name, s, full, fresh))
				}
				t.Errorf("picked %s, want %s (%s)", got.Name, tt.want, strings.Join(scores, "; "))
			}
			for _, b := range bs {
				want := int64(0)
				if slices.Contains(tt.stale, b.Name) {
					want = 1
				}
				if got := b.st.load.stale.Load(); got != want {
					t.Errorf("%s counted stale %d times, want %d", b.Name, got, want)
				}
			}
		})
	}
}

func TestLeastLoadedRotatesAmongEquallyLoadedEngines(t *testing.T) {
	bs := testBackends(0, 0, 0)
	for _, b := range bs {
		scrapedAs(b, 1, 1, 0, 0, true)
	}
	p := &LeastLoaded{}
	seen := map[string]int{}
	for range 30 {
		seen[p.Select(bs, Hint{}).Name]++
	}
	for _, b := range bs {
		if seen[b.Name] != 10 {
			t.Errorf("picks %v, want 10 each: an idle pool spreads its load", seen)
			break
		}
	}
}

// metricsEngine is an engine whose /metrics answers what the test sets, with a status, and
// remembers the Authorization of the last scrape.
type metricsEngine struct {
	*httptest.Server
	body    atomic.Pointer[string]
	status  atomic.Int64
	scrapes atomic.Int64
	auth    atomic.Pointer[string]
}

func newMetricsEngine(t *testing.T, body string) *metricsEngine {
	t.Helper()
	e := &metricsEngine{}
	e.set(http.StatusOK, body)
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			w.WriteHeader(http.StatusOK) // health checks
			return
		}
		a := r.Header.Get("Authorization")
		e.auth.Store(&a)
		e.scrapes.Add(1)
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		w.WriteHeader(int(e.status.Load()))
		fmt.Fprint(w, *e.body.Load())
	}))
	t.Cleanup(e.Close)
	return e
}

func (e *metricsEngine) set(status int, body string) {
	e.status.Store(int64(status))
	e.body.Store(&body)
}

// loadRouter is a router picking with least_loaded in both roles over engines, scraping every
// 50ms, with the health checks off and its Run running until the test ends.
func loadRouter(t *testing.T, reg prometheus.Registerer, backends ...routerconfig.BackendConfig) *Router {
	t.Helper()
	r, err := New(routerconfig.Config{
		Backends:       backends,
		PrefillPolicy:  routerconfig.PolicyLeastLoaded,
		DecodePolicy:   routerconfig.PolicyLeastLoaded,
		ScrapeInterval: 50 * time.Millisecond,
		Health:         routerconfig.HealthConfig{Interval: -1},
	}, zaptest.NewLogger(t), reg)
	if err != nil {
		t.Fatal(err)
	}
	runRouter(t, r)
	return r
}

func status(t *testing.T, r *Router, name string) BackendStatus {
	t.Helper()
	for _, b := range r.Backends() {
		if b.Name == name {
			return b
		}
	}
	t.Fatalf("no backend %s", name)
	return BackendStatus{}
}

// waitLoad waits until r's last good scrape of name shows running requests.
func waitLoad(t *testing.T, r *Router, name string, running int64) {
	t.Helper()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		s := status(t, r, name)
		return s.Load != nil && !s.Load.Stale && s.Load.Running == running, fmt.Sprintf("%s load %+v", name, s.Load)
	})
}

func pick(t *testing.T, r *Router, role routerconfig.Role) string {
	t.Helper()
	l, err := r.Acquire(context.Background(), role, Hint{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(Result{})
	return l.Backend().Name
}

func TestLeastLoadedRoutesByScrapedLoad(t *testing.T) {
	busy := newMetricsEngine(t, testutil.VLLMMetrics(2, 8, 0.5))
	idle := newMetricsEngine(t, testutil.VLLMMetrics(0, 1, 0.1))
	full := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0.95))
	roomy := newMetricsEngine(t, testutil.VLLMMetrics(1, 2, 0.4))
	r := loadRouter(t, nil,
		routerconfig.BackendConfig{Name: "busy", URL: busy.URL, Role: routerconfig.RoleDecode},
		routerconfig.BackendConfig{Name: "idle", URL: idle.URL, Role: routerconfig.RoleDecode},
		routerconfig.BackendConfig{Name: "full", URL: full.URL, Role: routerconfig.RolePrefill},
		routerconfig.BackendConfig{Name: "roomy", URL: roomy.URL, Role: routerconfig.RolePrefill},
	)
	waitLoad(t, r, "busy", 8)
	waitLoad(t, r, "full", 0)
	for i := range 5 {
		if got := pick(t, r, routerconfig.RoleDecode); got != "idle" {
			t.Errorf("decode pick %d = %s, want the engine with the least reported work", i, got)
		}
		if got := pick(t, r, routerconfig.RolePrefill); got != "roomy" {
			t.Errorf("prefill pick %d = %s, want the prefiller whose KV pool is not nearly full", i, got)
		}
	}
	if s := status(t, r, "full").Load; s == nil || !s.KVFull || s.KVUsage == nil || *s.KVUsage != 0.95 {
		t.Errorf("/debug/backends load of the full prefiller = %+v, want kv_usage 0.95, kv_full", s)
	}

	// The busy engine's load goes away; the next scrape tells.
	busy.set(http.StatusOK, testutil.VLLMMetrics(0, 0, 0))
	waitLoad(t, r, "busy", 0)
	if got := pick(t, r, routerconfig.RoleDecode); got != "busy" {
		t.Errorf("decode pick after the busy engine drained = %s, want busy", got)
	}
}

func TestLeastLoadedSharesTheEnginesViewWithOtherReplicas(t *testing.T) {
	// Two replicas over the same two engines. Replica A has sent nothing; what B sent shows
	// in the engines' figures, so A avoids the engine B loaded without being told.
	e0 := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
	e1 := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
	cfg := func() []routerconfig.BackendConfig {
		return []routerconfig.BackendConfig{{Name: "e0", URL: e0.URL, Role: routerconfig.RoleDecode}, {Name: "e1", URL: e1.URL, Role: routerconfig.RoleDecode}}
	}
	a, b := loadRouter(t, nil, cfg()...), loadRouter(t, nil, cfg()...)
	var held []*Lease
	for range 4 {
		l, err := b.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"e1"}})
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	e0.set(http.StatusOK, testutil.VLLMMetrics(0, 4, 0.2)) // the engine runs B's four requests
	waitLoad(t, a, "e0", 4)
	waitLoad(t, b, "e0", 4)
	for i := range 3 {
		if got := pick(t, a, routerconfig.RoleDecode); got != "e1" {
			t.Errorf("replica A pick %d = %s, want e1: e0 runs B's requests", i, got)
		}
		// B counts its four once, not twice (the engine's figure and its own leases).
		if s := status(t, b, "e0").Load; s.Score != 4 {
			t.Errorf("replica B scores e0 %d, want 4", s.Score)
		}
	}
	for _, l := range held {
		l.Release(Result{Status: 200})
	}
}

func TestScrapeFailuresAreCountedAndGoStaleIntoInflight(t *testing.T) {
	tests := []struct {
		name  string
		fault func(e *metricsEngine)
	}{
		{"the engine answers 500", func(e *metricsEngine) { e.set(http.StatusInternalServerError, "oops") }},
		{"the body is not the text format", func(e *metricsEngine) { e.set(http.StatusOK, "<html><body>Not Found</body></html>\n") }},
		{"the engine reports no load gauges (SGLang without --enable-metrics)", func(e *metricsEngine) {
			e.set(http.StatusOK, "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3\n")
		}},
		{"a load gauge is negative", func(e *metricsEngine) { e.set(http.StatusOK, testutil.VLLMMetrics(-1, 0, 0)) }},
		{"the engine is gone", func(e *metricsEngine) { e.Close() }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bad := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
			good := newMetricsEngine(t, testutil.VLLMMetrics(0, 3, 0))
			reg := prometheus.NewRegistry()
			r := loadRouter(t, reg,
				routerconfig.BackendConfig{Name: "bad", URL: bad.URL, Role: routerconfig.RoleDecode},
				routerconfig.BackendConfig{Name: "good", URL: good.URL, Role: routerconfig.RoleDecode})
			waitLoad(t, r, "bad", 0)
			waitLoad(t, r, "good", 3)
			if got := pick(t, r, routerconfig.RoleDecode); got != "bad" {
				t.Fatalf("pick with fresh figures = %s, want bad (0 running against 3)", got)
			}
			tt.fault(bad)
			testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
				s := status(t, r, "bad").Load
				return s != nil && s.Stale, fmt.Sprintf("bad's load %+v", s)
			})
			if n := testutil.Value(t, reg, "pdproxy_backend_scrape_errors_total", map[string]string{"backend": "bad", "role": "decode"}); n < 1 {
				t.Errorf("pdproxy_backend_scrape_errors_total{backend=bad} = %v once stale, want its failures counted", n)
			}
			if n := testutil.Value(t, reg, "pdproxy_backend_scrape_errors_total", map[string]string{"backend": "good"}); n != 0 {
				t.Errorf("pdproxy_backend_scrape_errors_total{backend=good} = %v, want 0", n)
			}
			// Stale, bad is scored by this replica's in-flight count: 2 in flight beat good's
			// 3 running, 4 do not.
			staleBefore := testutil.Value(t, reg, "pdproxy_backend_scrape_stale_total", map[string]string{"backend": "bad"})
			hold := func(n int) (held []*Lease) {
				for range n {
					l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Exclude: []string{"good"}})
					if err != nil {
						t.Fatal(err)
					}
					held = append(held, l)
				}
				return held
			}
			held := hold(2)
			if got := pick(t, r, routerconfig.RoleDecode); got != "bad" {
				t.Errorf("pick = %s, want bad: stale, it has 2 in flight against good's 3 running", got)
			}
			held = append(held, hold(2)...)
			for i := range 3 {
				if got := pick(t, r, routerconfig.RoleDecode); got != "good" {
					t.Errorf("pick %d = %s, want good: bad, stale, has 4 in flight against good's 3 running", i, got)
				}
			}
			// 8 picks scored bad: the 4 leases held there and the 4 free picks.
			if n := testutil.Value(t, reg, "pdproxy_backend_scrape_stale_total", map[string]string{"backend": "bad"}) - staleBefore; n != 8 {
				t.Errorf("pdproxy_backend_scrape_stale_total{backend=bad} grew by %v over 8 picks, want 8", n)
			}
			if n := testutil.Value(t, reg, "pdproxy_backend_scrape_stale_total", map[string]string{"backend": "good"}); n != 0 {
				t.Errorf("pdproxy_backend_scrape_stale_total{backend=good} = %v, want 0: its scrapes are fresh", n)
			}
			for _, l := range held {
				l.Release(Result{Status: 200})
			}
		})
	}
}

func TestScrapesUseTheBackendsOwnClient(t *testing.T) {
	e := newMetricsEngine(t, testutil.VLLMMetrics(0, 2, 0))
	r := loadRouter(t, nil, routerconfig.BackendConfig{Name: "d", URL: e.URL + "/", Role: routerconfig.RoleDecode, APIKey: "engine-key"})
	waitLoad(t, r, "d", 2)
	if a := e.auth.Load(); a == nil || *a != "Bearer engine-key" {
		t.Errorf("scrape sent Authorization %v, want the backend's own key", a)
	}
}

func TestScrapingOnlyWhereLeastLoadedPicks(t *testing.T) {
	p := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
	d := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
	r, err := New(routerconfig.Config{
		Backends:       []routerconfig.BackendConfig{{Name: "p", URL: p.URL, Role: routerconfig.RolePrefill}, {Name: "d", URL: d.URL, Role: routerconfig.RoleDecode}},
		DecodePolicy:   routerconfig.PolicyLeastLoaded,
		ScrapeInterval: 20 * time.Millisecond,
		Health:         routerconfig.HealthConfig{Interval: -1},
	}, zaptest.NewLogger(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	runRouter(t, r)
	testutil.Eventually(t, testutil.Timeout, func() bool { return d.scrapes.Load() >= 3 }, "three scrapes of the decoder")
	if n := p.scrapes.Load(); n != 0 {
		t.Errorf("the prefiller, picked by least_inflight, was scraped %d times, want never", n)
	}
	if s := status(t, r, "p"); s.Load != nil {
		t.Errorf("/debug/backends shows a load for the prefiller: %+v", s.Load)
	}
}

func TestScrapeIntervalConfig(t *testing.T) {
	tests := []struct {
		name    string
		yaml    string
		want    time.Duration
		wantErr string
	}{
		{name: "unset is left to the count of engines", yaml: "decode_policy: least_loaded\n", want: 0},
		{name: "set in the file", yaml: "decode_policy: least_loaded\nscrape_interval: 250ms\n", want: 250 * time.Millisecond},
		{name: "shorter than 10ms is refused", yaml: "scrape_interval: 1ms\n", wantErr: "scrape_interval: 1ms is shorter than 10ms"},
		{name: "negative is refused", yaml: "scrape_interval: -1s\n", wantErr: "scrape_interval: -1s is shorter than 10ms"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c routerconfig.Config
			if err := yaml.Unmarshal([]byte(tt.yaml), &c); err != nil {
				t.Fatal(err)
			}
			c.Backends = []routerconfig.BackendConfig{{URL: "http://127.0.0.1:1", Role: routerconfig.RoleDecode}}
			err := c.Validate()
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Validate = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.ScrapeInterval != tt.want {
				t.Errorf("scrape_interval = %v, want %v", c.ScrapeInterval, tt.want)
			}
		})
	}
}

// With scrape_interval left out, each engine is read every 100ms, or every millisecond per
// engine scraped where that is longer: replicas that learn of each other's requests from the
// engines' reports see them soon, and no replica reads more than 1,000 reports a second.
func TestScrapeIntervalLeftOutFollowsTheCountOfEngines(t *testing.T) {
	for engines, want := range map[int]time.Duration{0: 100 * time.Millisecond, 4: 100 * time.Millisecond, 100: 100 * time.Millisecond,
		250: 250 * time.Millisecond, 1000: time.Second, 4000: 4 * time.Second} {
		if got := routerconfig.AutoScrapeInterval(engines); got != want {
			t.Errorf("%d engines: every %v, want %v", engines, got, want)
		}
	}
	e := newMetricsEngine(t, testutil.VLLMMetrics(0, 0, 0))
	r, err := New(routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "d0", URL: e.URL, Role: routerconfig.RoleDecode}},
		DecodePolicy: routerconfig.PolicyLeastLoaded, Health: routerconfig.HealthConfig{Interval: -1}}, zaptest.NewLogger(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	runRouter(t, r)
	// At the 1s of an interval set by hand, a second and a half holds 2 reads.
	time.Sleep(1500 * time.Millisecond)
	if n := e.scrapes.Load(); n < 5 {
		t.Errorf("one engine was read %d times in 1.5s with scrape_interval left out, want about 15 (every 100ms)", n)
	}
}

func TestLeastLoadedPicksWithoutAllocating(t *testing.T) {
	bs := testBackends(1, 2, 3, 4, 5, 6, 7, 8)
	for _, b := range bs {
		scrapedAs(b, 1, 1, 0.5, 0, true)
	}
	p := &LeastLoaded{}
	if n := testing.AllocsPerRun(100, func() { p.Select(bs, Hint{}) }); n != 0 {
		t.Errorf("Select allocates %v times per pick, want 0", n)
	}
}
