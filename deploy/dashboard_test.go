package deploy

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

const dashboardFile = "grafana/pdproxy.json"

// dashboardMetrics are the series an operator needs on the dashboard; each must be in some
// panel's query.
var dashboardMetrics = []string{
	"pdproxy_requests_total",                      // requests and errors by route and code
	"pdproxy_time_to_first_token_seconds",         // TTFT percentiles
	"pdproxy_request_duration_seconds",            // duration percentiles
	"pdproxy_inflight_requests",                   // in flight by lifecycle state
	"pdproxy_aborts_total",                        // aborts by stage
	"pdproxy_abort_propagation_seconds",           // and their propagation time
	"pdproxy_kv_held_requests",                    // KV held
	"pdproxy_kv_releases_total",                   // and released by reason
	"pdproxy_kv_hold_handoffs_total",              // who frees each hold
	"pdproxy_decode_only_total",                   // requests P/D cannot serve safely
	"pdproxy_backend_healthy",                     // backend health
	"pdproxy_backend_inflight_requests",           // and load
	"pdproxy_backend_requests_total",              // calls to each backend by outcome
	"pdproxy_backend_down_total",                  // why a backend went down
	"pdproxy_queue_waiting_requests",              // requests waiting for a backend
	"pdproxy_connections_open",                    // client connections
	"pdproxy_kv_hold_deadline_exceeded_total",     // holds never forwarded
	"pdproxy_shared_state_up",                     // which replicas reach the shared Redis
	"pdproxy_shared_state_errors_total",           // and what it did not take, by op
	"pdproxy_shared_state_check_duration_seconds", // what the shared limits cost a request
	"pdproxy_session_affinity_total",              // sessions kept on their engines, or moved
	"pdproxy_migrations_total",                    // streams that went on on another decoder
	"pdproxy_pool_saturation",                     // how full each role's engines are
	"pdproxy_pool_predicted_ttft_seconds",         // the wait a request finds in each pool
	"pdproxy_pd_ratio_recommended",                // the prefillers per decoder the backlogs ask for
	"pdproxy_flow_queue_depth",                    // each tenant's requests waiting
	"pdproxy_flow_queue_wait_seconds",             // and how long they wait
}

// scrapeLabels are the labels Prometheus adds to every series it scrapes, which the proxy
// does not export itself.
var scrapeLabels = []string{"job", "instance"}

// query is one PromQL expression of the dashboard, with where it is and the legend it feeds.
type query struct {
	where  string // panel title and refId, or the templating variable
	expr   string
	legend string
}

// dashboardQueries reads every query of the dashboard: each target of each panel (rows'
// nested panels included) and each query variable of the templating.
func dashboardQueries(t *testing.T) []query {
	t.Helper()
	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	type target struct {
		RefID        string `json:"refId"`
		Expr         string `json:"expr"`
		LegendFormat string `json:"legendFormat"`
	}
	type panel struct {
		Title   string   `json:"title"`
		Type    string   `json:"type"`
		Targets []target `json:"targets"`
		Panels  []panel  `json:"panels"`
	}
	var dash struct {
		UID        string  `json:"uid"`
		Title      string  `json:"title"`
		Panels     []panel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if dash.UID == "" || dash.Title == "" {
		t.Errorf("%s: no uid or title; Grafana's provisioning needs a uid to keep links stable", dashboardFile)
	}
	var qs []query
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" {
					t.Errorf("panel %q, target %s: empty expr", p.Title, tg.RefID)
				}
				qs = append(qs, query{where: p.Title + "/" + tg.RefID, expr: tg.Expr, legend: tg.LegendFormat})
			}
		}
	}
	walk(dash.Panels)
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		// A variable's query is a string in old dashboards, an object in new ones.
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q.Query); err != nil {
			if err := json.Unmarshal(v.Query, &q); err != nil {
				t.Fatalf("templating variable %s: query %s: %v", v.Name, v.Query, err)
			}
		}
		qs = append(qs, query{where: "variable " + v.Name, expr: q.Query})
	}
	if len(qs) == 0 {
		t.Fatalf("%s has no query", dashboardFile)
	}
	return qs
}

var (
	metricName  = regexp.MustCompile(`\bpdproxy_[A-Za-z0-9_]+`)
	groupLabels = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
	matchers    = regexp.MustCompile(`\{([^}]*)\}`)
	matcher     = regexp.MustCompile(`([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)`)
	labelValues = regexp.MustCompile(`label_values\([^,]*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)`)
	legendLabel = regexp.MustCompile(`\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}`)
)

