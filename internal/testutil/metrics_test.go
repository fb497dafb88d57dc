package testutil

import (
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"reflect"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
)

// testRegistry holds one metric of each kind, with known values.
func testRegistry(t *testing.T) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "test_requests_total", Help: "h"}, []string{"backend", "code"})
	requests.WithLabelValues("d0", "200").Add(3)
	requests.WithLabelValues("d0", "503").Add(1)
	requests.WithLabelValues("d1", "200").Add(5)
	held := prometheus.NewGauge(prometheus.GaugeOpts{Name: "test_held", Help: "h"})
	held.Set(2)
	wait := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "test_wait_seconds", Help: "h", Buckets: []float64{0.1, 1}}, []string{"stage"})
	wait.WithLabelValues("a").Observe(0.05)
	wait.WithLabelValues("a").Observe(0.5)
	wait.WithLabelValues("b").Observe(2)
	// A name with a colon, as vLLM's are.
	running := prometheus.NewGauge(prometheus.GaugeOpts{Name: "vllm:num_requests_running", Help: "h", ConstLabels: prometheus.Labels{"model_name": "m"}})
	running.Set(7)
	reg.MustRegister(requests, held, wait, running)
	return reg
}

func TestLookupAddsUpTheMatchingSeries(t *testing.T) {
	reg := testRegistry(t)
	tests := []struct {
		name        string
		metric      string
		labels      map[string]string
		want        float64
		wantPresent bool
	}{
		{"one counter series named by all its labels", "test_requests_total", map[string]string{"backend": "d0", "code": "200"}, 3, true},
		{"the counter series that share a label, added up", "test_requests_total", map[string]string{"backend": "d0"}, 4, true},
		{"every series with nil labels", "test_requests_total", nil, 9, true},
		{"a gauge", "test_held", nil, 2, true},
		{"a histogram's sample count", "test_wait_seconds", map[string]string{"stage": "a"}, 2, true},
		{"a metric name with a colon", "vllm:num_requests_running", map[string]string{"model_name": "m"}, 7, true},
		{"a label value no series has: absent", "test_requests_total", map[string]string{"code": "0"}, 0, false},
		{"a metric that does not exist: absent", "test_nothing", nil, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, present := Lookup(t, reg, tt.metric, tt.labels)
			if got != tt.want || present != tt.wantPresent {
				t.Errorf("Lookup = %v, %v; want %v, %v", got, present, tt.want, tt.wantPresent)
			}
			if v := Value(t, reg, tt.metric, tt.labels); v != tt.want {
				t.Errorf("Value = %v, want %v", v, tt.want)
			}
		})
	}
}

func TestSumReadsFamiliesAlreadyGathered(t *testing.T) {
	mfs, err := testRegistry(t).Gather()
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := Sum(mfs, "test_requests_total", map[string]string{"code": "200"}); got != 8 || !ok {
		t.Errorf("Sum = %v, %v; want 8, true", got, ok)
	}
}

func TestAFailedGatherFailsTheTest(t *testing.T) {
	broken := prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) { return nil, errors.New("collector exploded") })
	for name, read := range map[string]func(testing.TB){
		"Value":       func(tb testing.TB) { Value(tb, broken, "x", nil) },
		"HistogramOf": func(tb testing.TB) { HistogramOf(tb, broken, "x", nil) },
		"Series":      func(tb testing.TB) { Series(tb, broken, "x", nil) },
		"Snapshot":    func(tb testing.TB) { Snapshot(tb, broken, "") },
	} {
		t.Run(name, func(t *testing.T) {
			if r := run(read); !r.failed {
				t.Errorf("%s on a failing gatherer did not fail the test", name)
			}
		})
	}
}

