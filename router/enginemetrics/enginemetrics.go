// Package enginemetrics reads an engine's load, its requests waiting and running and its KV
// cache usage, the count of requests it has served, and the prompt tokens it has stored in
// its KV pool against the pool's size, from its Prometheus /metrics.
package enginemetrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

const (
	// maxScrapeBytes bounds a /metrics body: vLLM's, histograms and all, is well under 1 MiB.
	maxScrapeBytes = 8 << 20
	// metricsPath is where vLLM and SGLang serve their metrics, on the API port.
	metricsPath = "/metrics"
)

// Names are the series one engine family reports its load under: requests waiting (queued,
// not yet running), requests running, the KV cache usage as a fraction from 0 to 1 (""
// if none), and the counter of the requests it has served, from every client ("" if none).
// Its prefix cache (Cache) is optional.
type Names struct {
	Waiting, Running, Usage, Requests string
	Cache                             CacheNames
}

// CacheNames are the series an engine family reports its prefix cache under: the counter of
// the prompt tokens it was sent (or looked up in its prefix cache), the counter of those it
// found in its KV pool (series of another cache_source than device are left out), and its KV
// capacity: a gauge of tokens, or an info series whose num_gpu_blocks and block_size labels
// multiply to it. "" where the family has none.
type CacheNames struct{ Prompt, Cached, Capacity string }

// Families are the families tried for an engine whose own names are not known: vLLM's, then
// SGLang's.
var Families = []Names{
	{"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total",
		CacheNames{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info"}},
	{"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:num_requests_total",
		CacheNames{"sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:max_total_num_tokens"}},
}

// Load is an engine's load as one /metrics body reports it.
type Load struct {
	// Waiting and Running are the engine's gauges, summed over their series (one per data
	// parallel rank or model).
	Waiting, Running int64
	// Usage is the KV cache usage, averaged over its series; negative when not reported.
	Usage float64
	// Requests is the engine's count of the requests it has served (or taken in), summed
	// over its series (finish reasons, ranks); negative when not reported.
	Requests float64
	// KV is what the engine's counters say of its prefix cache; zero when not reported.
	KV KV
}

// KV is an engine's prefix cache by its counters: the prompt tokens it has stored in its KV
// pool since it started (sent and not found there: computed, or reloaded from another tier),
// each evicting what was least recently used once the pool is full, and how many tokens the
// pool holds, each summed over its series (ranks). Capacity is zero when either is not
// reported.
type KV struct{ Stored, Capacity float64 }

// Doer sends an HTTP request and returns its answer, as an *http.Client does.
type Doer interface {
	Do(req *http.Request) (*http.Response, error)
}

// Fetch is one GET {base}/metrics with client, within ctx, read by Parse with names.
func Fetch(ctx context.Context, client Doer, base string, names []Names) (Load, error) {
	u := strings.TrimSuffix(base, "/") + metricsPath
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return Load{}, err
	}
	// The classic text format: OpenMetrics or protobuf would need other parsers.
	req.Header.Set("Accept", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
	resp, err := client.Do(req)
	if err != nil {
		return Load{}, fmt.Errorf("scrape %s: %w", u, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return Load{}, fmt.Errorf("scrape %s: answered %d", u, resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxScrapeBytes+1))
	if err != nil {
		return Load{}, fmt.Errorf("scrape %s: %w", u, err)
	}
	if len(body) > maxScrapeBytes {
		return Load{}, fmt.Errorf("scrape %s: body over %d bytes", u, maxScrapeBytes)
	}
	l, err := Parse(body, names)
	if err != nil {
		return Load{}, fmt.Errorf("scrape %s: %w", u, err)
	}
	return l, nil
}

var errNoLoadGauges = errors.New("no load gauges")

// Parse reads an engine's load from a /metrics body in the Prometheus text format: the first
// family of names whose waiting and running gauges are both there. Values that cannot be
// counts (negative, NaN, infinite) are an error rather than a load.
func Parse(body []byte, names []Names) (Load, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation) // vLLM's names have colons
	fams, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		return Load{}, fmt.Errorf("parse metrics: %w", err)
	}
	var tried []string
	for _, n := range names {
		waiting, okW := sumOf(fams[n.Waiting])
		running, okR := sumOf(fams[n.Running])
		if !okW || !okR {
			tried = append(tried, n.Waiting+" and "+n.Running)
			continue
		}
		l := Load{Usage: -1, Requests: -1}
		if l.Waiting, err = count(n.Waiting, waiting); err != nil {
			return Load{}, err
		}
		if l.Running, err = count(n.Running, running); err != nil {
			return Load{}, err
		}
		if usage, ok := sumOf(fams[n.Usage]); ok {
			usage /= float64(len(fams[n.Usage].GetMetric()))
			if math.IsNaN(usage) || math.IsInf(usage, 0) || usage < 0 {
				return Load{}, fmt.Errorf("%s is %v", n.Usage, usage)
			}
			l.Usage = usage
		}
		if served, ok := sumOf(fams[n.Requests]); ok {
			if math.IsNaN(served) || math.IsInf(served, 0) || served < 0 {
				return Load{}, fmt.Errorf("%s is %v", n.Requests, served)
			}
			l.Requests = served
		}
		l.KV = kvOf(fams, n.Cache)
		return l, nil
	}
	return Load{}, fmt.Errorf("%w: want %s", errNoLoadGauges, strings.Join(tried, ", or "))
}

// kvOf reads an engine's prefix cache by names from fams; zero where a series is missing or
// holds what cannot be a count. It refuses nothing: the load stands without it.
func kvOf(fams map[string]*dto.MetricFamily, names CacheNames) KV {
	if names.Capacity == "" {
		return KV{}
	}
	prompt, okP := sumOf(fams[names.Prompt])
	cached, okC := sumOf(onDevice(fams[names.Cached]))
	capacity, okK := capacityOf(fams[names.Capacity])
	if !okP || !okK || !countable(prompt) || !countable(capacity) || capacity == 0 {
		return KV{}
	}
	if !okC || !countable(cached) { // a family shows no cached series before its first hit
		cached = 0
	}
	return KV{Stored: max(prompt-cached, 0), Capacity: capacity}
}

// onDevice is f without its series of a cache_source other than device: tokens found on a
// host or storage tier are copied into the KV pool as computed ones are.
func onDevice(f *dto.MetricFamily) *dto.MetricFamily {
	var out dto.MetricFamily
	for _, m := range f.GetMetric() {
		keep := true
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "cache_source" && lp.GetValue() != "device" {
				keep = false
			}
		}
		if keep {
			out.Metric = append(out.Metric, m)
		}
	}
	return &out
}