// exported finds the family a name in a query stands for: the name itself, or a histogram's
// (or summary's) _bucket, _sum or _count series.
func exported(fams map[string]*dto.MetricFamily, name string) (*dto.MetricFamily, bool) {
	if f, ok := fams[name]; ok {
		return f, true
	}
	for _, s := range []struct {
		suffix string
		types  []dto.MetricType
	}{
		{"_bucket", []dto.MetricType{dto.MetricType_HISTOGRAM}},
		{"_sum", []dto.MetricType{dto.MetricType_HISTOGRAM, dto.MetricType_SUMMARY}},
		{"_count", []dto.MetricType{dto.MetricType_HISTOGRAM, dto.MetricType_SUMMARY}},
	} {
		base, ok := strings.CutSuffix(name, s.suffix)
		if !ok {
			continue
		}
		if f, ok := fams[base]; ok && slices.Contains(s.types, f.GetType()) {
			return f, true
		}
	}
	return nil, false
}

// sessionHeader names the session of the exercised proxy's requests.
const sessionHeader = "X-Session-ID"

// tenantHeader names the tenant of the exercised proxy's requests, and tenant the one it
// names.
const (
	tenantHeader = "X-Tenant"
	tenant       = "acme"
)

// scrapeExercisedProxy starts the embedded default (a simulated prefiller and decoder) as
// the e2e tests do, with session affinity and its bindings in a real redis-server as the
// manifests' config has them, prefillers placed by cost (which predicts their time to first
// token) and flow_control with a named tenant before a decoder of max_inflight 1; drives the
// requests that make the labelled series exist (a completion of a session, a stream its
// client leaves while a tenant's request waits behind it, a request P/D cannot serve, a
// decoder that dies) and reads its /metrics over HTTP, as Prometheus would.
func scrapeExercisedProxy(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	cfg := app.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.ShutdownTimeout = 2 * time.Second
	cfg.Proxy.SessionAffinity.Headers = []string{sessionHeader}
	cfg.SharedState.Redis.Addr = redistest.Start(t).Addr()
	cfg.Router.PrefillPolicy = routerconfig.PolicyCacheAware
	cfg.Proxy.FlowControl = proxy.FlowControlConfig{
		TenantHeader: tenantHeader,
		Tenants:      map[string]proxy.TenantConfig{tenant: {Weight: 2}},
	}
	for i := range cfg.Sims {
		cfg.Sims[i].PrefillTime = 2 * time.Millisecond
		cfg.Sims[i].ITL = 2 * time.Millisecond
		if cfg.Sims[i].Role == string(routerconfig.RoleDecode) {
			// One stream fills the decoder, so that the next request waits as its tenant's.
			cfg.Sims[i].MaxInflight = 1
		}
	}
	m, err := app.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		client.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := m.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	})
	metrics := testutil.Scrape(client, m.URL()+"/metrics")
	// post sends body with the headers of kv (a name, then its value, ...).
	post := func(ctx context.Context, body string, kv ...string) *http.Response {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, m.URL()+"/v1/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(kv); i += 2 {
			req.Header.Set(kv[i], kv[i+1])
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	drain := func(resp *http.Response) int {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}

	// A completion of a session through the prefiller and the decoder: requests, TTFT,
	// duration, KV released (decoded), handed over, backend calls, the session's picks and
	// its check in Redis.
	if code := drain(post(context.Background(), `{"model":"sim","prompt":"hello","max_tokens":4}`, sessionHeader, "s-1")); code != http.StatusOK {
		t.Fatalf("completion: status %d", code)
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		_, ok := testutil.Lookup(t, metrics, "pdproxy_session_affinity_total", map[string]string{"role": "decode"})
		return ok, "no pdproxy_session_affinity_total{role=decode} after a request named its session"
	})
	// n > 1: decode-only, reason n.
	if code := drain(post(context.Background(), `{"model":"sim","prompt":"hello","max_tokens":4,"n":2}`)); code != http.StatusOK {
		t.Fatalf("completion with n=2: status %d", code)
	}
	// A stream whose client leaves after a few events: an abort while decoding, and its
	// propagation time. While it holds the decoder, the tenant's request waits (the
	// tenant's queue depth and, once the stream is gone, its wait).
	ctx, cancel := context.WithCancel(context.Background())
	resp := post(ctx, `{"model":"sim","prompt":"tell me everything","max_tokens":100000,"ignore_eos":true,"stream":true}`)
	br := bufio.NewReader(resp.Body)
	for range 3 {
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatalf("stream: %v", err)
		}
	}
	waited := make(chan int, 1)
	go func() {
		req, err := http.NewRequest(http.MethodPost, m.URL()+"/v1/completions", strings.NewReader(`{"model":"sim","prompt":"hello","max_tokens":4}`))
		if err != nil {
			waited <- 0
			return
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(tenantHeader, tenant)
		resp, err := client.Do(req)
		if err != nil {
			waited <- 0
			return
		}
		waited <- drain(resp)
	}()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		depth, _ := testutil.Lookup(t, metrics, "pdproxy_flow_queue_depth", map[string]string{"tenant": tenant})
		return depth == 1, "the tenant's request does not wait behind the stream on the decoder of max_inflight 1"
	})
	cancel()
	resp.Body.Close()
	if code := <-waited; code != http.StatusOK {
		t.Fatalf("the tenant's request that waited for the decoder: status %d", code)
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		_, ok := testutil.Lookup(t, metrics, "pdproxy_abort_propagation_seconds", map[string]string{"stage": "decoding"})
		return ok, "no pdproxy_abort_propagation_seconds{stage=decoding} after the client left its stream"
	})
	// The decoder dies: the next request finds it refusing connections, which takes it
	// down at once (backend_down_total, reason connection_refused).
	dec := m.SimURLs("decode")[0]
	if err := m.StopSim(dec); err != nil {
		t.Fatal(err)
	}
	if code := drain(post(context.Background(), `{"model":"sim","prompt":"hello","max_tokens":4}`)); code == http.StatusOK {
		t.Fatalf("a completion with the only decoder gone answered %d", code)
	}
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		_, ok := testutil.Lookup(t, metrics, "pdproxy_backend_down_total", nil)
		return ok, "no pdproxy_backend_down_total after the decoder died"
	})

	mfs, err := metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	fams := map[string]*dto.MetricFamily{}
	for _, f := range mfs {
		fams[f.GetName()] = f
	}
	return fams
}