func TestHistogramOfMergesTheMatchingSeries(t *testing.T) {
	reg := testRegistry(t)
	t.Run("one series", func(t *testing.T) {
		h, ok := HistogramOf(t, reg, "test_wait_seconds", map[string]string{"stage": "a"})
		want := Histogram{Count: 2, Sum: 0.55, Buckets: []Bucket{{0.1, 1}, {1, 2}}}
		if !ok || h.Count != want.Count || math.Abs(h.Sum-want.Sum) > 1e-9 || !reflect.DeepEqual(h.Buckets, want.Buckets) {
			t.Errorf("HistogramOf = %+v, %v; want %+v, true", h, ok, want)
		}
	})
	t.Run("every series", func(t *testing.T) {
		h, ok := HistogramOf(t, reg, "test_wait_seconds", nil)
		want := Histogram{Count: 3, Sum: 2.55, Buckets: []Bucket{{0.1, 1}, {1, 2}}}
		if !ok || h.Count != want.Count || math.Abs(h.Sum-want.Sum) > 1e-9 || !reflect.DeepEqual(h.Buckets, want.Buckets) {
			t.Errorf("HistogramOf = %+v, %v; want %+v, true", h, ok, want)
		}
	})
	t.Run("no series: absent", func(t *testing.T) {
		if h, ok := HistogramOf(t, reg, "test_wait_seconds", map[string]string{"stage": "z"}); ok || h.Count != 0 {
			t.Errorf("HistogramOf = %+v, %v; want nothing", h, ok)
		}
	})
	t.Run("a metric that is no histogram fails the test", func(t *testing.T) {
		if r := run(func(tb testing.TB) { HistogramOf(tb, reg, "test_held", nil) }); !r.failed {
			t.Error("HistogramOf of a gauge did not fail the test")
		}
	})
}

func TestSeriesListsEachMatchingSeriesWithItsLabels(t *testing.T) {
	got := Series(t, testRegistry(t), "test_requests_total", map[string]string{"code": "200"})
	want := []Sample{
		{Labels: map[string]string{"backend": "d0", "code": "200"}, Value: 3},
		{Labels: map[string]string{"backend": "d1", "code": "200"}, Value: 5},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Series = %+v, want %+v", got, want)
	}
}

func TestSnapshotKeysEverySeriesOfThePrefix(t *testing.T) {
	got := Snapshot(t, testRegistry(t), "test_")
	want := map[string]float64{
		`test_requests_total{backend="d0",code="200"}`: 3,
		`test_requests_total{backend="d0",code="503"}`: 1,
		`test_requests_total{backend="d1",code="200"}`: 5,
		`test_held`:                          2,
		`test_wait_seconds_count{stage="a"}`: 2,
		`test_wait_seconds_sum{stage="a"}`:   0.55,
		`test_wait_seconds_count{stage="b"}`: 1,
		`test_wait_seconds_sum{stage="b"}`:   2,
	}
	if len(got) != len(want) {
		t.Errorf("Snapshot has %d keys, want %d: %v", len(got), len(want), got)
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || math.Abs(g-v) > 1e-9 {
			t.Errorf("Snapshot[%s] = %v (present %v), want %v", k, g, ok, v)
		}
	}
}

func TestScrapeReadsWhatTheEndpointServes(t *testing.T) {
	reg := testRegistry(t)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	defer srv.Client().CloseIdleConnections()
	scraped := Scrape(srv.Client(), srv.URL)
	for _, q := range []struct {
		metric string
		labels map[string]string
	}{
		{"test_requests_total", map[string]string{"backend": "d0"}},
		{"test_held", nil},
		{"test_wait_seconds", map[string]string{"stage": "a"}},
		{"vllm:num_requests_running", nil},
	} {
		want, _ := Lookup(t, reg, q.metric, q.labels)
		if got, ok := Lookup(t, scraped, q.metric, q.labels); !ok || got != want {
			t.Errorf("scraped %s%v = %v (present %v), the registry holds %v", q.metric, q.labels, got, ok, want)
		}
	}
	if h, _ := HistogramOf(t, scraped, "test_wait_seconds", nil); h.Count != 3 || len(h.Buckets) != 2 {
		t.Errorf("scraped histogram = %+v, want 3 samples in 2 buckets", h)
	}
}

func TestScrapeOfAFailingEndpointIsAnError(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "no", http.StatusInternalServerError)
	}))
	defer srv.Close()
	defer srv.Client().CloseIdleConnections()
	if _, err := Scrape(srv.Client(), srv.URL).Gather(); err == nil {
		t.Error("Gather of a 500 answer gave no error")
	}
}
