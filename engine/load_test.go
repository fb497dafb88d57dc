package engine

import "testing"

// loadReporter is router.LoadReporter, which engine may not import.
type loadReporter interface {
	LoadMetrics() (waiting, running, kvUsage string)
}

func TestEveryEngineNamesTheLoadGaugesOfItsMetrics(t *testing.T) {
	want := map[string][3]string{
		KindVLLM:       {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"},
		KindVLLMLegacy: {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"},
		KindSim:        {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"},
		KindSGLang:     {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"},
		KindMooncake:   {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"},
	}
	for _, kind := range Kinds() {
		t.Run(kind, func(t *testing.T) {
			e, _ := Lookup(kind)
			lr, ok := e.(loadReporter)
			if !ok {
				t.Fatalf("engine %s does not name its load gauges: least_loaded would guess", kind)
			}
			w, r, u := lr.LoadMetrics()
			if got := [3]string{w, r, u}; got != want[kind] {
				t.Errorf("LoadMetrics() = %q, want %q", got, want[kind])
			}
		})
	}
}