// TestDashboardQueriesOnlyWhatTheProxyExports reads every query of the Grafana dashboard and
// checks each pdproxy metric it names against a running proxy's /metrics, and each label it
// groups, filters or labels its legend by against that metric's series: a renamed metric or
// label fails here instead of leaving an empty panel.
func TestDashboardQueriesOnlyWhatTheProxyExports(t *testing.T) {
	qs := dashboardQueries(t)
	fams := scrapeExercisedProxy(t)

	queried := map[string]bool{}
	for _, q := range qs {
		t.Run(q.where, func(t *testing.T) {
			names := metricName.FindAllString(q.expr, -1)
			if len(names) == 0 {
				t.Fatalf("%q names no pdproxy metric", q.expr)
			}
			labels := slices.Clone(scrapeLabels)
			for _, n := range names {
				f, ok := exported(fams, n)
				if !ok {
					t.Errorf("%s: the proxy exports no such metric (expr %q)", n, q.expr)
					continue
				}
				queried[f.GetName()] = true
				if f.GetType() == dto.MetricType_HISTOGRAM {
					labels = append(labels, "le")
				}
				for _, m := range f.GetMetric() {
					for _, lp := range m.GetLabel() {
						labels = append(labels, lp.GetName())
					}
				}
			}
			var used, grouped []string
			for _, g := range groupLabels.FindAllStringSubmatch(q.expr, -1) {
				for l := range strings.SplitSeq(g[1], ",") {
					if l = strings.TrimSpace(l); l != "" {
						used, grouped = append(used, l), append(grouped, l)
					}
				}
			}
			for _, sel := range matchers.FindAllStringSubmatch(q.expr, -1) {
				for _, mt := range matcher.FindAllStringSubmatch(sel[1], -1) {
					used = append(used, mt[1])
				}
			}
			for _, lv := range labelValues.FindAllStringSubmatch(q.expr, -1) {
				used = append(used, lv[1])
			}
			for _, l := range used {
				if !slices.Contains(labels, l) {
					t.Errorf("label %q: no series of %v has it (expr %q)", l, names, q.expr)
				}
			}
			// A legend can only show labels that survive the aggregation.
			for _, ll := range legendLabel.FindAllStringSubmatch(q.legend, -1) {
				if (len(grouped) > 0 && !slices.Contains(grouped, ll[1])) || !slices.Contains(labels, ll[1]) {
					t.Errorf("legend %q shows label %q, which %q does not keep", q.legend, ll[1], q.expr)
				}
			}
		})
	}

	var missing []string
	for _, n := range dashboardMetrics {
		if !queried[n] {
			missing = append(missing, n)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("no panel shows %v", missing)
	}
}

// TestDashboardMetricNamesResolveAsPrometheusDoes pins what exported accepts: a histogram's
// series by their suffixes, a counter only by its own name.
func TestDashboardMetricNamesResolveAsPrometheusDoes(t *testing.T) {
	hist, counter := dto.MetricType_HISTOGRAM, dto.MetricType_COUNTER
	fams := map[string]*dto.MetricFamily{
		"pdproxy_request_duration_seconds": {Name: ptr("pdproxy_request_duration_seconds"), Type: &hist},
		"pdproxy_requests_total":           {Name: ptr("pdproxy_requests_total"), Type: &counter},
	}
	for name, want := range map[string]bool{
		"pdproxy_request_duration_seconds_bucket": true,
		"pdproxy_request_duration_seconds_count":  true,
		"pdproxy_request_duration_seconds_sum":    true,
		"pdproxy_request_duration_seconds":        true,
		"pdproxy_requests_total":                  true,
		"pdproxy_requests_total_count":            false,
		"pdproxy_requests":                        false,
		"pdproxy_request_duration_seconds_total":  false,
	} {
		if _, got := exported(fams, name); got != want {
			t.Errorf("exported(%s) = %v, want %v", name, got, want)
		}
	}
}

func ptr[T any](v T) *T { return &v }
