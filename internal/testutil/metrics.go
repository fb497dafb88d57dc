package testutil

import (
	"fmt"
	"math"
	"net/http"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Value is Lookup without the presence: 0 when no series matches.
func Value(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	v, _ := Lookup(t, g, name, labels)
	return v
}

// Lookup gathers g and adds up the series of the metric name whose labels include labels (nil
// for every series): a counter's, gauge's or untyped value, a histogram's or summary's sample
// count. present says whether any series matched. A failed gather fails the test.
func Lookup(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) (sum float64, present bool) {
	t.Helper()
	return Sum(gather(t, g), name, labels)
}

// Sum is Lookup over families already gathered, for code that reports errors instead of
// failing a test (a helper off the test's goroutine, say).
func Sum(mfs []*dto.MetricFamily, name string, labels map[string]string) (sum float64, present bool) {
	for _, m := range matching(mfs, name, labels) {
		present = true
		sum += valueOf(m)
	}
	return sum, present
}

// valueOf is a series' value as Sum reads it.
func valueOf(m *dto.Metric) float64 {
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	case m.GetHistogram() != nil:
		return float64(m.GetHistogram().GetSampleCount())
	case m.GetSummary() != nil:
		return float64(m.GetSummary().GetSampleCount())
	}
	return 0
}

// Histogram is a histogram's state as a scrape shows it.
type Histogram struct {
	Count uint64  // observations
	Sum   float64 // of the observed values
	// Buckets are in increasing UpperBound order, without the implicit +Inf bucket (whose
	// count is Count).
	Buckets []Bucket
}

// Bucket is one histogram bucket: how many observations were at most UpperBound.
type Bucket struct {
	UpperBound      float64
	CumulativeCount uint64
}

// HistogramOf gathers g and merges the histogram series of name whose labels include labels
// (series of one family share their bucket bounds). present says whether any series matched.
func HistogramOf(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) (h Histogram, present bool) {
	t.Helper()
	byBound := map[float64]uint64{}
	for _, m := range matching(gather(t, g), name, labels) {
		mh := m.GetHistogram()
		if mh == nil {
			t.Fatalf("metric %s is not a histogram", name)
		}
		present = true
		h.Count += mh.GetSampleCount()
		h.Sum += mh.GetSampleSum()
		for _, b := range mh.GetBucket() {
			// A registry leaves the +Inf bucket out, the text format writes it: drop it, so
			// that both read the same.
			if !math.IsInf(b.GetUpperBound(), +1) {
				byBound[b.GetUpperBound()] += b.GetCumulativeCount()
			}
		}
	}
	for ub, n := range byBound {
		h.Buckets = append(h.Buckets, Bucket{UpperBound: ub, CumulativeCount: n})
	}
	sort.Slice(h.Buckets, func(i, j int) bool { return h.Buckets[i].UpperBound < h.Buckets[j].UpperBound })
	return h, present
}

// Sample is one series: its labels and its value as Sum reads it.
type Sample struct {
	Labels map[string]string
	Value  float64
}

// Series gathers g and returns each series of name whose labels include labels, in the
// order the registry gives them (sorted by label values).
func Series(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) []Sample {
	t.Helper()
	var out []Sample
	for _, m := range matching(gather(t, g), name, labels) {
		out = append(out, Sample{Labels: labelMap(m), Value: valueOf(m)})
	}
	return out
}

// Snapshot gathers g and returns every series of the metrics whose name starts with prefix
// as `name{a="x",b="y"}` -> value, labels sorted by name and values quoted as Go does, so
// that two snapshots can be compared key by key. Histograms and summaries give two keys,
// name_count and name_sum, as the text exposition does.
func Snapshot(t testing.TB, g prometheus.Gatherer, prefix string) map[string]float64 {
	t.Helper()
	out := make(map[string]float64)
	for _, mf := range gather(t, g) {
		if !strings.HasPrefix(mf.GetName(), prefix) {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := make([]string, 0, len(m.GetLabel()))
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			sort.Strings(labels)
			key := func(name string) string {
				if len(labels) == 0 {
					return name
				}
				return name + "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.GetCounter() != nil:
				out[key(mf.GetName())] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[key(mf.GetName())] = m.GetGauge().GetValue()
			case m.GetUntyped() != nil:
				out[key(mf.GetName())] = m.GetUntyped().GetValue()
			case m.GetHistogram() != nil:
				out[key(mf.GetName()+"_count")] = float64(m.GetHistogram().GetSampleCount())
				out[key(mf.GetName()+"_sum")] = m.GetHistogram().GetSampleSum()
			case m.GetSummary() != nil:
				out[key(mf.GetName()+"_count")] = float64(m.GetSummary().GetSampleCount())
				out[key(mf.GetName()+"_sum")] = m.GetSummary().GetSampleSum()
			}
		}
	}
	return out
}

// Scrape is a Gatherer that reads url (a /metrics endpoint) over HTTP with client (nil:
// http.DefaultClient) at each Gather, in the text format, as Prometheus would. It reads
// what a user's scraper sees, where a registry would show what the process holds.
func Scrape(client *http.Client, url string) prometheus.Gatherer {
	if client == nil {
		client = http.DefaultClient
	}
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		if err != nil {
			return nil, err
		}
		req.Header.Set("Accept", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
		resp, err := client.Do(req)
		if err != nil {
			return nil, fmt.Errorf("scrape %s: %w", url, err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("scrape %s: status %d", url, resp.StatusCode)
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		byName, err := parser.TextToMetricFamilies(resp.Body)
		if err != nil {
			return nil, fmt.Errorf("scrape %s: %w", url, err)
		}
		mfs := make([]*dto.MetricFamily, 0, len(byName))
		for _, mf := range byName {
			mfs = append(mfs, mf)
		}
		sort.Slice(mfs, func(i, j int) bool { return mfs[i].GetName() < mfs[j].GetName() })
		return mfs, nil
	})
}

func gather(t testing.TB, g prometheus.Gatherer) []*dto.MetricFamily {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather metrics: %v", err)
	}
	return mfs
}

// matching returns the series of name whose labels include want; a label a series lacks
// counts as empty, as in a Prometheus selector.
func matching(mfs []*dto.MetricFamily, name string, want map[string]string) []*dto.Metric {
	var out []*dto.Metric
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			got := labelMap(m)
			for k, v := range want {
				if got[k] != v {
					continue series
				}
			}
			out = append(out, m)
		}
	}
	return out
}

func labelMap(m *dto.Metric) map[string]string {
	got := make(map[string]string, len(m.GetLabel()))
	for _, lp := range m.GetLabel() {
		got[lp.GetName()] = lp.GetValue()
	}
	return got
}
