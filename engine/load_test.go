package engine

import (
	"testing"

	"github.com/pdproxy/pdproxy/router/enginemetrics"
)

func TestEveryEngineNamesTheLoadSeriesOfItsMetrics(t *testing.T) {
	want := map[string][4]string{
		KindVLLM:       {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"},
		KindVLLMLegacy: {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"},
		KindSim:        {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"},
		KindSGLang:     {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:num_requests_total"},
		KindMooncake:   {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"},
	}
	for _, kind := range Kinds() {
		t.Run(kind, func(t *testing.T) {
			e, _ := Lookup(kind)
			lr, ok := e.(enginemetrics.LoadReporter)
			if !ok {
				t.Fatalf("engine %s does not name its load gauges: least_loaded would guess", kind)
			}
			w, r, u, n := lr.LoadMetrics()
			if got := [4]string{w, r, u, n}; got != want[kind] {
				t.Errorf("LoadMetrics() = %q, want %q", got, want[kind])
			}
		})
	}
}

func TestEveryEngineNamesTheCacheSeriesOfItsMetrics(t *testing.T) {
	vllm := [3]string{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info"}
	want := map[string][3]string{
		KindVLLM: vllm, KindVLLMLegacy: vllm, KindSim: vllm, KindMooncake: vllm,
		KindSGLang: {"sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:max_total_num_tokens"},
	}
	for _, kind := range Kinds() {
		t.Run(kind, func(t *testing.T) {
			e, _ := Lookup(kind)
			cr, ok := e.(enginemetrics.CacheReporter)
			if !ok {
				t.Fatalf("engine %s does not name its prefix cache series: the cache-aware tree would credit it past its KV capacity", kind)
			}
			p, c, k := cr.CacheMetrics()
			if got := [3]string{p, c, k}; got != want[kind] {
				t.Errorf("CacheMetrics() = %q, want %q", got, want[kind])
			}
		})
	}
}
