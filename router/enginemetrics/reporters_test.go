package enginemetrics

import (
	"slices"
	"testing"
)

// sglangLoad names SGLang's load gauges and no cache series.
type sglangLoad struct{}

func (sglangLoad) LoadMetrics() (waiting, running, kvUsage, requests string) {
	return "sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:num_requests_total"
}

// sglangCache names SGLang's cache series too.
type sglangCache struct{ sglangLoad }

func (sglangCache) CacheMetrics() (prompt, cached, capacity string) {
	return "sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:max_total_num_tokens"
}

func TestAnEngineThatNamesItsSeriesIsReadByThoseAlone(t *testing.T) {
	load := Names{Waiting: "sglang:num_queue_reqs", Running: "sglang:num_running_reqs", Usage: "sglang:token_usage", Requests: "sglang:num_requests_total"}
	if got, want := NamesOf(sglangLoad{}), []Names{load}; !slices.Equal(got, want) {
		t.Errorf("an engine that names its gauges is read by %v, want %v", got, want)
	}
	cache := load
	cache.Cache = CacheNames{"sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:max_total_num_tokens"}
	if got, want := NamesOf(sglangCache{}), []Names{cache}; !slices.Equal(got, want) {
		t.Errorf("an engine that names its cache series too is read by %v, want %v", got, want)
	}
	if got := NamesOf(struct{}{}); !slices.Equal(got, Families) {
		t.Errorf("an engine that names nothing is read by %v, want every family", got)
	}
}