// capacityOf sums an engine's KV capacity in tokens over f's series: each series' labels
// num_gpu_blocks times block_size where it has them, else its value; never the value of an
// info series (a name ending in _info, whose value is 1), as vLLM's is before it has counted
// its blocks.
func capacityOf(f *dto.MetricFamily) (sum float64, ok bool) {
	info := strings.HasSuffix(f.GetName(), "_info")
	for _, m := range f.GetMetric() {
		var blocks, size float64
		for _, lp := range m.GetLabel() {
			switch lp.GetName() {
			case "num_gpu_blocks":
				blocks, _ = strconv.ParseFloat(lp.GetValue(), 64)
			case "block_size":
				size, _ = strconv.ParseFloat(lp.GetValue(), 64)
			}
		}
		if blocks > 0 && size > 0 {
			sum, ok = sum+blocks*size, true
			continue
		}
		if info {
			return 0, false
		}
		if v, found := valueOf(m); found {
			sum, ok = sum+v, true
		}
	}
	return sum, ok
}

// countable reports whether v can be a count of tokens.
func countable(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) && v >= 0 }

// sumOf adds up a family's series; ok is false when it has none.
func sumOf(f *dto.MetricFamily) (sum float64, ok bool) {
	for _, m := range f.GetMetric() {
		if v, found := valueOf(m); found {
			sum, ok = sum+v, true
		}
	}
	return sum, ok
}

// valueOf is a gauge's, an untyped series' or a counter's value; ok is false for another kind.
func valueOf(m *dto.Metric) (v float64, ok bool) {
	switch {
	case m.Gauge != nil:
		return m.Gauge.GetValue(), true
	case m.Untyped != nil:
		return m.Untyped.GetValue(), true
	case m.Counter != nil:
		return m.Counter.GetValue(), true
	}
	return 0, false
}

// count turns a gauge of requests into a count, refusing what cannot be one.
func count(name string, v float64) (int64, error) {
	if math.IsNaN(v) || v < 0 || v > math.MaxInt32 {
		return 0, fmt.Errorf("%s is %v", name, v)
	}
	return int64(math.Round(v)), nil
}
