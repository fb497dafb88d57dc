package engine

import (
	"slices"
	"testing"

	"github.com/pdproxy/pdproxy/router/enginemetrics"
)

func TestEveryEngineNamesTheSeriesOfItsMetrics(t *testing.T) {
	vllm := enginemetrics.Names{Waiting: "vllm:num_requests_waiting", Running: "vllm:num_requests_running",
		Usage: "vllm:kv_cache_usage_perc", Requests: "vllm:request_success_total",
		Cache: enginemetrics.CacheNames{Prompt: "vllm:prefix_cache_queries_total", Cached: "vllm:prefix_cache_hits_total",
			Capacity: "vllm:cache_config_info"}}
	want := map[string]enginemetrics.Names{
		KindVLLM: vllm, KindVLLMLegacy: vllm, KindSim: vllm, KindMooncake: vllm,
		KindSGLang: {Waiting: "sglang:num_queue_reqs", Running: "sglang:num_running_reqs", Usage: "sglang:token_usage",
			Requests: "sglang:num_requests_total", Cache: enginemetrics.CacheNames{Prompt: "sglang:prompt_tokens_total",
				Cached: "sglang:cached_tokens_total", Capacity: "sglang:max_total_num_tokens"}},
	}
	for _, kind := range Kinds() {
		t.Run(kind, func(t *testing.T) {
			e, _ := Lookup(kind)
			// Without its own names an engine is read by guessing the family (least_loaded), and
			// without its cache series the cache-aware tree credits it past its KV turnover.
			if got := enginemetrics.NamesOf(e); !slices.Equal(got, []enginemetrics.Names{want[kind]}) {
				t.Errorf("the router reads engine %s by %+v, want %+v", kind, got, want[kind])
			}
		})
	}
}
