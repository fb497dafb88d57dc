// Package enginemetrics reads an engine's load, its requests waiting and running and its KV
// cache usage, and the count of requests it has served, from its Prometheus /metrics.
package enginemetrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
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
type Names struct{ Waiting, Running, Usage, Requests string }

// Families are the families tried for an engine whose own names are not known: vLLM's, then
// SGLang's.
var Families = []Names{
	{"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"},
	{"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:num_requests_total"},
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
}

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
		return l, nil
	}
	return Load{}, fmt.Errorf("%w: want %s", errNoLoadGauges, strings.Join(tried, ", or "))
}

// sumOf adds up a family's series; ok is false when it has none.
func sumOf(f *dto.MetricFamily) (sum float64, ok bool) {
	for _, m := range f.GetMetric() {
		switch {
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		case m.Untyped != nil:
			sum += m.Untyped.GetValue()
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		default:
			continue
		}
		ok = true
	}
	return sum, ok
}

// count turns a gauge of requests into a count, refusing what cannot be one.
func count(name string, v float64) (int64, error) {
	if math.IsNaN(v) || v < 0 || v > math.MaxInt32 {
		return 0, fmt.Errorf("%s is %v", name, v)
	}
	return int64(math.Round(v)), nil
}
