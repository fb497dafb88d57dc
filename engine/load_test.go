package engine

import "testing"

// loadReporter is router.LoadReporter, which engine may not import.
type loadReporter interface {
	LoadMetrics() (waiting, running, kvUsage, requests string)
}

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
			lr, ok := e.(loadReporter)
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
